"""DeepSeek-V3 / R1-0528 / V3.1 tool calls (`deepseek_v3`, vLLM's `deepseek_v3` and `deepseek_v31`), on the real
DeepSeek-V3 tokenizer where ../shared/data has it: both spellings of a call, markers by token ID only, cut and broken
calls, reasoning, detection from the real templates, and the chunking properties."""
from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.parsers.initial import InitialState
from ember.parsers.machine import ParserMachine
from ember.parsers.pipeline import ParserSetup, parse_all
from ember.parsers.profiles import canonical_name, detect_profile, get_profile
from tests.conftest import shared_path
from tests.parsers.test_machine_common import fold, machine, run
from tests.parsers.test_machine_properties import (NAMES, SETTINGS, check_chunking_and_truncation, check_tool_reply,
                                                   json_values, reply_head, text, tokens_of)

BEGIN, CALL, SEP, END, CLOSE = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
EOS = "<｜end▁of▁sentence｜>"
IDS = {BEGIN: 128806, CALL: 128808, SEP: 128814, END: 128809, CLOSE: 128807, EOS: 1}
MARKERS = tuple(IDS)


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(gzip.decompress(shared_path("tokenizers", "deepseek-v3", "tokenizer.json.gz")
                                              .read_bytes()).decode())


@pytest.fixture(scope="module")
def setup(tok):
    return ParserSetup.from_tokenizer(tok, "deepseek_v3")


def ids_of(tok, *parts) -> list[int]:
    """Markers as their token; other text tokenized (so a marker never appears inside it)."""
    out: list[int] = []
    for p in parts:
        out += [IDS[p]] if p in IDS else tok.encode(p, add_special_tokens=False).ids
    return out


def v3_call(name, args) -> list[str]:
    return [CALL, "function", SEP, f"{name}\n```json\n{json.dumps(args, ensure_ascii=False)}\n```", END]


def v31_call(name, args) -> list[str]:
    return [CALL, name, SEP, json.dumps(args, ensure_ascii=False), END]


def test_markers_are_single_tokens_in_the_real_vocabulary_and_think_is_text(tok, setup):
    for marker, i in IDS.items():
        assert tok.encode(marker, add_special_tokens=False).ids == [i]
    assert {t: setup.delimiter_ids[t] for t in IDS} == IDS
    assert "<think>" not in setup.delimiter_ids and "</think>" not in setup.delimiter_ids


ARGS = {"city": "Zürich \"centre\"", "opts": {"days": [1, 2], "unit": None, "deep": {"x": "a\\b\n"}}, "emoji": "😀"}


@pytest.mark.parametrize("spelling", [v3_call, v31_call])
def test_content_then_several_calls(tok, setup, spelling):
    parts = ["Let me check. ", BEGIN, *spelling("get_weather", ARGS), "\n", *spelling("get_time", {}), CLOSE, EOS]
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=[{}]), ids_of(tok, *parts))
    assert out.content == "Let me check. " and out.malformed == [] and out.reasoning == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", ARGS), ("get_time", {})]
    assert [c.index for c in out.tool_calls] == [0, 1]


def test_v31_arguments_are_the_models_own_bytes_and_stream_before_the_call_ends(tok, setup):
    body = '{"q":"a<｜tool▁call▁end｜>b","n":[1, {"k":"}"}]}'
    pipe = setup.pipeline(initial=InitialState.CONTENT, tools=[{}], call_id=lambda i: f"call_{i}")
    events = []
    cut = body.index("▁call")                         # the closer spelled in two ordinary pieces
    for t in ids_of(tok, BEGIN, CALL, "search", SEP, body[:cut], body[cut:]):
        events += pipe.feed([t]).events
    streamed = fold(events)
    assert streamed.calls == [["search", body, False]]        # the spelled closer inside the string is data
    events += pipe.feed(ids_of(tok, END, CLOSE)).events + pipe.finish("stop")
    assert fold(events).calls == [["search", body, True]]


def test_a_spelled_marker_is_text_and_a_closer_token_inside_a_string_is_structure(tok, setup):
    spelled = tok.encode("<｜tool", add_special_tokens=False).ids + tok.encode("▁calls▁begin｜>",
                                                                             add_special_tokens=False).ids
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=[{}]), ids_of(tok, "say ") + spelled)
    assert out.content == "say <｜tool▁calls▁begin｜>" and out.tool_calls == []


def test_call_cut_short_keeps_what_streamed_and_a_cut_header_is_dropped(tok, setup):
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=[{}]),
                    ids_of(tok, BEGIN, CALL, "function", SEP, 'f\n```json\n{"a": [1, 2'), "length")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", '{"a": [1, 2')]
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=[{}]),
                    ids_of(tok, "x", BEGIN, CALL, "function", SEP, "get_wea"), "length")
    assert out.tool_calls == [] and out.content == "x"  # a call cut before its name is never content


def test_broken_calls_are_content_and_neighbours_parse():
    m = machine("deepseek_v3", IDS)
    toks = [(IDS[BEGIN], BEGIN), (IDS[CALL], CALL), (None, "   "), (IDS[SEP], SEP), (None, "{}"), (IDS[END], END),
            (IDS[CALL], CALL), (None, "ok"), (IDS[SEP], SEP), (None, 'oops {"a": 1}'), (IDS[END], END),
            (IDS[CALL], CALL), (None, "good"), (IDS[SEP], SEP), (None, '{"b": 2} trailing'), (IDS[END], END),
            (IDS[CLOSE], CLOSE)]
    f = fold(run(m, toks))
    assert [(n, a) for n, a, _ in f.calls] == [("ok", "{}"), ("good", '{"b": 2}')]
    assert "<｜tool▁sep｜>{}" in f.malformed and 'oops {"a": 1}' in f.malformed and "trailing" in f.malformed


def test_without_arguments_a_call_gets_an_empty_object_and_a_tool_named_like_the_type_word_parses():
    f = fold(run(machine("deepseek_v3", IDS), [(IDS[BEGIN], BEGIN), (IDS[CALL], CALL), (None, "ping"),
                                               (IDS[SEP], SEP), (IDS[END], END), (IDS[CALL], CALL),
                                               (None, "function"), (IDS[SEP], SEP), (None, ' {"x": 1}'),
                                               (IDS[END], END), (IDS[CLOSE], CLOSE)]))
    assert f.calls == [["ping", "{}", True], ["function", '{"x": 1}', True]] and f.malformed == ""


def test_v31_thinking_mode_reasoning_then_calls(tok, setup):
    prompt = ids_of(tok, "<｜User｜>weather?<｜Assistant｜><think>")
    initial = setup.initial_state(prompt)
    assert initial is InitialState.REASONING
    out = parse_all(setup.pipeline(initial=initial, tools=[{}]),
                    ids_of(tok, "Need the tool.</think>\n\n", BEGIN, *v31_call("w", {"c": 1}), CLOSE, EOS))
    assert (out.reasoning, out.content) == ("Need the tool.", "")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("w", '{"c": 1}')]
    # non-thinking prompt: the answer; V3's prompt (no thought at all): the answer too
    assert setup.initial_state(ids_of(tok, "<｜User｜>hi<｜Assistant｜></think>")) is InitialState.CONTENT
    assert setup.initial_state(ids_of(tok, "<｜User｜>hi<｜Assistant｜>")) is InitialState.CONTENT


def test_the_section_token_inside_a_thought_ends_it():
    f = fold(run(machine("deepseek_v3", IDS, "REASONING", tools=[{}]),
                 [(None, "hmm"), (IDS[BEGIN], BEGIN), (IDS[CALL], CALL), (None, "f"), (IDS[SEP], SEP),
                  (None, "{}"), (IDS[END], END), (IDS[CLOSE], CLOSE)]))
    assert (f.reasoning, f.content, f.calls) == ("hmm", "", [["f", "{}", True]])


def test_without_tools_the_markup_is_content(tok, setup):
    parts = ["a", BEGIN, *v31_call("f", {}), CLOSE]
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT), ids_of(tok, *parts))
    assert out.tool_calls == [] and out.content == "a" + "".join(parts[1:])


TEMPLATES = ["hf/DeepSeek-V3.jinja", "hf/DeepSeek-V3.1.jinja", "llama.cpp/deepseek-ai-DeepSeek-V3.1.jinja",
             "vllm/tool_chat_template_deepseekv3.jinja", "vllm/tool_chat_template_deepseekv31.jinja",
             "rtp-llm/tool_chat_template_deepseekv31.jinja"]


def test_detected_from_exactly_the_real_deepseek_v3_and_v31_templates():
    root = shared_path("templates")
    found = {str(p.relative_to(root)) for p in root.glob("*/*.jinja") if detect_profile(p.read_text()) == "deepseek_v3"}
    assert found == set(TEMPLATES)
    assert detect_profile(None, "deepseek_v3") == "deepseek_v3"


def test_vllm_names_and_r1_templates_keep_their_profile():
    from ember.server.config import parse_profile_name

    for name, ours in (("deepseek_v3", "deepseek_v3"), ("deepseek_v31", "deepseek_v3"), ("glm45", "glm45"),
                       ("kimi_k2", "kimi_k2")):                     # `--tool-parser` / `--reasoning-parser` values
        assert parse_profile_name(name) == ours
    assert get_profile("deepseek_v31") is get_profile("deepseek_v3")
    assert canonical_name("deepseek_v31") == "deepseek_v3"
    for path in ("templates/llama.cpp/llama-cpp-deepseek-r1.jinja", "templates/hf/DeepSeek-R1-Distill-Qwen-14B.jinja"):
        assert detect_profile(shared_path(path).read_text()) == "deepseek_r1"


R1_TEMPLATES = ["llama.cpp/llama-cpp-deepseek-r1.jinja", "vllm/tool_chat_template_deepseekr1.jinja",
                "hf/DeepSeek-R1-Distill-Qwen-14B.jinja", "llama.cpp/deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
                "llama.cpp/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"]


@pytest.mark.parametrize("path", R1_TEMPLATES)
def test_r1_templates_write_deepseek_calls_and_r1_replies_parse_them(tok, path):
    template = shared_path("templates", *path.split("/")).read_text()
    assert BEGIN in template and CALL in template  # the syntax the template teaches for calls
    assert detect_profile(template) == "deepseek_r1"
    r1 = ParserSetup.from_tokenizer(tok, "deepseek_r1")
    assert r1.profile.tool_format == "deepseek_v3"
    prompt = ids_of(tok, "<｜User｜>weather?<｜Assistant｜>")       # R1-0528 writes its own `<think>`
    initial = r1.initial_state(prompt)
    assert initial is InitialState.REASONING
    out = parse_all(r1.pipeline(initial=initial, tools=[{}]),
                    ids_of(tok, "<think>\nNeed the tool.\n</think>\n\n", BEGIN, *v3_call("get_weather", ARGS),
                           CLOSE, EOS))
    assert (out.reasoning.strip(), out.content, out.malformed) == ("Need the tool.", "", [])
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", ARGS)]
    # without tools in the request the markup stays the answer's text, as for V3
    out = parse_all(r1.pipeline(initial=initial), ids_of(tok, "ok</think>", BEGIN, *v3_call("f", {}), CLOSE))
    assert out.tool_calls == [] and out.content.startswith(BEGIN)


def test_r1_0528_command_line_combines_r1_thoughts_with_deepseek_calls():
    from ember.server.generation import choose_profile

    p = choose_profile(None, None, "deepseek_r1", "deepseek_v3")         # --reasoning-parser / --tool-parser
    assert (p.tool_format, p.reasoning.start_mode) == ("deepseek_v3", "always")
    m = ParserMachine(p, IDS, InitialState.REASONING, [{}], call_id=lambda i: f"call_{i}")
    f = fold(run(m, [(None, "think</think>\n\n"), (IDS[BEGIN], BEGIN), (IDS[CALL], CALL), (None, "function"),
                     (IDS[SEP], SEP), (None, 'f\n```json\n{"a": 1}\n```'), (IDS[END], END), (IDS[CLOSE], CLOSE),
                     (IDS[EOS], EOS)]))
    assert (f.reasoning, f.content, f.calls) == ("think", "", [["f", '{"a": 1}', True]])


@SETTINGS
@given(st.data(), st.booleans())
def test_chunking_properties(data, by_id):
    draw = data.draw
    ids = IDS if by_id else {}
    segs, initial, reasoning, content, n = reply_head(draw, None)
    calls = []
    if n:
        segs.append((ids.get(BEGIN), BEGIN))
    for k in range(n):
        name = draw(NAMES)
        args = draw(st.dictionaries(text(max_size=3), json_values(), max_size=3))
        body = json.dumps(args, ensure_ascii=draw(st.booleans()))
        if not by_id:                                   # markers matched as text: keep them out of the JSON
            body = json.dumps(args, ensure_ascii=True)
        if draw(st.booleans()):
            head = [(None, "function"), (ids.get(SEP), SEP), (None, f"{name}\n```json\n{body}\n```")]
        else:
            head = [(None, name), (ids.get(SEP), SEP), (None, body)]
        segs += [(None, "\n" if k else ""), (ids.get(CALL), CALL), *head, (ids.get(END), END)]
        calls.append((name, args))
    if n:
        segs.append((ids.get(CLOSE), CLOSE))
    toks = tokens_of(draw, [s for s in segs if s[1]])
    events = check_chunking_and_truncation("deepseek_v3", ids, initial, toks, tools=[{}])
    check_tool_reply(events, toks, reasoning, content, calls)
