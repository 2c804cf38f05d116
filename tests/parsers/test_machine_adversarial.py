"""ParserMachine on broken, hostile and random input: never raises, never loses a byte, never leaks a tool call."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.parsers.events import Malformed, ToolCallEnd, ToolCallStart
from ember.parsers.profiles import PROFILE_NAMES, get_profile
from tests.parsers.test_machine_common import (HARMONY_IDS, QWEN_IDS, fold, machine, merged, raw_text, run, split)
from tests.parsers.test_machine_properties import PIECES, per_char

CALL, END_CALL = (QWEN_IDS["<tool_call>"], "<tool_call>"), (QWEN_IDS["</tool_call>"], "</tool_call>")


def _ids_for(profile: str) -> dict:
    return HARMONY_IDS if profile == "gpt_oss" else QWEN_IDS


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PROFILE_NAMES), st.booleans(), st.sampled_from(["REASONING", "CONTENT"]), st.data())
def test_random_token_streams_never_raise_and_keep_every_byte(profile, by_id, initial, data):
    ids = _ids_for(profile) if by_id else {}
    p = get_profile(profile)
    specials = [(ids[t], t) for t in p.terminals.values() if t in ids] or [(None, "<tool_call>")]
    toks = data.draw(st.lists(st.one_of(st.sampled_from(PIECES).map(lambda t: (None, t)),
                                        st.sampled_from(specials),
                                        st.sampled_from(['{"name": "f", "arguments": {"a": ', '"x"}}', "\n",
                                                         "<function=f>", "<parameter=a>", "</parameter>",
                                                         "</function>", "commentary to=functions.g ", "analysis",
                                                         "final"]).map(lambda t: (None, t))),
                              max_size=30))
    events = run(machine(profile, ids, initial), toks)
    assert merged(events) == merged(run(machine(profile, ids, initial), per_char(toks)))
    f = fold(events)                                  # indices in order, each call ended once
    assert all(ended for *_, ended in f.calls)
    if p.tool_format not in ("qwen3_coder", "glm45"):  # Qwen3-Coder / GLM arguments are converted, not model bytes
        assert sorted(raw_text(events)) == sorted("".join(t for _, t in toks))


def test_hermes_body_variants():
    m = lambda: machine("hermes", QWEN_IDS)            # noqa: E731
    f = fold(run(m(), [CALL, '{"arguments": {"a": 1}, "name": "f"}', END_CALL]))
    assert f.calls == [["f", '{"a": 1}', True]]
    f = fold(run(m(), [CALL, '{"name": "f"}', END_CALL]))
    assert f.calls == [["f", "{}", True]]
    f = fold(run(m(), [CALL, '{"name": "f", "id": [1, {"x": "}"}], "arguments": {}}', END_CALL]))
    assert f.calls == [["f", "{}", True]] and f.malformed == ""
    f = fold(run(m(), [CALL, '{"name": "f", "arguments": {}, "arguments": {"b": 2}}', END_CALL]))
    assert f.calls == [["f", "{}", True]]
    f = fold(run(m(), [CALL, "oops ", '{"name": "f", "arguments": {}}', " trailing", END_CALL, "after"]))
    assert f.calls == [["f", "{}", True]] and f.malformed == "oops trailing" and f.content == "after"


def test_hermes_broken_json_without_a_name_is_malformed_with_all_its_bytes():
    events = run(machine("hermes", QWEN_IDS), [CALL, "{name: f}", END_CALL, "ok"])
    f = fold(events)
    assert f.calls == [] and f.malformed == "{name: f}" and f.content == "ok"
    f = fold(run(machine("hermes", QWEN_IDS), [CALL, '{"arguments": {"a": 1}}', END_CALL]))
    assert f.calls == [] and f.malformed == '{"arguments": {"a": 1}}'


def test_hermes_broken_json_after_the_name_keeps_the_call_as_streamed():
    f = fold(run(machine("hermes", QWEN_IDS), [CALL, '{"name": "f", "arguments": {"a": 1}; junk', END_CALL]))
    assert f.calls == [["f", '{"a": 1}', True]] and f.malformed == "; junk"


def test_spelled_closer_inside_a_json_string_is_data_even_when_tags_are_text():
    text = ('<tool_call>\n{"name": "w", "arguments": {"s": "a</tool_call><tool_call>b"}}\n</tool_call>'
            '<tool_call>{"name": "v", "arguments": {}}</tool_call>')
    for chunks in ([text], split(text, range(0, len(text), 3)), list(text)):
        f = fold(run(machine("hermes", {}), chunks))
        assert [(n, json.loads(a)) for n, a, _ in f.calls] == [("w", {"s": "a</tool_call><tool_call>b"}),
                                                               ("v", {})]
        assert f.content == "" and f.malformed == ""


def test_two_complete_calls_in_one_feed_are_both_surfaced():
    ids = {"<tool_call>": 151657}                     # closer matched as text, so one feed holds it all
    events = run(machine("qwen3", ids), [CALL, '{"name": "a", "arguments": {}}</tool_call>', CALL,
                                         '{"name": "b", "arguments": {"x": []}}</tool_call>'])
    assert [(e.index, e.name) for e in events if isinstance(e, ToolCallStart)] == [(0, "a"), (1, "b")]
    assert [e.index for e in events if isinstance(e, ToolCallEnd)] == [0, 1]


def test_withheld_prefix_before_a_real_delimiter_token_is_flushed_as_text_first():
    events = run(machine("qwen3", {"<tool_call>": 151657}), ["see <tool", CALL, '{"name": "f", "arguments": {}}'])
    f = fold(events)
    assert f.content == "see <tool" and f.calls == [["f", "{}", True]]
    assert raw_text(events) == 'see <tool<tool_call>{"name": "f", "arguments": {}}'


def test_qwen3_coder_missing_function_closer_and_unknown_tool():
    f = fold(run(machine("qwen3_coder", QWEN_IDS), [CALL, "<function=nope>\n<parameter=n>\n12\n</parameter>\n",
                                                    END_CALL]))
    assert f.calls == [["nope", '{"n": "12"}', True]]
    f = fold(run(machine("qwen3_coder", QWEN_IDS), [CALL, "<function=f>\n</function>\n", END_CALL]))
    assert f.calls == [["f", "{}", True]]


@pytest.mark.parametrize("body,args", [
    ("<function=f>\n<parameter=city>\nParis\n<parameter=n>\n4\n</parameter>\n</function>\n",
     '{"city": "Paris", "n": 4}'),
    ("<function=f>\n<parameter=n>\n4\n</function>\n", '{"n": 4}'),
])
def test_qwen3_coder_a_value_missing_its_close_tag_ends_at_the_next_tag(body, args):
    """A value the model left open ends at the next parameter or function tag (vLLM's reading), which then acts as
    it does between parameters: the tag is not swallowed into the value, and the integer stays an integer."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "n": {"type": "integer"}}}}}]
    for chunks in ([CALL, body, END_CALL], [CALL, *body, END_CALL]):
        f = fold(run(machine("qwen3_coder", QWEN_IDS, tools=tools), chunks))
        assert f.calls == [["f", args, True]], (chunks, f.calls)


def test_qwen3_coder_xml_outside_a_tool_call_is_content():
    text = "Use <function=f> with <parameter=a>1</parameter></function>."
    f = fold(run(machine("qwen3_coder", QWEN_IDS), split(text, range(0, 80, 4))))
    assert f.content == text and f.calls == []


def test_qwen3_coder_parameter_cut_by_finish_keeps_what_streamed():
    """The value's text streamed; the close tag cut short (`</param`) is markup, never part of the value."""
    f = fold(run(machine("qwen3_coder", QWEN_IDS), [CALL, "<function=f>\n<parameter=a>\nhello </param"], cut=True))
    assert f.calls == [["f", '{"a": "hello ', True]]


@pytest.mark.parametrize("profile,body,args", [
    ("qwen3_coder", "<function=f>\n<parameter=city>\nParis\n</parameter>\n", '{"city": "Paris"}'),
    ("qwen3_coder", "<function=f>\n<parameter=city>\nParis\n", '{"city": "Paris"}'),
    ("qwen3_coder", "<function=f>\n", "{}"),
    ("qwen3_coder", "<function=f>\n<parameter=ci", "{}"),
    ("glm45", "f\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n", '{"city": "Paris"}'),
    ("glm45", "f\n<arg_key>city</arg_key>\n<arg_value>Paris", '{"city": "Paris"}'),
])
def test_an_xml_call_the_model_ends_without_its_end_tags_is_closed(profile, body, args):
    """The model ended its turn inside a call (no length limit, no stop string): its arguments are closed as the
    missing end tags would have closed them, valid JSON as vLLM's XML parsers return, in any chunking."""
    for chunks in ([CALL, body], [CALL, *body]):
        f = fold(run(machine(profile, QWEN_IDS), chunks))
        assert [c[:2] for c in f.calls] == [["f", args]], (chunks, f.calls)
        json.loads(f.calls[0][1])


def test_harmony_with_text_matched_specials_and_a_missing_end():
    text = ("<|channel|>analysis<|message|>hmm<|start|>assistant<|channel|>final<|message|>Hi!<|return|>")
    for chunks in ([text], list(text)):
        f = fold(run(machine("gpt_oss", {}), chunks))
        assert (f.reasoning, f.content, f.malformed) == ("hmm", "Hi!", "")


def test_harmony_header_cut_by_finish_is_malformed_not_lost():
    events = run(machine("gpt_oss", HARMONY_IDS), [(HARMONY_IDS["<|channel|>"], "<|channel|>"), "analy"])
    assert [e for e in events if isinstance(e, Malformed)] == [Malformed("<|channel|>analy",
                                                                         "harmony header cut short")]
