"""vLLM's structured-output fields (`structured_outputs`, and the `guided_*` fields older clients send) on chat and
text completions, through the real `openai` SDK against the live demo server: each constrains the answer as vLLM
documents it, and a bad or conflicting one is a 400 naming its field."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

HI = [{"role": "user", "content": "Answer."}]
THINK_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
CHOICES = ["yes", "no", 'maybe "so"\n']


def _chat(server, extra: dict, seed: int, stream: bool = False, **kw) -> tuple[str, str | None, str]:
    """(content, reasoning, finish_reason) of one chat reply, streamed or not."""
    client = server.openai()
    args = dict(model=server.model, messages=HI, max_tokens=kw.pop("max_tokens", 40), seed=seed, temperature=1.0,
                extra_body=extra, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        msg = r.choices[0].message
        return msg.content or "", (msg.model_extra or {}).get("reasoning_content"), r.choices[0].finish_reason
    content, reasoning, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            finish = c.finish_reason or finish
    return content, reasoning or None, finish


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}],
                         ids=["structured_outputs", "guided"])
def test_choice_answers_exactly_one_option_streamed_or_not(any_server, extra):
    """On the demo model and on the real Qwen3 tokenizer and template (the quote and newline are pieces of larger
    tokens there)."""
    for seed in range(4):
        full = _chat(any_server, {**extra, **THINK_OFF}, seed)
        assert full[0] in CHOICES and full[2] == "stop", full
        assert _chat(any_server, {**extra, **THINK_OFF}, seed, stream=True) == full


def test_choice_applies_after_the_thought(demo_server):
    """With thinking on, the thought is free and the answer after `</think>` is one of the options (after at most
    the few whitespace characters models put after a thought)."""
    extra = {"structured_outputs": {"choice": CHOICES}, "max_thinking_tokens": 3,
             "chat_template_kwargs": {"enable_thinking": True}}
    content, reasoning, finish = _chat(demo_server, extra, seed=5)
    answer = content.lstrip(" \t\r\n")
    assert reasoning and answer in CHOICES and len(content) - len(answer) <= 8 and finish == "stop"


def test_regex_and_gbnf_grammar(demo_server):
    for seed in range(3):
        text, _, _ = _chat(demo_server, {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}, **THINK_OFF}, seed)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text
        text, _, _ = _chat(demo_server, {"guided_regex": r"(ab|cd){2}", **THINK_OFF}, seed)
        assert re.fullmatch(r"(ab|cd){2}", text), text
        gbnf = 'root ::= "id-" digit digit ("!" | "?")\ndigit ::= [0-9]\n'
        text, _, _ = _chat(demo_server, {"structured_outputs": {"grammar": gbnf}, **THINK_OFF}, seed)
        assert re.fullmatch(r"id-[0-9]{2}[!?]", text), text
    # GBNF's \u / \U escapes (the translator cut their digits short: a 400), and Lark's inlined ?start (read as GBNF)
    escaped = 'root ::= "\\u00e9" [\\u0041-\\u0043] [\\U0001F600]\n'
    text, _, _ = _chat(demo_server, {"structured_outputs": {"grammar": escaped}, **THINK_OFF}, 0)
    assert re.fullmatch("é[A-C]\U0001F600", text), text
    inlined = '?start: pair\n?pair: word " " word\nword: /[a-z]{2}/\n'
    text, _, _ = _chat(demo_server, {"structured_outputs": {"grammar": inlined}, **THINK_OFF}, 0)
    assert re.fullmatch(r"[a-z]{2} [a-z]{2}", text), text


def test_json_schema_given_as_text_and_its_layout_options(demo_server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    for seed in range(3):
        closed = {"json": json.dumps(schema), "disable_additional_properties": True}
        text, _, finish = _chat(demo_server, {"structured_outputs": closed, **THINK_OFF}, seed, max_tokens=60)
        assert finish == "stop" and set(json.loads(text)) == {"n", "ok"}, text  # no extra keys
        assert ", " in text  # Ember's default layout
        compact = {"json": schema, "disable_any_whitespace": True, "disable_additional_properties": True}
        text, _, _ = _chat(demo_server, {"structured_outputs": compact, **THINK_OFF}, seed, max_tokens=60)
        assert " " not in text and set(json.loads(text)) == {"n", "ok"}, text
        legacy = {"guided_json": {**schema, "additionalProperties": False}, "guided_whitespace_pattern": "[ ]{2}"}
        text, _, _ = _chat(demo_server, {**legacy, **THINK_OFF}, seed, max_tokens=80)
        assert set(json.loads(text)) == {"n", "ok"} and set(re.findall(" +", text)) == {"  "}, text


def test_completions_take_structured_outputs_and_response_format(demo_server):
    client = demo_server.openai()
    kw = dict(model=demo_server.model, prompt="The answer is", max_tokens=40, temperature=1.0, n=3, seed=2)
    r = client.completions.create(extra_body={"structured_outputs": {"choice": CHOICES}}, **kw)
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(extra_body={"guided_regex": "[a-c]{4}"}, **kw)
    assert all(re.fullmatch("[a-c]{4}", c.text) for c in r.choices)
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"],
              "additionalProperties": False}
    r = client.completions.create(
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}},
        **kw)
    assert [json.loads(c.text)["k"] in (1, 2) for c in r.choices] == [True] * 3
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        stream=True, extra_body={"structured_outputs": {"choice": CHOICES}}, **{**kw, "n": 1}))
    assert streamed in CHOICES


@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "guided_json"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}},
     "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "root ::= (("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"structural_tag": {"type": "structural_tag"}}},
     "structured_outputs.structural_tag.triggers"),
    ({"structured_outputs": {"structural_tag": '{"type": "structural_tag", "triggers": ["<f"], "structures": '
                                               '[{"begin": "<g>", "schema": {}, "end": ""}]}'}},
     "structured_outputs.structural_tag.structures[0].begin"),
    ({"structured_outputs": {"structural_tag": "{oops"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": "(["}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": "(["}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": ""}},
     "structured_outputs.whitespace_pattern"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "(["}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {"type": "tag"}}}},
     "structured_outputs.structural_tag"),
])
def test_bad_or_conflicting_fields_are_400s_naming_them(demo_server, extra, param):
    client = demo_server.openai()
    for create in (lambda: client.chat.completions.create(model=demo_server.model, messages=HI, max_tokens=4,
                                                           extra_body=extra),
                   lambda: client.completions.create(model=demo_server.model, prompt="x", max_tokens=4,
                                                     extra_body=extra)):
        with pytest.raises(openai.BadRequestError) as e:
            create()
        assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("schema", [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 3,
                                                                            "maximum": 1}}, "required": ["a"]},
                                    {"type": "object", "properties": {"a": {"type": "frob"}}}])
def test_a_tool_schema_the_grammar_cannot_take_is_a_400_naming_that_tool(demo_server, schema):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g", "parameters": schema}}]
    with pytest.raises(openai.BadRequestError) as e:
        demo_server.openai().chat.completions.create(model=demo_server.model, messages=HI, max_tokens=4,
                                                     tools=tools, tool_choice="required")
    assert e.value.body["param"] == "tools[1].function.parameters", e.value.body


def test_a_forced_tool_call_on_a_server_that_parses_no_tools_is_a_400(rebuilt_server):
    """With --tool-parser none a forced call could not be parsed out of the reply: every API refuses it naming
    tool_choice instead of answering in free text; "auto" still answers (the markup stays content)."""
    srv = rebuilt_server(tool_parser="none")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for choice in ["required", {"type": "function", "function": {"name": "f"}},
                   {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                       {"type": "function", "function": {"name": "f"}}]}}]:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": HI, "max_tokens": 2, "tools": tools, "tool_choice": choice})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "tool_choice"), r.text
    r = httpx.post(srv.url + "/v1/responses", timeout=60, json={
        "input": "hi", "max_output_tokens": 2, "tool_choice": "required",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "tool_choice"), r.text
    r = httpx.post(srv.url + "/v1/messages", timeout=60, json={
        "model": "ember-demo", "max_tokens": 2, "messages": HI, "tool_choice": {"type": "any"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"], r.text
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": HI, "max_tokens": 2, "tools": tools, "tool_choice": "auto"})
    assert r.status_code == 200 and not r.json()["choices"][0]["message"].get("tool_calls"), r.text


# Python's JSON reader takes NaN and Infinity, which JSON (and so a grammar's schema) cannot hold: the raw bodies
# below carry them where each API takes a schema; every route refuses them before reading the body
# (`body_check.invalid_field`).
_NAN_FIELDS = [
    ('"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "number", '
     '"maximum": NaN}}}', "response_format.json_schema.schema"),
    ('"guided_json": {"enum": [Infinity, 1]}', "guided_json"),
    ('"guided_json": {"enum": [1' + "0" * 400 + '.0]}', "guided_json"),  # no exponent, still past a double's range
    ('"structured_outputs": {"json": {"type": "number", "minimum": -Infinity}}', "structured_outputs.json"),
    ('"structured_outputs": {"json": {"type": "number", "minimum": -Infinity}, "disable_additional_properties": true}',
     "structured_outputs.json"),
    ('"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}, {"type": '
     '"function", "function": {"name": "g", "strict": true, "parameters": {"type": "object", "properties": {"a": '
     '{"const": NaN}}}}}], "tool_choice": "required"', "tools[1].function.parameters"),
    ('"response_format": {"type": "structural_tag", "triggers": ["<f"], "structures": [{"begin": "<f>", "end": '
     '"</f>", "schema": {"maximum": NaN}}]}', "response_format.structures[0].schema"),
    ('"structured_outputs": {"structural_tag": {"triggers": ["<f"], "structures": [{"begin": "<f>", "end": "</f>", '
     '"schema": {"maximum": NaN}}]}}', "structured_outputs.structural_tag.structures[0].schema"),
]


@pytest.mark.parametrize("field,param", _NAN_FIELDS, ids=[p for _, p in _NAN_FIELDS])
def test_nan_or_infinity_in_a_schema_is_a_400_naming_its_field(demo_server, field, param):
    bodies = {"/v1/chat/completions": '{"messages": [{"role": "user", "content": "hi"}], ',
              "/v1/completions": '{"prompt": "x", '}
    for path, head in bodies.items():
        if path == "/v1/completions" and field.startswith('"tools"'):
            continue  # text completions take no tools
        body = head + f'"model": "{demo_server.model}", "max_tokens": 4, {field}}}'
        r = httpx.post(demo_server.url + path, content=body, headers={"content-type": "application/json"},
                       timeout=60)
        error = r.json()["error"]  # named down to the number itself, before any handler reads the body
        assert r.status_code == 400 and error["param"].startswith(param + "."), (path, r.text)
        assert "not a finite JSON number" in error["message"], error


@pytest.mark.parametrize("field,param", [
    ('"output_config": {"format": {"type": "json_schema", "schema": {"type": "number", "maximum": NaN}}}',
     "output_config.format.schema"),
    ('"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"const": Infinity}}}}], '
     '"tool_choice": {"type": "any"}', "tools[0].input_schema"),
], ids=["output_config", "tools"])
def test_nan_in_an_anthropic_schema_is_a_400_naming_its_field(demo_server, field, param):
    """Anthropic's errors have no ``param``: the message names the field (the flat ``tools[0].input_schema``)."""
    body = (f'{{"model": "{demo_server.model}", "max_tokens": 4, "messages": [{{"role": "user", "content": "hi"}}], '
            f'{field}}}')
    r = httpx.post(demo_server.url + "/v1/messages", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    error = r.json()["error"]  # no param here: the message names the number's path
    assert r.status_code == 400 and f"'{param}." in error["message"] and "finite" in error["message"], r.text


TAG = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "schema": {"type": "object", "properties": {"city": {"type": "string"}}},
     "end": "</function>"}]}


@pytest.mark.parametrize("extra", [{"structured_outputs": {"structural_tag": json.dumps(TAG)}},
                                   {"structured_outputs": {"structural_tag": TAG}},
                                   {"response_format": TAG}], ids=["json-text", "object", "response_format"])
def test_structural_tags_are_accepted_in_each_spelling(demo_server, extra):
    """vLLM's spellings of a structural tag reach the grammar (which tests/grammar/test_structural_tag.py checks):
    the reply is free text in which the trigger, if written, opens a valid structure."""
    client = demo_server.openai()
    r = client.chat.completions.create(model=demo_server.model, messages=HI, max_tokens=8, extra_body={**extra,
                                                                                                      **THINK_OFF})
    text = r.choices[0].message.content or ""
    assert "<function=" not in text or text.split("<function=", 1)[1].startswith("get_weather>")


def test_logprobs_of_tokens_the_grammar_rules_out_are_json(demo_server):
    """With a grammar, most alternatives are masked to -inf, which JSON cannot hold: they come back as -9999.0 (as
    OpenAI and vLLM report them), streamed or not, on chat and completions."""
    client = demo_server.openai()
    text = client.completions.create(model=demo_server.model, prompt="x", max_tokens=3, logprobs=20,
                                     extra_body={"guided_choice": ["yes", "no"]})
    tops = [v for d in text.choices[0].logprobs.top_logprobs for v in d.values()]
    assert min(tops) == -9999.0 and all(v >= -9999.0 for v in tops)
    chat = client.chat.completions.create(model=demo_server.model, messages=HI, max_tokens=3, logprobs=True,
                                          top_logprobs=20, extra_body={"structured_outputs": {"choice": CHOICES},
                                                                       **THINK_OFF})
    tops = [t.logprob for e in chat.choices[0].logprobs.content for t in e.top_logprobs]
    assert min(tops) == -9999.0
    streamed = [c for c in client.completions.create(model=demo_server.model, prompt="x", max_tokens=3, logprobs=20,
                                                     stream=True, extra_body={"guided_choice": ["yes", "no"]})]
    assert all(v >= -9999.0 for c in streamed for ch in c.choices if ch.logprobs
               for d in ch.logprobs.top_logprobs for v in d.values())


def test_a_tokenizer_with_tokens_past_the_models_logits_still_constrains(tmp_path):
    """A tokenizer_config naming a pad token the vocabulary lacks (transformers appends it past the model's logits,
    as fine-tunes that add tokens without resizing do) made every structured-output request a 500: the grammar's
    bitmask was one token wider than the engine's. Those tokens can never be drawn; the answer is constrained."""
    from ember.engine import demo
    from ember.server.config import ServeConfig
    from tests.server.conftest import served

    model = demo.build(tmp_path / "padded")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<pad>"}))
    with served(ServeConfig(model_dir=model, in_process=True, kv_cache_blocks=64)) as srv:
        assert len(srv.runtime.tokenizer) > srv.runtime.model_info.vocab_size  # the pad token is past the logits
        for stream in (False, True):
            content, _, finish = _chat(srv, {"structured_outputs": {"choice": CHOICES}, **THINK_OFF}, seed=3,
                                       stream=stream)
            assert content in CHOICES and finish == "stop", (stream, content)
