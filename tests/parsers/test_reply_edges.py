"""Edges of a reply through the whole pipeline with real tokenizers: whitespace the model writes before its own
`<think>`, non-finite constants in typed XML values, harmony calls with tools off / empty bodies / empty names, and
the bound on Hermes name strings."""
from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given, strategies as st

from ember.parsers.events import Dropped
from ember.parsers.pipeline import ParserSetup, parse_all
from ember.parsers.tools.base import MAX_NAME
from ember.parsers.xml_values import typed_json
from tests.conftest import shared_path
from tests.parsers.test_pipeline import (CODER_TOOLS, HAVE_SHARED, JSON, NAMES, SETTINGS, C, Reply, check_invariants,
                                         check_reply, chatml, encode_text, free_text, pipe, setup, stream)
from tests.parsers.test_tokens import load_tokenizer
from tests.parsers.test_tools_glm45 import glm_tokenizer

needs_shared = pytest.mark.skipif(not HAVE_SHARED, reason="../shared/data is absent")
WS = st.text(alphabet=" \t\n", max_size=4)


def strict_json(s: str):
    """RFC 8259 JSON: NaN / Infinity rejected."""
    def reject(c):
        raise ValueError(c)
    return json.loads(s, parse_constant=reject)


@functools.lru_cache(maxsize=None)
def glm() -> tuple:
    tok = glm_tokenizer()
    return tok, ParserSetup.from_tokenizer(tok, "glm45")


# ------------------------------------------------------------------------------------ whitespace before `<think>`
GLM_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "o": {"type": "object"}, "a": {"type": "array"}}}}}]


@needs_shared
@pytest.mark.parametrize("reply, reason, reasoning, content, calls", [
    ("\n<think>Let me think.</think>\n<tool_call>f\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "</tool_call>", "stop", "Let me think.", "", [("f", {"city": "Paris"})]),
    ("\n<think>Let me think.</think>\nHello!", "stop", "Let me think.", "\nHello!", []),
    ("\n<think>Let me think about", "length", "Let me think about", "", []),
])
def test_glm_whitespace_before_its_own_think_is_not_content(reply, reason, reasoning, content, calls):
    tok, s = glm()
    prompt = tok.encode("[gMASK]<sop><|user|>\nhi<|assistant|>", add_special_tokens=False).ids
    initial = s.initial_state(prompt)
    ids = tok.encode(reply, add_special_tokens=False).ids
    r = parse_all(s.pipeline(prompt, tools=GLM_TOOLS), ids, reason)
    assert (r.reasoning, r.content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == calls
    whole = check_invariants(s, initial, ids, exact_bytes=not calls, tools=GLM_TOOLS)
    assert (whole.reasoning, whole.content) == (reasoning, content)


def recorded_qwen35_replies() -> list[str]:
    root = shared_path("outputs", "rtp-llm-smoke", "qwen35")
    out = set()
    for f in sorted(root.glob("q_r_35b_nvfp4_py_*_arm.json")):
        for q in json.loads(f.read_text())["query_result"]:
            r = q["result"]
            out |= {x["response"] for x in r.get("response_batch", [r])}
    assert out
    return sorted(out)


@needs_shared
def test_recorded_qwen35_replies_starting_with_whitespace_then_think():
    tok = load_tokenizer("qwen3")
    s = setup("qwen3_coder")
    prompt = tok.encode("<|im_start|>user\nPlease introduce yourself.<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False).ids
    for reply in recorded_qwen35_replies():
        assert reply.startswith("\n\n<think>")
        thought, closed, answer = reply.removeprefix("\n\n<think>").partition("</think>")
        ids = tok.encode(reply, add_special_tokens=False).ids
        r = parse_all(s.pipeline(prompt), ids, "length")
        assert (r.reasoning, r.content) == (thought, answer if closed else "")
        events = stream(pipe(s, s.initial_state(prompt)), [[t] for t in ids], "length")
        assert events[0] == Dropped("\n\n", "whitespace before reasoning open")


@SETTINGS
@given(st.data())
def test_whitespace_held_at_a_boundary_then_a_thought_is_dropped(data):
    """Reply start (or after a call): whitespace then `<think>` is structure, in every chunking and truncation."""
    draw = data.draw
    s = setup("qwen3_coder")
    r = Reply(chatml()[0])
    if draw(st.booleans()):
        r.text(draw, draw(WS))
        r.delim(s, "<think>")
        r.reasoning = draw(free_text())
        r.text(draw, r.reasoning)
        r.delim(s, "</think>")
    r.content = draw(free_text(exclude=("<tool_call>", "<function=")))
    r.text(draw, r.content)
    if draw(st.booleans()):
        r.delim(s, "<tool_call>")
        r.text(draw, "\n<function=f>\n</function>\n")
        r.delim(s, "</tool_call>")
        r.calls.append(("f", {}))
        r.text(draw, draw(WS))
        r.delim(s, "<think>")
        more = draw(free_text())
        r.text(draw, more)
        r.reasoning += more
    check_reply(s, C, r, exact_bytes=not r.calls, tools=CODER_TOOLS)


# ------------------------------------------------------------------------------------ strict JSON arguments
@pytest.mark.parametrize("raw, types", [('{"x": NaN}', ("object",)), ("[1, -Infinity]", ("array",)),
                                        ('{"x": [Infinity]}', ("object", "array")), ("NaN", ("number",))])
def test_non_finite_constants_fall_back_to_a_json_string(raw, types):
    assert typed_json(raw, types) == json.dumps(raw)


@needs_shared
def test_qwen3_coder_and_glm_object_values_with_nan_are_strict_json_strings():
    tools = GLM_TOOLS
    tok, tb = chatml()
    s = setup("qwen3_coder")
    body = ('\n<function=f>\n<parameter=o>\n{"x": NaN}\n</parameter>\n<parameter=a>\n[1, -Infinity]\n</parameter>\n'
            '<parameter=city>\nNaN\n</parameter>\n</function>\n')
    ids = [s.delimiter_ids["<tool_call>"], *encode_text(tok, body), s.delimiter_ids["</tool_call>"]]
    want = {"o": '{"x": NaN}', "a": "[1, -Infinity]", "city": "NaN"}
    whole = check_invariants(s, C, ids, exact_bytes=False, tools=tools)
    assert strict_json(whole.tool_calls[0].arguments) == want
    gtok, g = glm()
    reply = '<tool_call>f\n<arg_key>o</arg_key>\n<arg_value>{"x": Infinity, "y": [1]}</arg_value>\n</tool_call>'
    ids = gtok.encode(reply, add_special_tokens=False).ids
    whole = check_invariants(g, C, ids, exact_bytes=False, tools=tools)
    assert strict_json(whole.tool_calls[0].arguments) == {"o": '{"x": Infinity, "y": [1]}'}
    ids = gtok.encode(reply.replace("Infinity", "1.5e3"), add_special_tokens=False).ids
    assert strict_json(parse_all(g.pipeline(initial=C, tools=tools), ids).tool_calls[0].arguments) == {
        "o": {"x": 1500.0, "y": [1]}}


# ------------------------------------------------------------------------------------ harmony
HARMONY_TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


def harmony_ids(*parts: str) -> list[int]:
    s = setup("gpt_oss", "gpt-oss")
    tok = load_tokenizer("gpt-oss")
    return [i for p in parts for i in ([s.delimiter_ids[p]] if p in s.delimiter_ids else encode_text(tok, p))]


def harmony_call(body: str, recipient: str = "functions.get_weather") -> list[str]:
    """An analysis message, then a commentary message to ``recipient`` with ``body``."""
    return ["<|channel|>", "analysis", "<|message|>", "need tool", "<|end|>", "<|start|>", "assistant",
            "<|channel|>", f"commentary to={recipient} ", "<|constrain|>", "json", "<|message|>",
            *([body] if body else []), "<|call|>"]


@needs_shared
@pytest.mark.parametrize("kw", [{}, {"tools": None}, {"tools": HARMONY_TOOLS, "parse_tools": False}])
def test_harmony_without_tool_parsing_a_call_is_content(kw):
    s = setup("gpt_oss", "gpt-oss")
    ids = harmony_ids(*harmony_call('{"city": "Paris"}'))
    whole = check_invariants(s, C, ids, **kw)
    assert (whole.reasoning, whole.content, whole.tool_calls, whole.malformed) == ("need tool", '{"city": "Paris"}',
                                                                                  [], [])
    with_tools = parse_all(pipe(s, C, tools=HARMONY_TOOLS), ids)
    assert [(c.name, c.arguments) for c in with_tools.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert with_tools.content == ""


@needs_shared
@pytest.mark.parametrize("body, arguments", [("", "{}"), ("\n", "{}"), (" \n\t", "{}"),
                                             (' {"a": 1}', ' {"a": 1}'), ("\n{}\n", "\n{}\n")])
def test_harmony_call_with_an_empty_body_has_empty_object_arguments(body, arguments):
    s = setup("gpt_oss", "gpt-oss")
    whole = check_invariants(s, C, harmony_ids(*harmony_call(body)), exact_bytes=body == arguments,
                             tools=HARMONY_TOOLS)
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("get_weather", arguments)]
    assert whole.content == "" and not whole.malformed


@needs_shared
def test_harmony_empty_tool_name_is_malformed_and_the_next_message_parses():
    s = setup("gpt_oss", "gpt-oss")
    parts = [*harmony_call('{"x": 1}', "functions."), "<|start|>", "assistant", "<|channel|>", "final",
             "<|message|>", "Done.", "<|return|>"]
    whole = check_invariants(s, C, harmony_ids(*parts), tools=HARMONY_TOOLS)
    assert whole.tool_calls == []
    assert list(dict.fromkeys(m.reason for m in whole.malformed)) == ["empty tool name", "malformed tool call"]
    assert whole.content.endswith('<|message|>{"x": 1}Done.') and whole.reasoning == "need tool"


@needs_shared
@SETTINGS
@given(st.data())
def test_harmony_tool_messages_with_tools_on_and_off(data):
    draw = data.draw
    s = setup("gpt_oss", "gpt-oss")
    r = Reply(load_tokenizer("gpt-oss"))
    parse = draw(st.booleans())
    for i in range(draw(st.integers(1, 2))):
        if i:
            r.delim(s, "<|start|>")
            r.text(draw, "assistant")
        name = draw(NAMES)
        args = draw(st.one_of(st.none(), st.dictionaries(free_text(max_size=3), JSON, max_size=2)))
        body = draw(WS) if args is None else draw(WS) + json.dumps(args)
        r.delim(s, "<|channel|>")
        r.text(draw, f"commentary to=functions.{name} ")
        r.delim(s, "<|message|>")
        r.text(draw, body)
        r.delim(s, "<|call|>")
        if parse:
            r.calls.append((name, args or {}))
        else:
            r.content += body
    tools = [{"type": "function", "function": {"name": "f"}}] if parse else None
    check_reply(s, C, r, exact_bytes=not parse, tools=tools)


# ------------------------------------------------------------------------------------ Hermes name bound
@pytest.mark.parametrize("where", ["name", "key"])
def test_hermes_name_or_key_longer_than_max_name_is_malformed_and_the_next_call_parses(where):
    tok, tb = chatml()
    s = setup("qwen3")
    long = "ab" * MAX_NAME
    body = '{"name": "' + long + '", "arguments": {}}' if where == "name" else \
        '{"name": "f", "' + long + '": 1, "arguments": {}}'
    ok = '\n{"name": "g", "arguments": {"x": 1}}\n'
    ids = [s.delimiter_ids["<tool_call>"], *encode_text(tok, "\n" + body + "\n"), s.delimiter_ids["</tool_call>"],
           *encode_text(tok, "\n"), s.delimiter_ids["<tool_call>"], *encode_text(tok, ok),
           s.delimiter_ids["</tool_call>"]]
    whole = check_invariants(s, C, ids, tools=CODER_TOOLS)
    assert "tool call name or key too long" in {m.reason for m in whole.malformed}
    calls = [(c.name, c.arguments) for c in whole.tool_calls]
    assert calls[-1] == ("g", '{"x": 1}') and len(calls) == (1 if where == "name" else 2)
    assert max(len(m.text) for m in whole.malformed) < len(long)


@pytest.mark.parametrize("body", ['{"name": "f"; "arguments": {"a": 1}}', '{"name": "f", "arguments": }',
                                  '{"name": "f"}'])
def test_hermes_call_whose_arguments_never_streamed_has_empty_object_arguments(body):
    """A named call whose wrapper breaks, or closes, before any arguments streamed has "{}" (clients json.loads it);
    the text after the break is malformed, never arguments."""
    tok, _ = chatml()
    s = setup("qwen3")
    ids = [s.delimiter_ids["<tool_call>"], *encode_text(tok, "\n" + body + "\n"), s.delimiter_ids["</tool_call>"]]
    whole = check_invariants(s, C, ids, exact_bytes=False, tools=CODER_TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("f", {})], whole.tool_calls
