"""The issue's seed cases and the recorded real model streams, at the ParserMachine level."""
from __future__ import annotations

import json

import pytest

from ember.parsers.events import Malformed, ToolCallEnd
from tests.conftest import shared_path
from tests.parsers.test_machine_common import (DEEPSEEK_IDS, HARMONY_IDS, QWEN_IDS, fold, machine, merged, raw_text,
                                               run, split)

THINK, END_THINK, CALL, END_CALL = ((QWEN_IDS[t], t) for t in ("<think>", "</think>", "<tool_call>", "</tool_call>"))


def test_spelled_close_inside_reasoning_stays_reasoning():
    toks = ["Maybe I write <", "/th", "ink> here", "</think>", " and on.", END_THINK, "Answer."]
    f = fold(run(machine("qwen3", QWEN_IDS, "REASONING"), toks))
    assert f.reasoning == "Maybe I write </think> here</think> and on."
    assert f.content == "Answer."


def test_text_matched_close_streamed_five_characters_at_a_time():
    text = "weighing it</think>Answer."
    chunks = [text[i:i + 5] for i in range(0, len(text), 5)]
    events = run(machine("qwen3", {}, "REASONING"), chunks)       # no delimiter resolved to a token: text terminals
    f = fold(events)
    assert (f.reasoning, f.content) == ("weighing it", "Answer.")
    assert raw_text(events) == text


def test_stray_close_after_a_prompt_that_opened_no_thought_is_content_and_so_are_later_tags():
    events = run(machine("qwen3", QWEN_IDS, "CONTENT"), ["Plan.", END_THINK, "Answer.", THINK, "more", END_THINK])
    f = fold(events)
    assert f.content == "Plan.</think>Answer.<think>more</think>" and f.reasoning == ""


def test_duplicate_close_after_a_closed_thought_is_absorbed():
    f = fold(run(machine("qwen3", QWEN_IDS, "REASONING"), ["a", END_THINK, "b", END_THINK, "c"]))
    assert (f.reasoning, f.content) == ("a", "bc")


def test_stream_stopping_on_a_bare_angle_bracket_keeps_it():
    for profile, ids in (("qwen3", {}), ("qwen3_coder", QWEN_IDS), ("deepseek_r1", DEEPSEEK_IDS)):
        f = fold(run(machine(profile, ids, "REASONING"), ["thinking <"]))
        assert f.reasoning == "thinking <", profile
        f = fold(run(machine(profile, ids, "REASONING"), ["a", "</thi"]))
        assert f.reasoning == "a</thi", profile


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "limit": {"type": "integer"},
                                     "days": {"type": "array", "items": {"type": "integer"}}}}}}]


def test_qwen3_coder_out_of_place_parameter_tag_is_malformed_and_the_next_parameter_still_parses():
    body = ("\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter city>\nx\n</parameter>\n"
            "<parameter=limit>\n5\n</parameter>\n</function>\n")
    events = run(machine("qwen3_coder", QWEN_IDS, "CONTENT", WEATHER), [CALL, *split(body, range(0, 200, 3)), END_CALL])
    f = fold(events)
    assert [c[0] for c in f.calls] == ["get_weather"] and f.calls[0][2]
    assert json.loads(f.calls[0][1]) == {"city": "Paris", "limit": 5}
    assert "<parameter city>" in f.malformed and "x" in f.malformed
    malformed = [e for e in merged(events) if isinstance(e, Malformed)]
    assert malformed[0].text == "<parameter city>"


def test_qwen3_coder_values_typed_by_schema_and_strings_streamed_escaped():
    body = ('<function=get_weather>\n<parameter=city>\nSan "Fran"\\cisco\n\n</parameter>\n<parameter=days>\n'
            '[1, 2]\n</parameter>\n<parameter=limit>\nnot a number\n</parameter>\n<parameter=extra>\n7\n'
            '</parameter>\n</function>')
    events = run(machine("qwen3_coder", QWEN_IDS, "CONTENT", WEATHER), [CALL, *split(body, range(0, 300, 2)),
                                                                        END_CALL])
    args = fold(events).calls[0][1]
    assert json.loads(args) == {"city": 'San "Fran"\\cisco\n', "days": [1, 2], "limit": "not a number",
                                "extra": "7"}
    # the string streams piece by piece: its characters arrive before `</parameter>`
    frags = [e.fragment for e in events if hasattr(e, "fragment")]
    city = frags[frags.index('{"city": "') + 1:frags.index('"')]
    assert len(city) > 5 and "".join(city) == 'San \\"Fran\\"\\\\cisco\\n'


def test_qwen3_coder_tag_cutting_a_name_short_and_an_empty_name_are_malformed():
    f = fold(run(machine("qwen3_coder", QWEN_IDS, "CONTENT"), [CALL, "<function=get_wea</function>", END_CALL,
                                                               CALL, "<function=>\n</function>", END_CALL, "ok"]))
    assert f.calls == []
    assert f.malformed.startswith("<function=get_wea</function>") and "<function=>" in f.malformed
    assert f.content == "ok"


def test_tool_call_cut_by_finish_is_closed_with_its_arguments_as_streamed():
    m = machine("qwen3", QWEN_IDS, "CONTENT")
    events = run(m, [CALL, '\n{"name": "f", "arguments": {"a": "x</tool_call>', "y"])
    f = fold(events)
    assert f.calls == [["f", '{"a": "x</tool_call>y', True]]
    assert isinstance(events[-1], ToolCallEnd)


def test_tool_markup_is_content_when_tools_are_off():
    f = fold(run(machine("qwen3", QWEN_IDS, "CONTENT", parse_tools=False),
                 [CALL, '{"name": "f", "arguments": {}}', END_CALL]))
    assert f.calls == [] and f.content == '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


def test_prose_about_tool_calls_inside_reasoning_stays_reasoning_but_the_real_token_ends_it():
    f = fold(run(machine("qwen3", {"</think>": 151668, "<tool_call>": 151657}, "REASONING"),
                 ["I would write <tool_call> here", CALL, '{"name": "f", "arguments": {"q": 1}}', END_CALL]))
    assert f.reasoning == "I would write <tool_call> here"
    assert f.calls == [["f", '{"q": 1}', True]]


def test_whitespace_only_content_next_to_tool_calls_is_dropped_other_content_kept():
    f = fold(run(machine("hermes", QWEN_IDS), ["\n\n", CALL, '{"name":"a","arguments":{}}', END_CALL, "\n",
                                              CALL, '{"name":"b","arguments":{}}', END_CALL, "\n"]))
    assert f.content == "" and [c[0] for c in f.calls] == ["a", "b"]
    f = fold(run(machine("hermes", QWEN_IDS), ["\n\nHello", CALL, '{"name":"a","arguments":{}}', END_CALL]))
    assert f.content == "\n\nHello"
    f = fold(run(machine("qwen3", QWEN_IDS, "REASONING"), ["r", END_THINK, "\n\n"]))
    assert f.content == "\n\n"


def test_harmony_channels_and_a_call_in_one_token_stream():
    toks = ["<|channel|>", "analysis", "<|message|>", "Think <|end|> spelled.", "<|end|>", "<|start|>", "assistant",
            "<|channel|>", "commentary to=functions.get_x ", "<|constrain|>", "json", "<|message|>", '{"a":',
            ' [1]}', "<|call|>"]
    events = run(machine("gpt_oss", HARMONY_IDS), [(HARMONY_IDS[t], t) if t in HARMONY_IDS else t for t in toks])
    f = fold(events)
    assert f.reasoning == "Think <|end|> spelled." and f.content == "" and f.malformed == ""
    assert f.calls == [["get_x", '{"a": [1]}', True]]
    assert raw_text(events) == "".join(toks)


def test_harmony_final_answer_and_commentary_preamble_are_content():
    toks = ["<|channel|>", "commentary", "<|message|>", "Checking. ", "<|end|>", "<|start|>", "assistant",
            "<|channel|>", "final", "<|message|>", "Done.", "<|return|>"]
    f = fold(run(machine("gpt_oss", HARMONY_IDS), [(HARMONY_IDS[t], t) if t in HARMONY_IDS else t for t in toks]))
    assert (f.reasoning, f.content, f.calls) == ("", "Checking. Done.", [])


def test_deepseek_r1_thought_opened_by_the_template_with_text_matched_tags():
    text = "<think>\nHmm, 2+2.\n</think>\n\n4"
    f = fold(run(machine("deepseek_r1", DEEPSEEK_IDS, "REASONING"), split(text, range(0, 40, 3))))
    assert (f.reasoning, f.content) == ("\nHmm, 2+2.\n", "\n\n4")


# ------------------------------------------------------------------------------------------------- recorded streams
def _recorded():
    ids_file = shared_path("outputs", "dynamo", "derived", "stream_token_ids.json")
    return json.loads(ids_file.read_text())


@pytest.mark.parametrize("key", [
    "qwen3-0.6B/chat_completion_stream_2bd5b0c6-1de1-4cfe-9f94-d682c4e44204.json",
    "qwen3-0.6B/chat_completion_stream_5627a4c6-39a4-4d9c-8f6a-0f2d853dc50e.json",
    "gpt-oss-20b/chat_completion_stream_20a82297-43f9-4421-bfe5-adfb9d18b42a.json",
    "gpt-oss-20b/chat_completion_stream_3840a4cc-c0bb-4dde-aa68-dae80f1917c4.json",
])
def test_recorded_real_streams_replay_to_the_expected_split(key):
    _recorded()
    rec = json.loads(shared_path("outputs", "dynamo", "vllm", key).read_text())
    texts = [c["data"]["choices"][0]["delta"].get("content") or "" for c in rec["data"]
             if c["data"].get("choices")]
    profile, ids = ("qwen3", QWEN_IDS) if key.startswith("qwen3") else ("gpt_oss", HARMONY_IDS)
    toks = [(ids[t], t) if t in ids else (None, t) for t in texts]
    expected_calls = [[c["function"]["name"], json.loads(c["function"]["arguments"])] for c in rec["tool_calls"]]
    results = []
    for chunking in ("tokens", "whole-text-runs"):
        if chunking == "whole-text-runs":           # consecutive non-delimiter tokens joined into one feed
            joined: list = []
            for t in toks:
                if t[0] is None and joined and joined[-1][0] is None:
                    joined[-1] = (None, joined[-1][1] + t[1])
                else:
                    joined.append(t)
            toks = joined
        events = run(machine(profile, ids, "CONTENT"), toks)
        f = fold(events)
        assert f.reasoning == rec["reasoning_content"]
        # design A.6: whitespace-only content between the thought and a tool call is Dropped, not content
        expected_content = rec["normal_content"] if not rec["tool_calls"] or rec["normal_content"].strip() else ""
        assert f.content == expected_content
        assert [[n, json.loads(a)] for n, a, ended in f.calls] == expected_calls
        assert all(ended for *_, ended in f.calls) and f.malformed == ""
        assert raw_text(events) == "".join(texts)
        results.append(merged(events))
    assert results[0] == results[1]
