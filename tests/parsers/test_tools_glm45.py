"""GLM-4.5 / 4.6 / 4.7 tool calls (`glm45`): `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>..`
with values typed by the tool's schema. No GLM vocabulary is available: the tests use the real Qwen3 tokenizer with
GLM's added tokens (from its real tokenizer_config.json) as single tokens, plus detection from the real templates and
the chunking properties."""
from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.parsers.initial import InitialState
from ember.parsers.pipeline import ParserSetup, parse_all
from ember.parsers.profiles import detect_profile, get_profile
from ember.parsers.xml_values import typed_json
from tests.conftest import shared_path
from tests.parsers.test_machine_common import fold, machine, run
from tests.parsers.test_machine_properties import (SETTINGS, check_chunking_and_truncation, expected_content, text,
                                                   tokens_of)

TC, ETC, K, EK, V, EV = "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
TAGS = (TC, ETC, K, EK, V, EV, "<think>", "</think>")
IDS = {t: 1000 + i for i, t in enumerate(TAGS)} | {"<|user|>": 1100, "<|observation|>": 1101, "<|endoftext|>": 1102}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"},
    "opts": {"type": "object"}, "when": {"type": ["string", "null"]}}}}}]


def glm_tokenizer():
    """The real Qwen3 vocabulary with GLM-4.5's added tokens (as its tokenizer_config.json lists them) added as
    single special tokens."""
    from tokenizers import AddedToken, Tokenizer

    config = json.loads(shared_path("tokenizers", "glm-4.5", "tokenizer_config.json").read_text())
    tok = Tokenizer.from_str(gzip.decompress(shared_path("tokenizers", "qwen3", "tokenizer.json.gz")
                                             .read_bytes()).decode())
    tok.add_special_tokens([AddedToken(v["content"], special=True, normalized=False)
                            for v in config["added_tokens_decoder"].values()])
    return tok


@pytest.fixture(scope="module")
def tok():
    return glm_tokenizer()


@pytest.fixture(scope="module")
def setup(tok):
    return ParserSetup.from_tokenizer(tok, "glm45")


def ids_of(tok, *parts) -> list[int]:
    return [i for p in parts for i in tok.encode(p, add_special_tokens=False).ids]


def test_every_tag_is_an_added_special_token_of_glm_and_one_token_here(tok, setup):
    listed = {v["content"] for v in json.loads(shared_path("tokenizers", "glm-4.5", "tokenizer_config.json")
                                               .read_text())["added_tokens_decoder"].values()}
    p = get_profile("glm45")
    for name in p.token_id_terminals:
        text_ = p.terminals[name]
        assert text_ in listed, text_
        assert len(tok.encode(text_, add_special_tokens=False).ids) == 1
        assert text_ in setup.delimiter_ids


def test_typed_arguments_content_before_and_two_calls(tok, setup):
    reply = ("I'll check.\n" + TC + "get_weather\n" + K + "city" + EK + "\n" + V + 'Zürich "old" \\ town\n' + EV
             + "\n" + K + "days" + EK + "\n" + V + " 3 " + EV + "\n" + K + "hourly" + EK + V + "true" + EV + "\n"
             + K + "opts" + EK + V + '{"unit": "c", "n": [1, {"a": null}]}' + EV + "\n" + K + "when" + EK + V
             + "null" + EV + "\n" + ETC + "\n" + TC + "get_weather" + K + "extra" + EK + V + "42" + EV + ETC)
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS), ids_of(tok, reply, "<|user|>"))
    assert out.content == "I'll check.\n" and out.malformed == []
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": 'Zürich "old" \\ town', "days": 3, "hourly": True,
                         "opts": {"unit": "c", "n": [1, {"a": None}]}, "when": None}),
        ("get_weather", {"extra": 42})]


def test_string_values_stream_before_their_close_and_a_spelled_close_is_data(tok, setup):
    pipe = setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS, call_id=lambda i: f"call_{i}")
    spelled = ids_of(tok, "a </arg") + ids_of(tok, "_value> b")
    events = []
    for t in ids_of(tok, TC + "get_weather\n" + K + "city" + EK + V) + spelled:
        events += pipe.feed([t]).events
    assert fold(events).calls == [["get_weather", '{"city": "a </arg_value> b', False]]
    events += pipe.feed(ids_of(tok, EV + ETC)).events + pipe.finish("stop")
    assert json.loads(fold(events).calls[0][1]) == {"city": "a </arg_value> b"}


def test_call_without_arguments_and_calls_cut_short(tok, setup):
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS), ids_of(tok, TC + "get_time" + ETC))
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_time", "{}")]
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS),
                    ids_of(tok, TC + "get_weather\n" + K + "city" + EK + V + "Par"), "length")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Par')]
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS), ids_of(tok, "x" + TC + "get_wea"),
                    "length")
    assert out.tool_calls == [] and out.content == "x"  # a call cut before its name is never content


def test_stray_text_between_arguments_is_malformed_and_the_call_survives(tok, setup):
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS),
                    ids_of(tok, TC + "get_weather\n" + K + "city" + EK + " oops " + V + "Rome" + EV + " junk\n" + K
                           + "days" + EK + V + "2" + EV + ETC))
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Rome", "days": 2})]
    assert "".join(e.text for e in out.malformed) == "oops junk"


def test_thinking_then_a_call_and_the_prompt_tail(tok, setup):
    assert setup.initial_state(ids_of(tok, "<|user|>hi<|assistant|><think>")) is InitialState.REASONING
    assert setup.initial_state(ids_of(tok, "<|user|>hi<|assistant|>\n<think></think>")) is InitialState.CONTENT
    assert setup.initial_state(ids_of(tok, "<|user|>hi<|assistant|>")) is InitialState.CONTENT
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS),
                    ids_of(tok, "<think>Weather needs a tool.</think>\n" + TC + "get_weather\n" + K + "days" + EK
                           + V + "1" + EV + ETC, "<|observation|>"))
    assert (out.reasoning, out.content) == ("Weather needs a tool.", "")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"days": 1}')]


def test_without_tools_the_markup_is_content(tok, setup):
    reply = TC + "f\n" + K + "a" + EK + V + "1" + EV + ETC
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT), ids_of(tok, reply))
    assert out.tool_calls == [] and out.content == reply


def test_detected_from_exactly_the_real_glm_templates():
    root = shared_path("templates")
    found = {str(p.relative_to(root)) for p in root.glob("*/*.jinja") if detect_profile(p.read_text()) == "glm45"}
    assert found == {"rtp-llm/glm-4.5.jinja", "llama.cpp/GLM-4.6.jinja", "llama.cpp/GLM-4.7-Flash.jinja"}
    assert detect_profile(None, "glm4_moe") == "glm45"


VALUES = {"city": text(max_size=6), "days": st.integers(-99, 99), "hourly": st.booleans(),
          "opts": st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 3), max_size=2)}


def _glm_value(key, v) -> str:
    if key == "city":
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v) if isinstance(v, dict) else str(v)


def _glm_expected(name, key, v):
    """What a value parses to: stripped; a declared string as it is, other declared types as drawn, an undeclared
    parameter (of an undeclared tool too) as JSON or a Python literal where it reads as one, else a string."""
    if name == "get_weather":
        return v.strip() if key == "city" else v
    return json.loads(typed_json(_glm_value(key, v).strip(), (), untyped=True))


@SETTINGS
@given(st.data(), st.booleans())
def test_chunking_properties(data, by_id):
    draw = data.draw
    ids = IDS if by_id else {}
    free = text(exclude=TAGS if not by_id else ("<think>", "</think>"))
    values = {**VALUES, "city": text(max_size=6, exclude=() if by_id else TAGS)}
    segs, calls, contents = [], [], []
    initial = draw(st.sampled_from(["REASONING", "CONTENT"]))
    reasoning = ""
    if initial == "REASONING":
        reasoning = draw(free)
        segs += [(None, reasoning), (ids.get("</think>"), "</think>")]
    tag = lambda t: (ids.get(t), t)                       # noqa: E731
    for _ in range(draw(st.integers(0, 3))):
        c = draw(free | st.sampled_from(["", "\n"]))
        contents.append(c)
        name = draw(st.sampled_from(["get_weather", "other"]))
        keys = draw(st.lists(st.sampled_from(sorted(VALUES)), unique=True, max_size=3))
        args = {k: draw(values[k]) for k in keys}
        nl = draw(st.sampled_from(["\n", ""]))
        segs += [(None, c), tag(TC), (None, name + nl)]
        for k, v in args.items():
            segs += [tag(K), (None, k), tag(EK), (None, nl), tag(V), (None, _glm_value(k, v)), tag(EV), (None, nl)]
        segs.append(tag(ETC))
        calls.append((name, {k: _glm_expected(name, k, v) for k, v in args.items()}))
    last = draw(free)
    contents.append(last)
    segs.append((None, last))
    toks = tokens_of(draw, [s for s in segs if s[1]])
    events = check_chunking_and_truncation("glm45", ids, initial, toks, TOOLS, exact_bytes=False)
    f = fold(events)
    assert (f.reasoning, f.content, f.malformed) == (reasoning, expected_content(contents, len(calls)), "")
    assert [(nm, json.loads(a), e) for nm, a, e in f.calls] == [(nm, a, True) for nm, a in calls]


def test_machine_level_missing_closer_and_empty_name():
    f = fold(run(machine("glm45", IDS, tools=TOOLS),
                 [(IDS[TC], TC), (None, "get_weather\n"), (IDS[K], K), (None, "days"), (IDS[EK], EK),
                  (IDS[V], V), (None, "4"), (IDS[EV], EV), (IDS[TC], TC), (None, "\n"), (IDS[K], K),
                  (None, "x"), (IDS[EK], EK), (IDS[ETC], ETC)]))
    assert f.calls == [["get_weather", '{"days": 4}', True]]
    assert f.malformed == "\n<arg_key>x</arg_key>"
