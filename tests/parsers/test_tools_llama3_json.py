"""Llama 3.x JSON tool calls (`llama3_json`, vLLM's name too) on a byte-level BPE tokenizer with Llama 3's special
tokens as single tokens (Llama 3's own vocabulary is not under ../shared/data): bare and `<|python_tag|>` calls,
`; `-separated calls, content replies, cut and broken calls, detection from the real Llama templates, and the chunking
properties."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.parsers.initial import InitialState
from ember.parsers.pipeline import ParserSetup, parse_all
from ember.parsers.profiles import detect_profile, get_profile
from tests.conftest import shared_path
from tests.parsers.family_tokenizers import byte_bpe, ids_of, recorded_replies
from tests.parsers.test_machine_common import fold, machine, raw_text, run
from tests.parsers.test_machine_properties import (NAMES, SETTINGS, check_chunking_and_truncation, json_values, text,
                                                   tokens_of)

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
            "<|eot_id|>", "<|python_tag|>"]
TAG, EOT, EOM = "<|python_tag|>", "<|eot_id|>", "<|eom_id|>"
IDS = {TAG: 6, EOT: 5, EOM: 4, "<|end_of_text|>": 1}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok():
    return byte_bpe(SPECIALS)


@pytest.fixture(scope="module")
def setup(tok):
    return ParserSetup.from_tokenizer(tok, "llama3_json")


def parse(tok, setup, *parts, tools=TOOLS, reason="stop"):
    ids = ids_of(tok, {t: tok.token_to_id(t) for t in SPECIALS}, *parts)
    return parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=tools), ids, reason)


def calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


ARGS = {"city": "Zürich \"centre\"", "opts": {"days": [1, 2], "unit": None, "deep": {"x": "a\\b\n}"}}, "emoji": "😀"}


def test_the_tags_are_single_tokens(tok, setup):
    for t, i in IDS.items():
        assert tok.encode(t, add_special_tokens=False).ids == [i]
        assert setup.delimiter_ids[t] == i


def test_bare_call_at_the_start_with_parameters_or_arguments(tok, setup):
    for key in ("parameters", "arguments"):
        body = json.dumps({"name": "get_weather", key: ARGS}, ensure_ascii=False)
        out = parse(tok, setup, "\n " + body, EOT)
        assert calls(out) == [("get_weather", ARGS)] and out.content == "" and out.malformed == []
        assert out.tool_calls[0].arguments == json.dumps(ARGS, ensure_ascii=False)   # the model's own bytes


def test_python_tag_call_after_content_and_several_calls_separated_by_semicolons(tok, setup):
    one = json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}})
    two = json.dumps({"name": "get_time", "parameters": {}})
    three = json.dumps({"parameters": {"q": [1, {"k": "v"}]}, "name": "search"})
    out = parse(tok, setup, "Let me check. ", TAG, one + "; " + two + ";\n" + three, EOM)
    assert out.content == "Let me check. " and out.malformed == []
    assert calls(out) == [("get_weather", {"city": "Paris"}), ("get_time", {}), ("search", {"q": [1, {"k": "v"}]})]
    assert [c.index for c in out.tool_calls] == [0, 1, 2]
    out = parse(tok, setup, one + "; " + two)
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_time"] and out.content == ""


def test_a_reply_that_starts_with_text_is_content_whole(tok, setup):
    body = 'Use {"name": "get_weather", "parameters": {}} like this.'
    out = parse(tok, setup, body, EOT)
    assert out.content == body and out.tool_calls == []


def test_without_tools_bare_json_and_the_tag_are_content(tok, setup):
    body = '{"name": "get_weather", "parameters": {}}'
    out = parse(tok, setup, body, tools=None)
    assert out.content == body and out.tool_calls == []
    out = parse(tok, setup, "x", TAG, body, tools=None)
    assert out.content == "x" + TAG + body and out.tool_calls == []


def test_a_spelled_python_tag_is_text(tok, setup):
    spelled = tok.encode("<|python", add_special_tokens=False).ids + tok.encode("_tag|>", add_special_tokens=False).ids
    assert len(spelled) > 1
    pipe = setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS)
    out = parse_all(pipe, tok.encode("say ", add_special_tokens=False).ids + spelled
                    + tok.encode('{"name": "f", "parameters": {}}', add_special_tokens=False).ids)
    assert out.content == 'say <|python_tag|>{"name": "f", "parameters": {}}' and out.tool_calls == []


def test_cut_short_call_keeps_what_streamed_and_a_cut_header_is_dropped(tok, setup):
    out = parse(tok, setup, '{"name": "get_weather", "parameters": {"city": "Par', reason="length")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Par')]
    out = parse(tok, setup, TAG, '{"name": "get_wea', reason="length")
    assert out.tool_calls == [] and out.content == ''  # a call cut before its name is never content


def test_malformed_objects_and_trailing_text_are_content():
    f = fold(run(machine("llama3_json", IDS, tools=TOOLS), ['{"answer": 42}']))
    assert f.calls == [] and f.malformed == '{"answer": 42}'
    f = fold(run(machine("llama3_json", IDS, tools=TOOLS), ['{"name": "f", "parameters": {"a": 1}} and more', "!"]))
    assert f.calls == [["f", '{"a": 1}', True]] and f.malformed == "and more!"
    f = fold(run(machine("llama3_json", IDS, tools=TOOLS), ['{"name": 1}; {"name": "g"}']))
    assert f.calls == [["g", "{}", True]] and f.malformed == '{"name": 1}'      # its neighbour still parses
    f = fold(run(machine("llama3_json", IDS, tools=TOOLS), [(6, TAG), (None, 'print("hi")')]))
    assert f.calls == [] and f.malformed == 'print("hi")'


def test_a_call_without_arguments_gets_an_empty_object():
    f = fold(run(machine("llama3_json", IDS, tools=TOOLS), ['{"name": "ping"}']))
    assert f.calls == [["ping", "{}", True]]


def test_streamed_token_by_token_equals_the_fold(tok, setup):
    ids = ids_of(tok, IDS, TAG, json.dumps({"name": "get_weather", "parameters": ARGS}, ensure_ascii=False), EOM)
    pipe = setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS, call_id=lambda i: f"call_{i}")
    events = [e for t in ids for e in pipe.feed([t]).events] + pipe.finish("stop")
    f = fold(events)
    assert f.calls == [["get_weather", json.dumps(ARGS, ensure_ascii=False), True]]


def test_the_reply_starts_after_the_assistant_header(tok, setup):
    prompt = ids_of(tok, {t: tok.token_to_id(t) for t in SPECIALS}, "<|begin_of_text|>", "<|start_header_id|>",
                    "user", "<|end_header_id|>", "\n\nhi", "<|eot_id|>", "<|start_header_id|>", "assistant",
                    "<|end_header_id|>", "\n\n")
    assert setup.initial_state(prompt) is InitialState.CONTENT


@pytest.mark.parametrize("path", ["templates/llama.cpp/meta-llama-Llama-3.1-8B-Instruct.jinja",
                                  "templates/llama.cpp/meta-llama-Llama-3.2-3B-Instruct.jinja",
                                  "templates/llama.cpp/meta-llama-Llama-3.3-70B-Instruct.jinja",
                                  "templates/vllm/tool_chat_template_llama3.1_json.jinja",
                                  "templates/vllm/tool_chat_template_llama3.2_json.jinja",
                                  "templates/vllm/tool_chat_template_llama4_json.jinja"])
def test_detected_from_the_real_llama_templates(path):
    assert detect_profile(shared_path(path).read_text()) == "llama3_json"


@pytest.mark.parametrize("path, expected", [
    ("templates/llama.cpp/NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes"),
    ("templates/llama.cpp/deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "deepseek_r1"),
    ("templates/llama.cpp/fireworks-ai-llama-3-firefunction-v2.jinja", "none"),
    ("templates/vllm/tool_chat_template_xlam_llama.jinja", "none"),
])
def test_other_llama_based_templates_are_not_llama3_json(path, expected):
    assert detect_profile(shared_path(path).read_text()) == expected


def test_recorded_plain_answers_stay_content_with_tools_offered():
    """Real Llama 3.1 8B answers (vLLM streams), fed as streamed, with tools offered: content, byte for byte."""
    for deltas in recorded_replies("meta/llama-3.1-8b-instruct/chat_completions"):
        f = fold(run(machine("llama3_json", IDS, tools=TOOLS), deltas))
        assert (f.content, f.calls, f.malformed) == ("".join(deltas), [], "")


def test_vllm_names():
    assert get_profile("llama3_json").tool_format == "llama3_json"
    assert get_profile("llama4_json") is get_profile("llama3_json")


def _not_json_start(t: str) -> bool:
    return not t.lstrip().startswith("{")


@SETTINGS
@given(st.data(), st.booleans())
def test_chunking_properties(data, by_id):
    draw = data.draw
    ids = IDS if by_id else {}
    mode = draw(st.sampled_from(["bare", "tag", "text"]))
    segs, calls_ = [], []
    content = ""
    if mode == "text":
        content = draw(text(exclude=(TAG,)).filter(lambda t: t.strip() and _not_json_start(t)))
        segs.append((None, content + draw(st.sampled_from(["", ' {"name": "f", "parameters": {}}']))))
        content = segs[-1][1]
    else:
        if mode == "tag":
            content = draw(text(exclude=(TAG, EOT, EOM)).filter(_not_json_start))
            segs += [(None, content), (ids.get(TAG), TAG)]
        else:
            segs.append((None, draw(st.sampled_from(["", " ", "\n"]))))
        for k in range(draw(st.integers(1 if mode == "bare" else 0, 3))):
            name = draw(NAMES)
            args = draw(st.dictionaries(text(max_size=3), json_values(), max_size=3))
            key = draw(st.sampled_from(["parameters", "arguments"]))
            body = json.dumps({"name": name, key: args}, ensure_ascii=draw(st.booleans()) or not by_id)
            segs.append((None, (draw(st.sampled_from(["; ", ";", "\n", " ; "])) if k else "") + body))
            calls_.append((name, args))
    if by_id and draw(st.booleans()):
        segs.append((IDS[EOT], EOT))
    toks = tokens_of(draw, [s for s in segs if s[1]])
    events = check_chunking_and_truncation("llama3_json", ids, "CONTENT", toks, tools=TOOLS)
    f = fold(events)
    want = content if mode == "text" or content.strip() else ""
    assert (f.content, f.malformed) == (want, "")
    assert [(n, json.loads(a), e) for n, a, e in f.calls] == [(n, a, True) for n, a in calls_]
    assert raw_text(events) == "".join(t for _, t in toks)
