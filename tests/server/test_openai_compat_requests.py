"""Request bodies as OpenAI and vLLM clients send them: `null` for a nullable field means its default, and a 400
from a rule between fields names the field in `param`."""
from __future__ import annotations

import httpx
import pytest

HI = [{"role": "user", "content": "Say hello."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_null_fields_take_their_defaults(demo_server):
    chat = _post(demo_server, "/v1/chat/completions", {
        "messages": HI, "max_tokens": 3, "n": None, "logprobs": None, "stream": None, "presence_penalty": None,
        "frequency_penalty": None, "parallel_tool_calls": None, "top_logprobs": None, "seed": None, "user": None,
        "stop": None, "temperature": None, "max_completion_tokens": None, "tool_choice": None,
        "response_format": None, "stream_options": None, "logit_bias": None})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    text = _post(demo_server, "/v1/completions", {
        "prompt": "Hello", "max_tokens": 3, "n": None, "logprobs": None, "stream": None, "echo": None,
        "presence_penalty": None, "frequency_penalty": None, "best_of": None, "suffix": None, "seed": None})
    assert text.status_code == 200, text.text
    assert len(text.json()["choices"]) == 1 and not text.json()["choices"][0]["text"].startswith("Hello")
    resp = _post(demo_server, "/v1/responses", {"input": "Hello", "max_output_tokens": 3, "store": None,
                                                "stream": None, "parallel_tool_calls": None, "top_logprobs": None})
    assert resp.status_code == 200, resp.text
    stored = httpx.get(f"{demo_server.url}/v1/responses/{resp.json()['id']}", timeout=60)
    assert stored.status_code == 200 and resp.json()["parallel_tool_calls"] is True  # store and the rest: defaults


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "tools": [WEATHER],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"messages": HI, "continue_final_message": True}, "continue_final_message"),
    ("/v1/completions", {"prompt": "Hi", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": "Hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/chat/completions", {"messages": HI, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "foo", "text": "x"}]}]},
     "messages[0].content[0].type"),
])
def test_rules_between_fields_name_the_field(demo_server, path, body, param):
    r = _post(demo_server, path, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0] in err["message"]


def test_a_bad_text_format_schema_names_text_format(demo_server):
    r = _post(demo_server, "/v1/responses", {"input": "Hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"].startswith("text.format") and "response_format" not in err["message"]
    assert err["param"] == "text.format"
