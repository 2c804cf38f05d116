"""Pythonic tool calls (`pythonic`, vLLM's name too) on a byte-level BPE tokenizer with Llama 3's and Llama 4's special
tokens as single tokens: literal keyword arguments converted to JSON as they stream (strings with escapes, numbers,
True/False/None, lists, tuples, dicts), bare lists and `<|python_start|>` ones, content replies, cut and broken calls,
detection from the real templates, and the chunking properties (arguments compared as JSON values)."""
from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.parsers.events import Dropped
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import ParserSetup, parse_all
from ember.parsers.profiles import detect_profile, get_profile
from ember.parsers.python_literals import PythonArgs
from tests.conftest import shared_path
from tests.parsers.family_tokenizers import byte_bpe, ids_of, recorded_replies
from tests.parsers.test_machine_common import fold, machine, run
from tests.parsers.test_machine_properties import NAMES, SETTINGS, check_chunking_and_truncation, tokens_of

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
            "<|eot_id|>", "<|python_start|>", "<|python_end|>", "<|eot|>", "<|python_tag|>"]
START, END, EOT = "<|python_start|>", "<|python_end|>", "<|eot_id|>"
IDS = {START: 6, END: 7, EOT: 5, "<|eot|>": 8, "<|python_tag|>": 9}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok():
    return byte_bpe(SPECIALS)


@pytest.fixture(scope="module")
def setup(tok):
    return ParserSetup.from_tokenizer(tok, "pythonic")


def parse(tok, setup, *parts, tools=TOOLS, reason="stop"):
    ids = ids_of(tok, {t: tok.token_to_id(t) for t in SPECIALS}, *parts)
    return parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=tools), ids, reason)


def calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def test_the_tags_are_single_tokens(tok, setup):
    for t, i in IDS.items():
        assert tok.encode(t, add_special_tokens=False).ids == [i]
        assert setup.delimiter_ids[t] == i


def test_literals_become_json():
    src = ("s='it\\'s \"q\" \\n\\t\\\\ \\x41\\u00e9\\U0001F600 \\d \\0', d=\"Zürich 😀\", i=-12, h=0x1f, big=1_000, "
           "f=2.5e-3, t=True, n=None, no=False, l=[1, [], (2, 3)], e=(), m={'k': {\"x\": [None]}, 1: 2}, )")
    conv = PythonArgs()
    n, text = conv.feed(src)
    assert conv.done and conv.error is None and n == len(src)
    assert json.loads("{" + text) == {
        "s": "it's \"q\" \n\t\\ Aé😀 \\d \x00", "d": "Zürich 😀", "i": -12, "h": 31, "big": 1000, "f": 0.0025,
        "t": True, "n": None, "no": False, "l": [1, [], [2, 3]], "e": [], "m": {"k": {"x": [None]}, "1": 2}}


@pytest.mark.parametrize("src, error", [("a=foo)", "not a literal"), ("1, 2)", "positional"),
                                        ("a=1 b=2)", "unexpected"), ("a=[1, 2)", "unexpected"),
                                        ("a=float('nan'))", "not a literal"), ("a='\\xZZ')", "bad escape"),
                                        ("a={[1]: 2})", "unexpected"), ("a=" + "9" * 600 + ")", "too long"),
                                        ("a=02134)", "not a literal"), ("a=[1, 007])", "not a literal"),
                                        ("a='x' b'y')", "unexpected"), ("a='x' 1)", "unexpected")])
def test_what_is_not_a_literal_is_an_error_and_the_json_sent_can_be_closed(src, error):
    conv = PythonArgs()
    n, text = conv.feed(src)
    assert conv.error is not None and error in conv.error and not conv.done
    json.loads("{" + text + conv.closers())


QUOTINGS = ['"""print(1)\nprint("hi")\n"""', "'''it's'''", "'a' 'b'", '"a"\n  "b" \'c\'', r'r"C:\new\table"',
            r"r'a\'b'", "u'x'", r"R'\d' U'\n'", '""""""', "''", '"" "x"', '"""a""b"""', "0_1.5", "00", "1e3", "-0x1F",
            r"{'k' 'j': [r'\\']}", "1e400", "-32.5E4244"]  # past a double's range: the JSON number as written


@pytest.mark.parametrize("value", QUOTINGS)
def test_every_quoting_and_number_python_reads_is_its_value(value):
    """Triple quotes, raw and u prefixes, adjacent literals joined: the value Python's own parser reads."""
    src = f"a={value}, b=1)"
    conv = PythonArgs()
    n, text = conv.feed(src)
    assert conv.done and conv.error is None and n == len(src)
    assert json.loads("{" + text) == {"a": as_json(ast.literal_eval(f"({value})")), "b": 1}


def test_arguments_left_open_at_the_end_of_the_turn_are_closed_and_a_cut_keeps_its_prefix():
    tools = [{"type": "function", "function": {"name": "f"}}]
    for body, want in [("[f(zip=1", {"zip": 1}), ("[f(i=[1, 2", {"i": [1, 2]}), ("[f(s='''a''", {"s": "a''"}),
                       ("[f(s='a' ", {"s": "a"})]:
        f = fold(run(machine("pythonic", IDS, tools=tools), [(6, START), (None, body), (8, "<|eot|>")]))
        assert [(n, json.loads(a), ended) for n, a, ended in f.calls] == [("f", want, True)] and f.malformed == ""
    f = fold(run(machine("pythonic", IDS, tools=tools), [(6, START), (None, "[f(i=[1, foo"), (8, "<|eot|>")]))
    assert f.calls == [["f", '{"i": [1]}', True]] and f.malformed == "foo"
    events = run(machine("pythonic", IDS, tools=tools), [(6, START), (None, "[f(i=[1, 23")], cut=True)
    assert fold(events).calls == [["f", '{"i": [1', True]]
    assert [e.text for e in events if isinstance(e, Dropped) and "cut short" in e.reason] == ["23"]


def test_bare_list_of_calls_at_the_start(tok, setup):
    out = parse(tok, setup, '\n[get_weather(city="San Francisco, CA", days=[1, 2]), get_time(), '
                            "search(q='a(b)[c]', opts={'deep': (True, None)})]", EOT)
    assert out.content == "" and out.malformed == []
    assert calls(out) == [("get_weather", {"city": "San Francisco, CA", "days": [1, 2]}), ("get_time", {}),
                          ("search", {"q": "a(b)[c]", "opts": {"deep": [True, None]}})]
    assert [c.index for c in out.tool_calls] == [0, 1, 2]


def test_python_start_wrapper(tok, setup):
    out = parse(tok, setup, "Let me look. ", START, "[get_weather(city='Paris')]", END, " Done.")
    assert calls(out) == [("get_weather", {"city": "Paris"})] and out.content == "Let me look.  Done."
    out = parse(tok, setup, "<|python_tag|>", "[get_weather(city='Oslo')]", "<|eom_id|>")     # Llama 3's opener
    assert calls(out) == [("get_weather", {"city": "Oslo"})] and out.content == "" and out.malformed == []


@pytest.mark.parametrize("text", ["[1] See the notes.", "[link](http://x.y)", "[a b(c)]", "Sure: [f(a=1)]",
                                  "[]", "[f", "  [f x"])
def test_replies_that_are_not_a_call_list_are_content_whole(tok, setup, text):
    out = parse(tok, setup, text)
    assert out.content == text and out.tool_calls == []


def test_without_tools_the_list_is_content(tok, setup):
    out = parse(tok, setup, "[f(a=1)]", tools=None)
    assert out.content == "[f(a=1)]" and out.tool_calls == []


def test_a_call_cut_short_keeps_its_json_prefix(tok, setup):
    out = parse(tok, setup, "[get_weather(city='Par", reason="length")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Par')]


def test_broken_arguments_close_the_json_and_the_rest_is_content():
    f = fold(run(machine("pythonic", IDS, tools=TOOLS), ["[f(a=[1, {'k': 2", "}, x]), g(b=1)]"]))
    assert f.calls == [["f", '{"a": [1, {"k": 2}]}', True]]
    assert f.malformed == "x]), g(b=1)]"
    f = fold(run(machine("pythonic", IDS, tools=TOOLS), ["[f(a=1)] trailing"]))
    assert f.calls == [["f", '{"a": 1}', True]] and f.malformed == "trailing"
    f = fold(run(machine("pythonic", IDS, tools=TOOLS), [(6, START), (None, "print('hi')"), (7, END)]))
    assert f.calls == [] and f.malformed == "print('hi')"


def test_the_close_token_inside_arguments_closes_the_call():
    f = fold(run(machine("pythonic", IDS, tools=TOOLS), [(6, START), (None, "[f(a='x"), (7, END), (None, "ok")]))
    assert f.calls == [["f", '{"a": "x"}', True]] and f.content == "ok"


@pytest.mark.parametrize("path", ["templates/vllm/tool_chat_template_llama3.2_pythonic.jinja",
                                  "templates/vllm/tool_chat_template_llama4_pythonic.jinja",
                                  "templates/vllm/tool_chat_template_gemma3_pythonic.jinja",
                                  "templates/vllm/tool_chat_template_toolace.jinja"])
def test_detected_from_the_real_pythonic_templates(path):
    assert detect_profile(shared_path(path).read_text()) == "pythonic"


def test_no_other_template_is_detected_as_pythonic():
    root = shared_path("templates")
    found = {p.name for p in sorted(Path(root).glob("*/*.jinja")) if detect_profile(p.read_text()) == "pythonic"}
    assert found == {"tool_chat_template_llama3.2_pythonic.jinja", "tool_chat_template_llama4_pythonic.jinja",
                     "tool_chat_template_gemma3_pythonic.jinja", "tool_chat_template_toolace.jinja"}


def test_recorded_plain_answers_stay_content_with_tools_offered():
    """Real Llama 3.1 8B answers (vLLM streams), fed as streamed, with tools offered: content, byte for byte."""
    for deltas in recorded_replies("meta/llama-3.1-8b-instruct/chat_completions"):
        f = fold(run(machine("pythonic", IDS, tools=TOOLS), deltas))
        assert (f.content, f.calls, f.malformed) == ("".join(deltas), [], "")


def test_vllm_names():
    assert get_profile("pythonic").tool_format == "pythonic"
    assert get_profile("llama4_pythonic") is get_profile("pythonic")


STRS = st.text(st.sampled_from(list("ab Z\n\t'\"\\é中😀()[]{},=") + ["\x00", "\x7f"]), max_size=6)


def py_values():
    scalars = (st.none() | st.booleans() | st.integers(-10**20, 10**20)
               | st.floats(allow_nan=False, allow_infinity=False) | STRS)
    return st.recursive(scalars, lambda ch: st.lists(ch, max_size=3) | st.tuples(ch, ch)
                        | st.dictionaries(STRS, ch, max_size=3), max_leaves=6)


def py_source(draw, v) -> str:
    """Python source for ``v``, each string in a quoting drawn from those Python reads."""
    if isinstance(v, str):
        plain = repr(v)
        form = draw(st.sampled_from(["repr", "triple", "joined", "raw", "u"]))
        if form == "triple":
            return plain[0] * 3 + plain[1:-1] + plain[0] * 3
        if form == "joined":
            cut = draw(st.integers(0, len(v)))
            return repr(v[:cut]) + draw(st.sampled_from([" ", "\n "])) + repr(v[cut:])
        if form == "raw" and plain[1:-1] == v:
            return "r" + plain
        return ("u" if form == "u" else "") + plain
    if isinstance(v, list):
        return "[" + ", ".join(py_source(draw, x) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + ", ".join(py_source(draw, x) for x in v) + ("," if len(v) == 1 else "") + ")"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{py_source(draw, k)}: {py_source(draw, x)}" for k, x in v.items()) + "}"
    return repr(v)


def as_json(v):
    if isinstance(v, (list, tuple)):
        return [as_json(x) for x in v]
    if isinstance(v, dict):
        return {k: as_json(x) for k, x in v.items()}
    return v


def same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0) or a == b
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


@SETTINGS
@given(st.data(), st.booleans())
def test_chunking_properties(data, by_id):
    draw = data.draw
    ids = IDS if by_id else {}
    wrapped = by_id and draw(st.booleans())
    content = draw(st.sampled_from(["", "Sure. "])) if wrapped else ""
    items, calls_ = [], []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(NAMES)
        kwargs = draw(st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True), py_values(),
                                      max_size=3))
        items.append(f"{name}(" + ", ".join(f"{k}={py_source(draw, v)}" for k, v in kwargs.items()) + ")")
        calls_.append((name, as_json(kwargs)))
    body = draw(st.sampled_from(["", "\n"])) + "[" + draw(st.sampled_from([", ", ","])).join(items) + "]"
    segs = [(None, content), (IDS[START], START), (None, body), (IDS[END], END)] if wrapped else [(None, body)]
    if by_id and draw(st.booleans()):
        segs.append((IDS[EOT], EOT))
    toks = tokens_of(draw, [s for s in segs if s[1]])
    events = check_chunking_and_truncation("pythonic", ids, "CONTENT", toks, tools=TOOLS, exact_bytes=False)
    f = fold(events)
    assert (f.content, f.malformed) == (content, "")
    assert len(f.calls) == len(calls_)
    for (name, args, ended), (want_name, want) in zip(f.calls, calls_):
        assert name == want_name and ended and same(json.loads(args), want)
