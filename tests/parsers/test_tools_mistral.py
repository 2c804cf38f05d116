"""Mistral tool calls (`mistral`, vLLM's name too) on a byte-level BPE tokenizer with Mistral's control tokens as single
tokens (Mistral's own vocabulary is not under ../shared/data): the `[TOOL_CALLS] [..]` JSON list with and without ids,
the v11+ `[TOOL_CALLS]NAME[ARGS]{..}` form with `[CALL_ID]`, `[THINK]` reasoning, cut and broken calls, detection from
the real Mistral templates, and the chunking properties."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.parsers.events import ToolCallStart
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import ParserSetup, parse_all
from ember.parsers.profiles import detect_profile, get_profile
from tests.conftest import shared_path
from tests.parsers.family_tokenizers import byte_bpe, ids_of, recorded_replies
from tests.parsers.test_machine_common import fold, machine, raw_text, run
from tests.parsers.test_machine_properties import (NAMES, SETTINGS, check_chunking_and_truncation, json_values, text,
                                                   tokens_of)

SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"]
CALLS, ARGS_, CALL_ID, THINK, UNTHINK, EOS = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]", "</s>"
IDS = {CALLS: 5, ARGS_: 10, CALL_ID: 11, THINK: 12, UNTHINK: 13, EOS: 2}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ARGS = {"city": "Zürich \"centre\"", "opts": {"days": [1, 2], "unit": None, "deep": {"x": "a\\b\n]}"}}, "emoji": "😀"}


@pytest.fixture(scope="module")
def tok():
    return byte_bpe(SPECIALS)


@pytest.fixture(scope="module")
def setup(tok):
    return ParserSetup.from_tokenizer(tok, "mistral")


def parse(tok, setup, *parts, tools=TOOLS, reason="stop", initial=InitialState.CONTENT):
    ids = ids_of(tok, {t: tok.token_to_id(t) for t in SPECIALS}, *parts)
    pipe = setup.pipeline(initial=initial, tools=tools, call_id=lambda i: f"call_{i}")
    return parse_all(pipe, ids, reason)


def calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def test_the_markers_are_single_tokens(tok, setup):
    for t, i in IDS.items():
        assert tok.encode(t, add_special_tokens=False).ids == [i]
        assert setup.delimiter_ids[t] == i


@pytest.mark.parametrize("with_ids", [False, True])
def test_json_list_with_and_without_ids(tok, setup, with_ids):
    items = [{"name": "get_weather", "arguments": ARGS}, {"name": "get_time", "arguments": {}}]
    if with_ids:
        items = [{**it, "id": f"abc12345{k}"} for k, it in enumerate(items)]
    out = parse(tok, setup, "Let me check. ", CALLS, " " + json.dumps(items, ensure_ascii=False), EOS)
    assert out.content == "Let me check. " and out.malformed == []
    assert calls(out) == [("get_weather", ARGS), ("get_time", {})]
    assert out.tool_calls[0].arguments == json.dumps(ARGS, ensure_ascii=False)       # the model's own bytes


def test_v11_calls_with_and_without_call_ids(tok, setup):
    body = json.dumps(ARGS, ensure_ascii=False)
    out = parse(tok, setup, CALLS, "get_weather", ARGS_, body, CALLS, "get_time", CALL_ID, "a1B2c3D4e", ARGS_, "{}",
                EOS)
    assert calls(out) == [("get_weather", ARGS), ("get_time", {})] and out.content == "" and out.malformed == []
    assert [c.id for c in out.tool_calls] == ["0000call0", "a1B2c3D4e"]               # the model's id when written
    assert out.tool_calls[0].arguments == body


def test_ids_the_model_did_not_write_are_nine_alphanumerics_as_mistral_templates_require(tok, setup):
    ids = ids_of(tok, {t: tok.token_to_id(t) for t in SPECIALS}, CALLS, "f", ARGS_, "{}", CALLS,
                 '[{"name": "g", "arguments": {}}]')
    gen = iter(["call_0123456789abcdef01234567", "call_89abcdef0123456789abcdef"])
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS, call_id=lambda i: next(gen)), ids)
    assert [c.id for c in out.tool_calls] == ["f01234567", "789abcdef"]


def test_magistral_thought_then_a_call(tok, setup):
    out = parse(tok, setup, THINK, "Need the weather [ARGS] tool.", UNTHINK, "Checking.", CALLS, "get_weather", ARGS_,
                '{"city": "Paris"}', EOS)
    assert (out.reasoning, out.content) == ("Need the weather [ARGS] tool.", "Checking.")
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    out = parse(tok, setup, THINK, "hmm", CALLS, "f", ARGS_, "{}")          # the call token ends the thought
    assert (out.reasoning, calls(out)) == ("hmm", [("f", {})])


def test_markers_spelled_in_pieces_are_text(tok, setup):
    spelled = tok.encode("[TOOL", add_special_tokens=False).ids + tok.encode("_CALLS]", add_special_tokens=False).ids
    pipe = setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS)
    out = parse_all(pipe, spelled + tok.encode('[{"name": "f", "arguments": {}}]', add_special_tokens=False).ids)
    assert out.content == '[TOOL_CALLS][{"name": "f", "arguments": {}}]' and out.tool_calls == []


def test_without_tools_the_markup_is_content(tok, setup):
    out = parse(tok, setup, "a", CALLS, "f", ARGS_, "{}", tools=None)
    assert out.content == "a[TOOL_CALLS]f[ARGS]{}" and out.tool_calls == []


def test_cut_short_calls_keep_what_streamed_and_a_cut_name_is_dropped(tok, setup):
    out = parse(tok, setup, CALLS, "f", ARGS_, '{"a": [1, 2', reason="length")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", '{"a": [1, 2')]
    out = parse(tok, setup, CALLS, '[{"name": "g", "arguments": {"b": "x', reason="length")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("g", '{"b": "x')]
    out = parse(tok, setup, "x", CALLS, "get_wea", reason="length")
    assert out.tool_calls == [] and out.content == "x"  # a call cut before its name is never content


def test_broken_calls_are_content_and_neighbours_parse():
    m = machine("mistral", IDS, tools=TOOLS)
    f = fold(run(m, [(5, CALLS), (None, "f"), (10, ARGS_), (None, "oops"), (5, CALLS), (None, "g"), (10, ARGS_),
                     (None, '{"b": 2} trailing'), (5, CALLS), (None, " "), (10, ARGS_), (None, "{}"),
                     (5, CALLS), (None, '[{"name": "h", "arguments": {}}, 7]')]))
    assert [(n, a) for n, a, _ in f.calls] == [("f", "{}"), ("g", '{"b": 2}'), ("h", "{}")]
    assert f.malformed == "oops" + "trailing" + "[ARGS]{}" + "7]"


def test_a_single_object_without_its_list_and_a_name_that_is_not_one():
    f = fold(run(machine("mistral", IDS, tools=TOOLS), [(5, CALLS), (None, ' {"name": "f", "arguments": {"a": 1}}'),
                                                        (2, EOS)]))
    assert f.calls == [["f", '{"a": 1}', True]] and f.malformed == ""
    f = fold(run(machine("mistral", IDS, tools=TOOLS), [(5, CALLS), (None, "I will call f"), (10, ARGS_),
                                                        (None, "{}")]))
    assert f.calls == [] and f.malformed == "I will call f[ARGS]{}"


def test_an_overlong_name_is_content():
    f = fold(run(machine("mistral", IDS, tools=TOOLS), [(5, CALLS), (None, "x" * 600), (10, ARGS_), (None, "{}")]))
    assert f.calls == [] and f.malformed.startswith("x" * 600)


def test_the_reply_starts_after_the_last_inst_close(tok, setup):
    p = {t: tok.token_to_id(t) for t in SPECIALS}
    assert setup.initial_state(ids_of(tok, p, "<s>", "[INST]", "hi", "[/INST]")) is InitialState.CONTENT
    assert setup.initial_state(ids_of(tok, p, "<s>", "[INST]", "hi", "[/INST]", THINK)) is InitialState.REASONING


MISTRAL_TEMPLATES = {"llama.cpp/Mistral-Small-3.2-24B-Instruct-2506.jinja",
                     "llama.cpp/mistralai-Ministral-3-14B-Reasoning-2512.jinja",
                     "llama.cpp/mistralai-Mistral-Nemo-Instruct-2407.jinja",
                     "llama.cpp/unsloth-mistral-Devstral-Small-2507.jinja", "vllm/tool_chat_template_mistral.jinja",
                     "vllm/tool_chat_template_mistral3.jinja", "vllm/tool_chat_template_mistral_parallel.jinja"}


def test_detected_from_exactly_the_real_mistral_templates():
    root = shared_path("templates")
    found = {str(p.relative_to(root)) for p in sorted(Path(root).glob("*/*.jinja"))
             if detect_profile(p.read_text()) == "mistral"}
    assert found == MISTRAL_TEMPLATES


def test_recorded_plain_answers_stay_content_with_tools_offered():
    """Real Mixtral 8x22B answers (vLLM streams), fed as streamed, with tools offered: content, byte for byte."""
    for deltas in recorded_replies("mistralai/mixtral-8x22b-instruct-v0.1/chat_completions"):
        f = fold(run(machine("mistral", IDS, tools=TOOLS), deltas))
        assert (f.content, f.calls, f.malformed) == ("".join(deltas), [], "")


def test_vllm_name():
    assert get_profile("mistral").tool_format == "mistral"


@SETTINGS
@given(st.data(), st.booleans())
def test_chunking_properties(data, by_id):
    draw = data.draw
    ids = IDS if by_id else {}
    markers = (CALLS, ARGS_, CALL_ID, THINK, UNTHINK, "[")
    segs, calls_ = [], []
    reasoning = ""
    if draw(st.booleans()):
        reasoning = draw(text(exclude=markers))
        segs += [(ids.get(THINK), THINK), (None, reasoning), (ids.get(UNTHINK), UNTHINK)]
    content = draw(text(exclude=markers))
    segs.append((None, content))
    n = draw(st.integers(0, 3))
    as_list = draw(st.booleans())
    items = []
    for k in range(n):
        name = draw(NAMES)
        args = draw(st.dictionaries(text(max_size=3), json_values(), max_size=3))
        body = json.dumps(args, ensure_ascii=draw(st.booleans()) or not by_id)
        cid = draw(st.none() | st.from_regex(r"[A-Za-z0-9]{9}", fullmatch=True))
        if as_list:
            items.append('{"name": ' + json.dumps(name) + ', "arguments": ' + body
                         + (f', "id": "{cid}"' if cid else "") + "}")
        else:
            segs += [(ids.get(CALLS), CALLS), (None, name)]
            if cid:
                segs += [(ids.get(CALL_ID), CALL_ID), (None, cid)]
            segs += [(ids.get(ARGS_), ARGS_), (None, body)]
        calls_.append((name, args))
    if as_list and n:
        segs += [(ids.get(CALLS), CALLS), (None, draw(st.sampled_from(["", " "])) + "[" + ", ".join(items) + "]")]
    if by_id and draw(st.booleans()):
        segs.append((IDS[EOS], EOS))
    toks = tokens_of(draw, [s for s in segs if s[1]])
    events = check_chunking_and_truncation("mistral", ids, "CONTENT", toks, tools=TOOLS)
    f = fold(events)
    assert (f.reasoning, f.malformed) == (reasoning, "")
    assert f.content == (content if not n or content.strip() else "")
    assert [(nm, json.loads(a), e) for nm, a, e in f.calls] == [(nm, a, True) for nm, a in calls_]
    assert raw_text(events) == "".join(t for _, t in toks)
    assert all(len(e.id) == 9 and e.id.isalnum() for e in events if isinstance(e, ToolCallStart))
