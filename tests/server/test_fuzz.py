"""Malformed request bodies never get a 500: every answer is a success or a well-shaped 4xx error."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
anything = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                                     max_size=3), max_leaves=8)
small_int = st.integers(min_value=1, max_value=3)
schema = st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 2}, {"enum": [1, "a"]},
                          {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                           "required": ["a"]}, {"type": "nope"}, {"$ref": "#/missing"}, {"anyOf": []}])
structured_outputs = st.fixed_dictionaries({}, optional={
    "json": schema | st.sampled_from(['{"type": "object"}', "{not json", "[1]"]),
    "regex": st.sampled_from(["[a-z]{1,3}", "(", ""]), "choice": st.lists(st.text(max_size=4), max_size=3),
    "grammar": st.sampled_from(['root ::= "a" [0-9]', "start: \"a\"", "root ::= ((", ""]),
    "json_object": st.booleans(), "structural_tag": anything | st.sampled_from([
        {"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}]},
        '{"triggers": ["<tool_call>"], "structures": [{"begin": "<tool_call>", "schema": {}, "end": "x"}]}',
        {"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {"type": "nope"}, "end": ""}]},
        {"triggers": [1], "structures": "x"}, {"format": {}}]), "whitespace_pattern": st.sampled_from([" ", "(", ""]),
    "disable_any_whitespace": st.booleans(), "disable_additional_properties": st.booleans()})
VLLM_FIELDS = {"structured_outputs": structured_outputs, "guided_json": schema, "guided_choice": st.lists(
    st.text(max_size=4), max_size=3), "guided_regex": st.sampled_from(["a+", "("]), "prompt_logprobs": small_int}
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "other"])}, optional={
    "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "get_weather", "", "bad name"])},
                                      optional={"parameters": schema, "strict": st.booleans(),
                                                "description": st.text(max_size=10)})})
content = st.text(max_size=30) | st.text(max_size=30) | st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "tool_result", "thinking"])},
    optional={"text": st.text(max_size=10)}), max_size=2)
chat_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "system", "assistant", "tool",
                                                              "bogus"]), "content": content}, optional={
    "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
        {"name": st.text(max_size=5), "arguments": st.sampled_from(["{}", "{", '{"a": 1}', "[]"])})}),
        max_size=2), "tool_call_id": st.text(max_size=5), "reasoning_content": st.text(max_size=5)})

CHAT_FIELDS = {
    "model": st.just("ember-demo"), "messages": st.lists(chat_message, min_size=1, max_size=3),
    "max_tokens": small_int, "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": small_int, "min_p": st.floats(0, 1), "n": small_int, "seed": st.integers(0, 2**63),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2),
    "logprobs": st.booleans(), "top_logprobs": small_int, "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logit_bias": st.dictionaries(st.sampled_from(["0", "5", "-1", "x", "99999999"]), st.floats(-200, 200),
                                  max_size=2),
    "presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "regex", "grammar", "x"])},
        optional={"json_schema": st.fixed_dictionaries({"name": st.text(max_size=4)}, optional={"schema": schema}),
                  "regex": st.sampled_from(["[a-z]{1,3}", "(", ""]), "grammar": st.sampled_from(
                      ["start: \"a\"", "start: ", "%%%"])}),
    "tools": st.lists(tool, max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required", "x"]) | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "zz"])})})
   ,
    "parallel_tool_calls": st.booleans(), "return_token_ids": st.booleans(), "max_thinking_tokens": small_int,
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "tokenize", "x", "messages"]),
                                            anything, max_size=2),
    "continue_final_message": st.booleans(), "add_generation_prompt": st.booleans(),
    "stop_token_ids": st.lists(st.integers(-3, 2000), max_size=2), "min_tokens": st.integers(0, 5),
    "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(), **VLLM_FIELDS,
}
block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "text", "tool_use", "tool_result", "thinking", "image", "x"])},
    optional={"text": st.text(max_size=5), "id": st.text(max_size=3), "name": st.text(max_size=3),
              "input": st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
              "tool_use_id": st.text(max_size=3), "content": st.text(max_size=5), "thinking": st.text(max_size=4)})
anthropic_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "assistant", "system"]),
                                           "content": st.text(max_size=20) | st.lists(block, max_size=3)})
MESSAGES_FIELDS = {
    "model": st.just("ember-demo"), "max_tokens": small_int,
    "messages": st.lists(anthropic_message, min_size=1, max_size=3),
    "system": st.text(max_size=10), "stream": st.booleans(),
    "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "", "a b"])},
                                            optional={"input_schema": schema, "type": st.sampled_from(
                                                ["custom", "web_search_20250305"])}), max_size=2),
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                         optional={"name": st.sampled_from(["f", "zz"])}),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"])},
                                      optional={"budget_tokens": small_int}),
    "stop_sequences": st.lists(st.text(max_size=3), max_size=2),
    "temperature": st.floats(0, 1.5), "top_k": small_int,
    "output_config": st.fixed_dictionaries({"format": st.fixed_dictionaries({"type": st.just("json_schema"),
                                                                            "schema": schema})}),
}
COMPLETION_FIELDS = {
    "model": st.just("ember-demo"),
    "prompt": st.text(max_size=20) | st.lists(st.integers(-5, 2000), max_size=5)
    | st.lists(st.lists(st.integers(0, 1300), max_size=3), max_size=2),
    "max_tokens": small_int, "n": small_int, "echo": st.booleans(),
    "logprobs": small_int, "stream": st.booleans(), "suffix": st.none() | st.text(max_size=2),
    "best_of": small_int, "stop": st.text(max_size=2),
    "temperature": st.floats(0, 2), **VLLM_FIELDS,
}
input_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_text", "input_image", "refusal", "x"])},
    optional={"text": st.text(max_size=8), "refusal": st.text(max_size=4)})
input_item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "assistant", "system", "developer", "tool"])},
                          optional={"type": st.just("message"),
                                    "content": st.text(max_size=20) | st.lists(input_part, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call")}, optional={
        "call_id": st.sampled_from(["c1", "c2"]), "name": st.sampled_from(["f", "get_weather"]),
        "arguments": st.sampled_from(["{}", "{", '{"a": 1}', "[]"])}),
    st.fixed_dictionaries({"type": st.just("function_call_output")}, optional={
        "call_id": st.sampled_from(["c1", "c9"]), "output": st.text(max_size=5) | st.lists(input_part, max_size=1)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "web_search_call"])}, optional={
        "content": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["reasoning_text", "x"]),
                                                   "text": st.text(max_size=5)}), max_size=2),
        "summary": anything}))
RESPONSES_FIELDS = {
    "model": st.just("ember-demo"), "input": st.text(max_size=20) | st.lists(input_item, max_size=4),
    "instructions": st.text(max_size=10), "max_output_tokens": small_int, "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": small_int, "seed": st.integers(0, 2**63),
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "web_search"])},
                                            optional={"name": st.sampled_from(["f", "get_weather", "", "bad name"]),
                                                      "parameters": schema, "strict": st.booleans()}), max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required", "x"]) | st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "allowed_tools"]), "name": st.sampled_from(["f", "zz"])}),
    "parallel_tool_calls": st.booleans(),
    "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
        optional={"name": st.text(max_size=3), "schema": schema, "strict": st.booleans()})}),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "high", "x"]),
                                                     "summary": st.sampled_from(["auto", "x"])}),
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content",
                                         "file_search_call.results"]), max_size=2),
    "top_logprobs": small_int, "stream": st.booleans(), "store": st.booleans(),
    "previous_response_id": st.sampled_from(["resp_missing", ""]),
    "metadata": st.dictionaries(st.text(max_size=3), st.text(max_size=3) | st.integers(), max_size=2),
    "truncation": st.sampled_from(["auto", "disabled", "x"]), "background": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), anything, max_size=1),
}
EMBEDDINGS_FIELDS = {
    "model": st.just("ember-demo"),
    "input": st.text(max_size=20) | st.lists(st.text(max_size=8), max_size=3) | st.lists(st.integers(-5, 2000),
                                                                                          max_size=5)
    | st.lists(st.lists(st.integers(-1, 1300), max_size=3), max_size=2),
    "encoding_format": st.sampled_from(["float", "base64", "x"]), "dimensions": st.integers(-2, 100),
    "truncate_prompt_tokens": st.integers(-3, 300), "add_special_tokens": st.booleans(), "user": st.text(max_size=3),
}

texts = st.text(max_size=12) | st.lists(st.text(max_size=8), max_size=3)
SCORE_FIELDS = {"model": st.just("ember-demo"), "text_1": texts, "text_2": texts,
                "truncate_prompt_tokens": st.integers(-3, 300)}
RERANK_FIELDS = {"model": st.just("ember-demo"), "query": st.text(max_size=12),
                 "documents": st.lists(st.text(max_size=8), max_size=4), "top_n": st.integers(-1, 5),
                 "return_documents": st.booleans(), "truncate_prompt_tokens": st.integers(-3, 300)}


REQUIRED = {"/v1/chat/completions": ("model", "messages"), "/v1/messages": ("model", "messages", "max_tokens"),
            "/v1/completions": ("model", "prompt"), "/v1/responses": ("model", "input"),
            "/v1/embeddings": ("model", "input"), "/v1/score": ("text_1", "text_2"),
            "/v1/rerank": ("query", "documents")}


def bodies(fields: dict, required: tuple[str, ...] = ()):
    """Mostly-plausible bodies (so validation passes and generation, templates and grammars run), the same with one
    field replaced by arbitrary JSON, and arbitrary JSON."""
    optional = sorted(k for k in fields if k not in required)
    base = st.tuples(st.fixed_dictionaries({k: fields[k] for k in required}),
                     st.lists(st.sampled_from(optional), max_size=5, unique=True).flatmap(
                         lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys}))).map(
        lambda t: {**t[0], **t[1]})
    mutated = st.tuples(base, st.sampled_from(sorted(fields)), anything).map(lambda t: {**t[0], t[1]: t[2]})
    dropped = st.tuples(base, st.sampled_from(sorted(fields))).map(
        lambda t: {k: v for k, v in t[0].items() if k != t[1]})
    return st.one_of(base, base, mutated, dropped, anything).map(_bound_generation)


def _bound_generation(body):
    """Keep every accepted request short: the fuzz is about validation, not long generations."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            v = body.get(key)
            if key not in body or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 3):
                body[key] = 2
    return body


def _post(server, path, body):
    raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    if r.status_code >= 400:
        err = r.json()
        if path.startswith("/v1/messages"):
            assert err["type"] == "error" and err["error"]["message"]
        else:
            assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    return r


FUZZ = settings(max_examples=70, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.mark.parametrize("path,fields", [("/v1/chat/completions", CHAT_FIELDS), ("/v1/messages", MESSAGES_FIELDS),
                                         ("/v1/completions", COMPLETION_FIELDS),
                                         ("/v1/responses", RESPONSES_FIELDS), ("/v1/embeddings", EMBEDDINGS_FIELDS),
                                         ("/v1/score", SCORE_FIELDS), ("/v1/rerank", RERANK_FIELDS)])
def test_fuzzed_bodies_never_500(demo_server, path, fields):
    @FUZZ
    @given(bodies(fields, REQUIRED[path]))
    def run(body):
        _post(demo_server, path, _bound_generation(body))

    run()


@FUZZ
@given(st.binary(max_size=40) | bodies(MESSAGES_FIELDS, ("model", "messages")).map(json.dumps).map(str.encode))
def test_fuzzed_raw_bytes_and_count_tokens_never_500(demo_server, raw):
    _post(demo_server, "/v1/messages/count_tokens", raw)
    _post(demo_server, "/v1/chat/completions", raw)
