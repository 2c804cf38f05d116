"""Request bodies as OpenAI and vLLM clients send them: `null` for a nullable field means its default, and a 400
from a rule between fields names the field in `param`."""
from __future__ import annotations

import json

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
    for modalities in (["text"], []):  # asking for no more than text is served (an empty list was a 400)
        r = _post(demo_server, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "modalities": modalities})
        assert r.status_code == 200, r.text
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
    # the model would silently not see them, or not be made to call, speak or search: each was a 200 in plain text
    ("/v1/chat/completions", {"messages": HI, "functions": [WEATHER["function"]]}, "functions"),
    ("/v1/chat/completions", {"messages": HI, "function_call": {"name": "get_weather"}}, "function_call"),
    ("/v1/chat/completions", {"messages": HI, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": HI, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"messages": HI, "web_search_options": {}}, "web_search_options"),
    # the bad item of a token list (a prompt's union member is chosen by its first item: one error, not one per ID)
    ("/v1/completions", {"prompt": [1, 2, "x"]}, "prompt[2]"),
    ("/v1/completions", {"prompt": list(range(11)) + ["x"]}, "prompt[11]"),
    ("/v1/completions", {"prompt": [[1, 2], [3, "x"]]}, "prompt[1][1]"),
    ("/v1/completions", {"prompt": [[1], []]}, "prompt[1]"),  # the empty one of a batch
    # vLLM refuses per-request logits processors without --logits-processor-pattern: ignored, they changed nothing
    ("/v1/chat/completions", {"messages": HI, "logits_processors": ["pkg.mod.Proc"]}, "logits_processors"),
    ("/v1/completions", {"prompt": "Hi", "logits_processors": [{"qualname": "pkg.mod.Proc"}]}, "logits_processors"),
    ("/v1/chat/completions", {"messages": HI, "tools": [WEATHER], "tool_choice": {  # named tool_choice.function
        "type": "custom", "custom": {"name": "get_weather"}}}, "tool_choice.type"),
    ("/v1/chat/completions", {"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "allowed_tools",
     "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]}}},
     "tool_choice.allowed_tools.tools"),
    # the Responses API's flat named form sent to chat: the function form's missing field, not allowed_tools's
    ("/v1/chat/completions", {"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                                  "name": "get_weather"}},
     "tool_choice.function"),
    # vLLM's per-request template is refused wherever messages are rendered (/tokenize and embeddings ignored it)
    ("/tokenize", {"messages": HI, "chat_template": "{{ messages[0].content }}"}, "chat_template"),
    ("/v1/embeddings", {"messages": HI, "chat_template": "{{ messages[0].content }}"}, "chat_template"),
])
def test_rules_between_fields_name_the_field(demo_server, path, body, param):
    r = _post(demo_server, path, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0] in err["message"]


def test_a_legacy_function_call_and_a_refusal_in_history_are_rendered(demo_server):
    """An assistant turn's legacy ``function_call`` renders as its tool call, before the ``function`` reply that
    answers it, and a ``refusal`` without content as the turn's text (both were dropped: an empty assistant turn);
    enum values the SDKs send (reasoning_effort "max", thinking "between_tools") are accepted."""
    call = '{"city": "Paris"}'
    legacy = [HI[0], {"role": "assistant", "content": None,
                      "function_call": {"name": "get_weather", "arguments": call}},
              {"role": "function", "name": "get_weather", "content": "sunny"}]
    current = [HI[0], {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": call}}]},
               {"role": "tool", "content": "sunny"}]
    tokens = [_post(demo_server, "/tokenize", {"messages": m, "tools": [WEATHER]}).json()["tokens"]
              for m in (legacy, current)]
    assert tokens[0] == tokens[1]
    refused = _post(demo_server, "/tokenize", {"messages": [
        HI[0], {"role": "assistant", "content": None, "refusal": "I cannot help with that."}, HI[0]]})
    assert "I cannot help with that." in demo_server.tokenizer.decode(refused.json()["tokens"])
    effort = _post(demo_server, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "reasoning_effort": "max"})
    assert effort.status_code == 200, effort.text
    thinking = _post(demo_server, "/v1/messages/count_tokens", {"model": demo_server.model, "messages": HI,
                                                                 "thinking": {"type": "between_tools"}})
    assert thinking.status_code == 200, thinking.text


def test_a_bad_text_format_schema_names_text_format(demo_server):
    r = _post(demo_server, "/v1/responses", {"input": "Hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"].startswith("text.format") and "response_format" not in err["message"]
    assert err["param"] == "text.format"


def test_chat_echo_prepends_the_continued_message(demo_server):
    """vLLM's chat `echo`: a reply continuing the last message (same role) starts with that message's text, streamed
    (a chunk of its own after the role chunks) or not; a reply after a generation prompt echoes nothing."""
    prefill = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "It is"}]
    ask = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 4,
           "temperature": 0, "n": 2, "chat_template_kwargs": {"enable_thinking": False}}
    plain = [c["message"]["content"] for c in _post(demo_server, "/v1/chat/completions", ask).json()["choices"]]
    echoed = [c["message"]["content"] for c in
              _post(demo_server, "/v1/chat/completions", {**ask, "echo": True}).json()["choices"]]
    assert echoed == ["It is" + p for p in plain]
    with httpx.stream("POST", demo_server.url + "/v1/chat/completions", timeout=60,
                      json={**ask, "echo": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c["choices"][0]["delta"].get("content") for c in chunks[2:4]] == ["It is", "It is"]
    streamed = ["".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"][0]["index"] == i)
                for i in (0, 1)]
    assert streamed == echoed
    after_prompt = _post(demo_server, "/v1/chat/completions", {"messages": HI, "max_tokens": 3, "temperature": 0,
                                                                "echo": True}).json()
    assert not after_prompt["choices"][0]["message"]["content"].startswith("Say hello.")
