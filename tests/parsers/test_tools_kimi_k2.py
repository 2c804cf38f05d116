"""Kimi K2 / K2-Thinking tool calls (`kimi_k2`): `functions.NAME:IDX` heads (the call id), JSON arguments verbatim,
K2-Thinking's `<think>`. No Kimi vocabulary is available: the tests use the real Qwen3 tokenizer with Kimi's markers
added as single special tokens, plus detection from the real templates and the chunking properties."""
from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.parsers.events import ToolCallStart
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import ParserSetup, parse_all
from ember.parsers.profiles import detect_profile, get_profile
from tests.conftest import shared_path
from tests.parsers.test_machine_common import merged
from tests.parsers.test_machine_properties import (NAMES, SETTINGS, check_chunking_and_truncation, check_tool_reply,
                                                   json_values, reply_head, text, tokens_of)

SECTION, CALL, ARG, END, CLOSE = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                                  "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>")
MARKERS = (SECTION, CALL, ARG, END, CLOSE, "<think>", "</think>", "<|im_end|>")
IDS = {t: 2000 + i for i, t in enumerate(MARKERS)}
SPECIALS = MARKERS[:5] + ("<|im_assistant|>", "<|im_user|>", "<|im_middle|>", "<|im_system|>")


def kimi_tokenizer():
    """The real Qwen3 vocabulary (which has `<think>`, `</think>`, `<|im_end|>` as single tokens) with Kimi K2's
    tool-call and role markers added as single special tokens."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(gzip.decompress(shared_path("tokenizers", "qwen3", "tokenizer.json.gz")
                                             .read_bytes()).decode())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


@pytest.fixture(scope="module")
def tok():
    return kimi_tokenizer()


@pytest.fixture(scope="module")
def setup(tok):
    return ParserSetup.from_tokenizer(tok, "kimi_k2")


def ids_of(tok, *parts) -> list[int]:
    return [i for p in parts for i in tok.encode(p, add_special_tokens=False).ids]


def call(name, index, args) -> str:
    return f"{CALL}functions.{name}:{index}{ARG}{json.dumps(args, ensure_ascii=False)}{END}"


def test_every_marker_is_one_token_of_the_test_vocabulary(tok, setup):
    p = get_profile("kimi_k2")
    for name in p.token_id_terminals:
        assert p.terminals[name] in setup.delimiter_ids
        assert len(tok.encode(p.terminals[name], add_special_tokens=False).ids) == 1


ARGS = {"city": "Zürich \"centre\"", "nested": {"a": [1, {"b": None}], "s": "\\n\n"}, "e": "😀"}


def test_calls_keep_kimis_ids_and_arguments_bytes(tok, setup):
    reply = "Checking both. " + SECTION + call("get_weather", 0, ARGS) + call("get_time", 1, {}) + CLOSE
    pipe = setup.pipeline(initial=InitialState.CONTENT, tools=[{}])
    step = pipe.feed(ids_of(tok, reply, "<|im_end|>"))
    events = step.events + pipe.finish("stop")
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(s.id, s.name) for s in starts] == [("functions.get_weather:0", "get_weather"),
                                                ("functions.get_time:1", "get_time")]
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=[{}]), ids_of(tok, reply))
    assert out.content == "Checking both. " and out.malformed == []
    assert [(c.id, c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("functions.get_weather:0", "get_weather", ARGS), ("functions.get_time:1", "get_time", {})]
    assert out.tool_calls[0].arguments == json.dumps(ARGS, ensure_ascii=False)


def test_a_repeated_head_gets_an_id_no_call_of_the_reply_has(tok, setup):
    """Clients match tool results to calls by id: a model repeating `:0` must not give two calls one id."""
    reply = SECTION + call("get_weather", 0, {}) + call("get_weather", 0, {"a": 1}) + call("get_time", 1, {}) \
        + call("get_weather", 1, {}) + CLOSE
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=[{}]), ids_of(tok, reply))
    assert [c.id for c in out.tool_calls] == ["functions.get_weather:0", "functions.get_weather:1",
                                              "functions.get_time:1", "functions.get_weather:2"]
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_weather", "get_time", "get_weather"]
    bare = SECTION + (CALL + "functions.f" + ARG + "{}" + END) * 2 + CLOSE  # a head without its index, twice
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=[{}]), ids_of(tok, bare))
    assert [(c.id, c.name) for c in out.tool_calls] == [("functions.f", "f"), ("functions.f:0", "f")]


def test_a_head_without_the_functions_prefix_names_the_tool_and_gets_our_id(tok, setup):
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=[{}], call_id=lambda i: f"call_{i}"),
                    ids_of(tok, SECTION + CALL + "search" + ARG + '{"q": "x"}' + END + CLOSE))
    assert [(c.id, c.name) for c in out.tool_calls] == [("call_0", "search")]


def test_spelled_markers_inside_arguments_are_data(tok, setup):
    body = '{"q": "a<|tool_call_end|>b"}'
    cut = body.index("_end")
    ids = ids_of(tok, SECTION + CALL + "functions.f:0" + ARG) + ids_of(tok, body[:cut]) + ids_of(tok, body[cut:])
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=[{}]), ids + ids_of(tok, END + CLOSE))
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", body)]


def test_cut_short_and_broken_calls(tok, setup):
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=[{}]),
                    ids_of(tok, SECTION + CALL + "functions.f:0" + ARG + '{"a": "unfinished'), "length")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", '{"a": "unfinished')]
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=[{}]),
                    ids_of(tok, "x" + SECTION + CALL + "functions.get_wea"), "length")
    assert out.tool_calls == [] and out.content == "x"  # a call cut before its name is never content
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=[{}]),
                    ids_of(tok, SECTION + CALL + "functions.bad:0" + ARG + "not json" + END + call("good", 1, {"k": 1})
                           + CLOSE))
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("bad", "{}"), ("good", '{"k": 1}')]
    assert "".join(e.text for e in out.malformed) == "not json"


def test_k2_thinking_reasoning_then_calls(tok, setup):
    prompt = ids_of(tok, "<|im_user|>user<|im_middle|>weather?<|im_end|><|im_assistant|>assistant<|im_middle|>")
    initial = setup.initial_state(prompt)
    assert initial is InitialState.CONTENT
    out = parse_all(setup.pipeline(initial=initial, tools=[{}]),
                    ids_of(tok, "<think>I should call it.</think>" + SECTION + call("w", 0, {"c": 1}) + CLOSE,
                           "<|im_end|>"))
    assert (out.reasoning, out.content) == ("I should call it.", "")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("w", '{"c": 1}')]
    # the section token inside the thought ends it (interleaved thinking)
    out = parse_all(setup.pipeline(initial=InitialState.REASONING, tools=[{}]),
                    ids_of(tok, "hmm" + SECTION + call("w", 0, {}) + CLOSE))
    assert (out.reasoning, [c.name for c in out.tool_calls]) == ("hmm", ["w"])


def test_without_tools_the_markup_is_content(tok, setup):
    reply = "a" + SECTION + call("f", 0, {}) + CLOSE
    assert parse_all(setup.pipeline(initial=InitialState.CONTENT), ids_of(tok, reply)).content == reply


def test_detected_from_exactly_the_real_kimi_templates():
    root = shared_path("templates")
    found = {str(p.relative_to(root)) for p in root.glob("*/*.jinja") if detect_profile(p.read_text()) == "kimi_k2"}
    assert found == {"llama.cpp/Kimi-K2-Instruct.jinja", "llama.cpp/Kimi-K2-Thinking.jinja",
                     "llama.cpp/moonshotai-Kimi-K2.jinja"}
    assert detect_profile(None, "kimi_k2") == "kimi_k2"


@SETTINGS
@given(st.data(), st.booleans())
def test_chunking_properties(data, by_id):
    draw = data.draw
    ids = IDS if by_id else {}
    segs, initial, reasoning, content, n = reply_head(draw, ids.get("</think>"))
    calls = []
    if n:
        segs.append((ids.get(SECTION), SECTION))
    for k in range(n):
        name = draw(NAMES)
        args = draw(st.dictionaries(text(max_size=3), json_values(), max_size=3))
        body = json.dumps(args, ensure_ascii=draw(st.booleans()) or not by_id)
        segs += [(ids.get(CALL), CALL), (None, f"functions.{name}:{k}"), (ids.get(ARG), ARG), (None, body),
                 (ids.get(END), END)]
        calls.append((name, args))
    if n:
        segs.append((ids.get(CLOSE), CLOSE))
    if by_id and draw(st.booleans()):
        segs.append((ids["<|im_end|>"], "<|im_end|>"))
    toks = tokens_of(draw, [s for s in segs if s[1]])
    events = check_chunking_and_truncation("kimi_k2", ids, initial, toks, tools=[{}])
    check_tool_reply(events, toks, reasoning, content, calls)
    assert [e.id for e in merged(events) if isinstance(e, ToolCallStart)] == [f"functions.{nm}:{k}"
                                                                             for k, (nm, _) in enumerate(calls)]
