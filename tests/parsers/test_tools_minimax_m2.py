"""MiniMax-M2 tool calls (`minimax_m2`, vLLM's name too): the reply starts in the thought, then
`<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="K">V</parameter>\\n</invoke>\\n</minimax:tool_call>`
with several invokes per block and values typed by the tool's schema, read by Qwen3-Coder's syntax. No MiniMax
vocabulary is under ../shared/data: the tests use a byte-level BPE tokenizer with MiniMax's special tokens as single
tokens, plus detection from the real template and the chunking properties."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.parsers.events import Dropped
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import ParserSetup, parse_all
from ember.parsers.profiles import detect_profile, get_profile
from ember.parsers.result import fold as fold_output
from tests.conftest import shared_path
from tests.parsers.family_tokenizers import byte_bpe
from tests.parsers.test_machine_common import fold, machine, merged, run
from tests.parsers.test_machine_properties import (PIECES, SETTINGS, check_chunking_and_truncation, expected_content,
                                                   per_char, text, tokens_of)

THINK, END_THINK, TC, ETC, EOT = "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>", "[e~["
SPECIALS = [THINK, END_THINK, TC, ETC, EOT, "]~b]", "]~!b["]
IDS = {t: i for i, t in enumerate(SPECIALS[:5])}      # byte_bpe adds the specials first, in order
TAGS = (THINK, END_THINK, TC, ETC)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"},
    "opts": {"type": "object"}, "hours": {"type": "array", "items": {"type": "integer"}}}}}}]


@pytest.fixture(scope="module")
def tok():
    return byte_bpe(SPECIALS)


@pytest.fixture(scope="module")
def setup(tok):
    return ParserSetup.from_tokenizer(tok, "minimax_m2")


def ids_of(tok, *parts: str) -> list[int]:
    return [i for p in parts for i in tok.encode(p, add_special_tokens=False).ids]


def parse(tok, setup, *parts: str, reason: str = "stop", initial=InitialState.REASONING, tools=TOOLS):
    return parse_all(setup.pipeline(initial=initial, tools=tools), ids_of(tok, *parts), reason)


def invoke(name: str, **params: str) -> str:
    return (f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items())
            + "</invoke>\n")


def calls(out) -> list:
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def test_the_delimiters_are_single_tokens(tok, setup):
    p = get_profile("minimax_m2")
    for name in p.token_id_terminals:
        t = p.terminals[name]
        assert tok.encode(t, add_special_tokens=False).ids == [IDS[t]]
        assert setup.delimiter_ids[t] == IDS[t]
    assert (p.tool_format, p.strip_value_newlines, p.calls_share_block) == ("qwen3_coder", False, True)


def test_detected_from_exactly_the_real_minimax_template():
    root = shared_path("templates")
    found = {str(p.relative_to(root)) for p in root.glob("*/*.jinja") if detect_profile(p.read_text()) == "minimax_m2"}
    assert found == {"llama.cpp/MiniMax-M2.jinja"}
    assert detect_profile(None, "minimax_m2") == "minimax_m2"


def test_the_generation_prompt_opens_the_thought(tok, setup):
    history = "]~!b[]~b]system\nYou are a helpful assistant.[e~[\n]~b]user\nhi[e~[\n"
    prompt = ids_of(tok, history + "]~b]ai\n<think>\nold</think>\n\nHello[e~[\n]~b]user\nmore[e~[\n]~b]ai\n<think>\n")
    assert setup.initial_state(prompt) is InitialState.REASONING
    assert setup.initial_state(ids_of(tok, history + "]~b]ai\n<think>\n\n</think>\n\n")) is InitialState.CONTENT


def test_reasoning_then_content_and_the_end_of_turn_is_dropped(tok, setup):
    pipe = setup.pipeline(initial=InitialState.REASONING, tools=TOOLS)
    events = [e for t in ids_of(tok, "Think about it.\n</think>\n\nParis is sunny.", EOT)
              for e in pipe.feed([t]).events] + pipe.finish("stop")
    out = fold_output(events)
    assert (out.reasoning, out.content, out.tool_calls) == ("Think about it.\n", "\n\nParis is sunny.", [])
    assert [(e.text, e.reason) for e in events if isinstance(e, Dropped) and e.text == EOT] == [(EOT, "end of turn")]


def test_two_invokes_in_one_block_are_typed_by_the_schema(tok, setup):
    block = (TC + "\n" + invoke("get_weather", city='Zürich "old" <b> town', days="3", hourly="true",
                                opts='{"unit": "c", "n": [1, {"a": null}]}', hours="[9, 12]")
             + invoke("other", x="42", y="[1]") + ETC)
    out = parse(tok, setup, "Need weather.\n</think>\n\nLet me check.\n" + block, EOT)
    assert (out.reasoning, out.content, out.malformed) == ("Need weather.\n", "\n\nLet me check.\n", [])
    assert calls(out) == [("get_weather", {"city": 'Zürich "old" <b> town', "days": 3, "hourly": True,
                                           "opts": {"unit": "c", "n": [1, {"a": None}]}, "hours": [9, 12]}),
                          ("other", {"x": "42", "y": "[1]"})]                 # not among the tools: strings


def test_the_tool_call_opener_ends_the_thought(tok, setup):
    out = parse(tok, setup, "I should call the tool.\n\n" + TC + "\n" + invoke("get_weather", city="Oslo") + ETC, EOT)
    assert (out.reasoning, out.content, out.malformed) == ("I should call the tool.\n\n", "", [])
    assert calls(out) == [("get_weather", {"city": "Oslo"})]


def test_the_opener_spelled_in_pieces_is_ordinary_text(tok, setup):
    spelled = ids_of(tok, "<minimax:") + ids_of(tok, "tool_call>")
    body = ids_of(tok, '\n<invoke name="get_weather">\n</invoke>\n')
    pipe = setup.pipeline(initial=InitialState.REASONING, tools=TOOLS)
    out = parse_all(pipe, ids_of(tok, "a ") + spelled + ids_of(tok, " b", END_THINK, "c ") + spelled + body)
    assert out.reasoning == "a <minimax:tool_call> b"
    assert out.content == 'c <minimax:tool_call>\n<invoke name="get_weather">\n</invoke>\n'
    assert out.tool_calls == []


def test_calls_cut_short_at_finish(tok, setup):
    head = END_THINK + TC + "\n" + invoke("get_weather", days="2") + '<invoke name="get_weather">\n'
    out = parse(tok, setup, head + '<parameter name="city">Par', reason="length")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"days": 2}'),
                                                               ("get_weather", '{"city": "Par')]
    out = parse(tok, setup, head + '<parameter name="days">1', reason="length")
    assert [c.arguments for c in out.tool_calls] == ['{"days": 2}', '{"days": 1']        # as far as it streamed
    out = parse(tok, setup, END_THINK + "x" + TC + '\n<invoke name="get_wea', reason="length")
    assert out.tool_calls == [] and out.content == 'x'  # a call cut before its name is never content


def test_names_holding_a_quote_are_read_up_to_the_tag_end(tok, setup):
    out = parse(tok, setup, END_THINK + TC + '\n<invoke name="a"b">\n<parameter name="k"e"y">v">w</parameter>\n'
                + "</invoke>\n" + ETC)
    assert calls(out) == [('a"b', {'k"e"y': 'v">w'})] and out.malformed == []


def test_without_tools_the_markup_is_content(tok, setup):
    block = TC + "\n" + invoke("f", a="1") + ETC
    out = parse(tok, setup, END_THINK + block, EOT, tools=None)
    assert out.tool_calls == [] and out.content == block


VALUES = {"city": text(max_size=6).filter(lambda v: "</parameter>" not in v), "days": st.integers(-99, 99),
          "hourly": st.booleans(), "opts": st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 3), max_size=2),
          "hours": st.lists(st.integers(0, 23), max_size=3)}


def _written(key: str, v) -> str:
    """A value as the template writes it: strings raw, others as JSON (`tojson`)."""
    return v if key == "city" else json.dumps(v)


@SETTINGS
@given(st.data(), st.booleans())
def test_chunking_properties(data, by_id):
    draw = data.draw
    ids = IDS if by_id else {}
    tag = lambda t: (ids.get(t), t)                       # noqa: E731
    free = text(exclude=(THINK, END_THINK) if by_id else TAGS)
    segs, calls_, contents, reasoning = [], [], [], draw(free)
    n_blocks = draw(st.integers(0, 2))
    opener_ends_thought = by_id and n_blocks > 0 and draw(st.booleans())
    segs.append((None, reasoning))
    if not opener_ends_thought:
        segs.append(tag(END_THINK))
    for b in range(n_blocks):
        c = "" if b == 0 and opener_ends_thought else draw(free | st.sampled_from(["", "\n", "\n\n"])) + "\n"
        contents.append(c)                                # the template writes "\n" before the block
        segs += [(None, c), tag(TC), (None, "\n")]
        for _ in range(draw(st.integers(1, 2))):
            name = draw(st.sampled_from(["get_weather", "other"]))
            keys = draw(st.lists(st.sampled_from(sorted(VALUES)), unique=True, max_size=3))
            args = {k: draw(VALUES[k]) for k in keys}
            segs.append((None, invoke(name, **{k: _written(k, v) for k, v in args.items()})))
            calls_.append((name, {k: v.strip() if k == "city" else v for k, v in args.items()} if name == "get_weather"
                           else {k: _written(k, v).strip() for k, v in args.items()}))   # values are stripped
        segs.append(tag(ETC))
    last = draw(free)
    contents.append(last)
    segs.append((None, last))
    if by_id and draw(st.booleans()):
        segs.append(tag(EOT))
    toks = tokens_of(draw, [s for s in segs if s[1]])
    events = check_chunking_and_truncation("minimax_m2", ids, "REASONING", toks, TOOLS, exact_bytes=False)
    f = fold(events)
    assert (f.reasoning, f.content, f.malformed) == (reasoning, expected_content(contents, len(calls_)), "")
    assert [(nm, json.loads(a), e) for nm, a, e in f.calls] == [(nm, a, True) for nm, a in calls_]


MARKUP = ['<invoke name="', '">', "</invoke>", '<parameter name="', "</parameter>", "get_weather", "days", "city",
          "\n", "3", "{", '"']


@SETTINGS
@given(st.data(), st.sampled_from(["REASONING", "CONTENT"]))
def test_random_markup_never_raises_and_every_call_ends(data, initial):
    toks = data.draw(st.lists(st.sampled_from(PIECES + MARKUP).map(lambda t: (None, t))
                              | st.sampled_from(sorted(IDS.items())).map(lambda kv: (kv[1], kv[0])), max_size=30))
    events = run(machine("minimax_m2", IDS, initial, TOOLS), toks)
    assert merged(events) == merged(run(machine("minimax_m2", IDS, initial, TOOLS), per_char(toks)))
    assert all(ended for *_, ended in fold(events).calls)


@SETTINGS
@given(st.lists(st.integers(1, 6), min_size=1, max_size=40))
def test_streaming_in_any_token_chunks_equals_the_final_parse(tok, setup, sizes):
    block = invoke("get_weather", city="Lyon", days="4", opts='{"a": 1}') + invoke("get_weather", hourly="false")
    reply = ids_of(tok, "Plan: call it.\n</think>\n\nOne moment.\n" + TC + "\n" + block + ETC, EOT)
    whole = parse_all(setup.pipeline(initial=InitialState.REASONING, tools=TOOLS, call_id=str), reply)
    pipe = setup.pipeline(initial=InitialState.REASONING, tools=TOOLS, call_id=str)
    events, i = [], 0
    for n in sizes * (len(reply) // len(sizes) + 1):
        if i >= len(reply):
            break
        events += pipe.feed(reply[i:i + n]).events
        i += n
    assert fold_output(events + pipe.finish("stop")) == whole
    assert calls(whole) == [("get_weather", {"city": "Lyon", "days": 4, "opts": {"a": 1}}),
                            ("get_weather", {"hourly": False})]


def test_append_think_keeps_the_thought_in_the_content(tok):
    """vLLM's `minimax_m2_append_think`: the content is `<think>` + everything generated, tags included, less the tool
    calls, in every chunking; a thought the prompt did not open gets no `<think>`."""
    think = ParserSetup.from_tokenizer(tok, "minimax_m2_append_think")
    block = TC + "\n" + invoke("get_weather", city="Oslo") + ETC
    ids = ids_of(tok, "Need weather.\n", END_THINK, "\n\nChecking.\n" + block, EOT)
    out = parse_all(think.pipeline(initial=InitialState.REASONING, tools=TOOLS), ids)
    assert (out.reasoning, out.content) == ("", "<think>Need weather.\n</think>\n\nChecking.\n")
    assert calls(out) == [("get_weather", {"city": "Oslo"})]
    pipe = think.pipeline(initial=InitialState.REASONING, tools=TOOLS)
    steps = [pipe.feed([t]) for t in ids]
    streamed = fold_output([e for s in steps for e in s.events] + pipe.finish("stop"))
    assert (streamed.content, calls(streamed)) == (out.content, calls(out))
    assert {ch for s in steps[:3] for ch in s.token_channels} == {"content"}   # the thought's logprobs are content's
    out = parse_all(think.pipeline(initial=InitialState.CONTENT), ids_of(tok, "Hi ", THINK, "hm", END_THINK, "yes"))
    assert (out.reasoning, out.content) == ("", "Hi <think>hm</think>yes")
