"""The whole output pipeline (real token IDs -> bytes -> UTF-8 -> stop strings -> machine -> events): the issue's seed
cases, pipeline behaviour (delimiter routing, specials, stop strings, token channels) and hypothesis property tests of
the design's invariants I1-I4, I6-I8, I12-I14 over generated replies, tokenized by the real tokenizers (the demo
tokenizer stands in for Qwen3's where ../shared is absent)."""
from __future__ import annotations

import functools
import json
import os
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ember.parsers.events import (ContentDelta, Dropped, Malformed, ReasoningDelta, ToolCallArguments,
                                  ToolCallStart)
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import DELIMITER, DROPPED, PENDING, OutputPipeline, ParserSetup, parse_all
from ember.parsers.result import fold
from ember.parsers.tokens import PromptContext
from tests.conftest import SHARED_DATA
from tests.parsers.test_tokens import demo_tokenizer, load_token_bytes, load_tokenizer

R, C = InitialState.REASONING, InitialState.CONTENT
SETTINGS = settings(max_examples=int(os.environ.get("EMBER_PARSER_EXAMPLES", "25")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HAVE_SHARED = (SHARED_DATA / "tokenizers" / "qwen3" / "tokenizer.json.gz").exists()


@functools.lru_cache(maxsize=None)
def chatml() -> tuple:
    """(tokenizer, TokenBytes) with Qwen3's specials as single tokens: the real Qwen3 one, else the demo's."""
    if HAVE_SHARED:
        return load_tokenizer("qwen3"), load_token_bytes("qwen3")
    tok = demo_tokenizer()
    from ember.parsers.tokens import TokenBytes

    return tok, TokenBytes.from_tokenizer(tok)


@functools.lru_cache(maxsize=None)
def setup(profile: str, vocab: str = "chatml") -> ParserSetup:
    tok, tb = chatml() if vocab == "chatml" else (load_tokenizer(vocab), load_token_bytes(vocab))
    eos = [i for t in ("<|endoftext|>", "<｜end▁of▁sentence｜>") if (i := tb.added_token_id(t)) is not None]
    return ParserSetup.from_tokenizer(tok, profile, tb=tb, drop_ids=eos)


def encode_text(tok, text: str, cuts=()) -> list[int]:
    """``text`` as ordinary tokens: cut after every ``<`` (so no added token can match inside it) and at ``cuts``."""
    points = sorted({c for c in cuts if 0 < c < len(text)} | {m.end() for m in re.finditer("<", text)})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    return [i for p in pieces if p for i in tok.encode(p, add_special_tokens=False).ids]


def pipe(s: ParserSetup, initial: InitialState, **kw) -> OutputPipeline:
    kw.setdefault("call_id", lambda i: f"call_{i}")
    return s.pipeline(initial=initial, **kw)


def stream(p: OutputPipeline, chunks, reason="stop"):
    events = []
    for c in chunks:
        events += p.feed(c).events
    return events + p.finish(reason)


def resolved_channels(p: OutputPipeline, chunks, reason="stop") -> list[str]:
    """Each fed token's channel, a `PENDING` one replaced by what a later step (or the finish) resolved it to."""
    out: list[str] = []
    waiting: list[int] = []

    def settle(resolved):
        if resolved:
            assert len(resolved) == len(waiting)
            for k, ch in zip(waiting, resolved):
                out[k] = ch
            waiting.clear()

    for c in chunks:
        step = p.feed(c)
        settle(step.resolved)
        for ch in step.token_channels:
            if ch == PENDING:
                waiting.append(len(out))
            out.append(ch)
    settle(p.finish_step(reason).resolved)
    assert not waiting
    return out


def channel_text(tb, ids, channels, channel: str) -> str:
    """The text of the tokens whose channel is ``channel``, from their bytes (what logprobs' ``bytes`` rebuild)."""
    return b"".join(tb.token_bytes(i) for i, ch in zip(ids, channels) if ch == channel).decode("utf-8", "replace")


def raw_text(events) -> str:
    """Every character the events account for, in order (a tool name stands for its own bytes)."""
    out = []
    for e in events:
        if isinstance(e, (ReasoningDelta, ContentDelta, Malformed, Dropped)):
            out.append(e.text)
        elif isinstance(e, ToolCallStart):
            out.append(e.name)
        elif isinstance(e, ToolCallArguments):
            out.append(e.fragment)
    return "".join(out)


def partitions(ids, rng: random.Random):
    for size in (1, 2, 3, 5, 11, 23, len(ids) or 1):
        yield [ids[i:i + size] for i in range(0, len(ids), size)]
    for _ in range(2):
        out, i = [], 0
        while i < len(ids):
            n = rng.randint(0, 7)
            out.append(ids[i:i + n])
            i += n
        yield out


def check_invariants(s: ParserSetup, initial, ids, exact_bytes=True, tok=None, exact_channels=True, **kw):
    """I1 chunking invariance (of the events and of each token's resolved channel), I2 stream == fold, I3 byte
    conservation (against the tokenizer's own decode; the content and reasoning tokens' bytes are those channels'
    text, with ``exact_channels``: no token spans two channels), I4 monotonicity, I13 totality, I14 every
    truncation; returns the folded result."""
    tb = s.tb
    p = pipe(s, initial, **kw)
    whole_events = p.feed(ids).events + p.finish("stop")
    whole = fold(whole_events)
    channels = resolved_channels(pipe(s, initial, **kw), [ids])
    if exact_bytes:
        assert raw_text(whole_events) == tb.decode(ids)
        if tok is not None:
            assert raw_text(whole_events) == tok.decode(ids, skip_special_tokens=False)
    if exact_bytes and exact_channels:
        assert channel_text(tb, ids, channels, "content") == whole.content
        assert channel_text(tb, ids, channels, "reasoning") == whole.reasoning
    rng = random.Random(len(ids))
    for chunks in partitions(ids, rng):
        assert fold(stream(pipe(s, initial, **kw), chunks)) == whole
        assert resolved_channels(pipe(s, initial, **kw), chunks) == channels
    # I4: after every token, every surfaced field is a prefix of its final value; names appear once, complete
    p = pipe(s, initial, **kw)
    seen: list = []
    for k, tid in enumerate(ids):
        seen += p.feed([tid]).events
        now = fold(seen)
        assert whole.reasoning.startswith(now.reasoning) and whole.content.startswith(now.content), k
        assert len(now.tool_calls) <= len(whole.tool_calls)
        for got, full in zip(now.tool_calls, whole.tool_calls):
            assert (got.id, got.name) == (full.id, full.name) and full.arguments.startswith(got.arguments), k
    starts = [e.index for e in whole_events if isinstance(e, ToolCallStart)]
    assert starts == list(range(len(starts)))
    # I14: cut at every token (max_tokens = k): streamed == whole, every open call closed, bytes conserved
    for k in range(len(ids)):
        p = pipe(s, initial, **kw)
        cut_whole = p.feed(ids[:k]).events + p.finish("length")
        cut_stream = stream(pipe(s, initial, **kw), [[t] for t in ids[:k]], "length")
        assert fold(cut_stream) == fold(cut_whole), k
        assert not fold(cut_whole).unclosed
        if exact_bytes:
            assert raw_text(cut_whole) == tb.decode(ids[:k]), k
    return whole


PIECES = ["a", "b", "Z", " ", "\n", "\t", "<", ">", "/", "=", "é", "中", "😀", "東京", "{", "}", "[", '"', "\\",
          ":", "think", "tool_call", "</think>", "<think>", "<tool_call>", "</tool_call>", "</parameter", "<parameter=",
          "</function>", "<function=", "<|end|>", "<|channel|>", "<|im_end|>", "<|im_start|>"]


def free_text(exclude=(), max_size=8):
    return (st.lists(st.sampled_from(PIECES), max_size=max_size).map("".join)
            .filter(lambda t: not any(x in t for x in exclude)).map(lambda t: t if t.strip() else ""))


NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | free_text(max_size=4),
                    lambda ch: st.lists(ch, max_size=3) | st.dictionaries(free_text(max_size=2), ch, max_size=3),
                    max_leaves=6)


class Reply:
    """A generated reply: the token IDs and what it must parse into."""

    def __init__(self, tok):
        self.tok, self.ids, self.reasoning, self.content, self.calls = tok, [], "", "", []
        self.thought = False    # the reply holds a thought (opened by the prompt or by itself) that it closes

    def __repr__(self) -> str:
        return (f"Reply(ids={self.ids}, reasoning={self.reasoning!r}, content={self.content!r}, "
                f"calls={self.calls!r})")

    def text(self, draw, t: str) -> None:
        cuts = draw(st.lists(st.integers(1, max(1, len(t) - 1)), max_size=3)) if t else []
        self.ids += encode_text(self.tok, t, cuts)

    def delim(self, s: ParserSetup, text: str) -> None:
        self.ids.append(s.delimiter_ids[text])


def hermes_call(draw, s, r: Reply) -> None:
    name = draw(NAMES)
    args = draw(st.dictionaries(free_text(max_size=3), JSON, max_size=3))
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=draw(st.booleans()))
    r.delim(s, "<tool_call>")
    r.text(draw, "\n" + body + "\n")
    r.delim(s, "</tool_call>")
    r.calls.append((name, args))


def harmony_call(draw, s, r: Reply) -> None:
    """A gpt-oss tool call after its ``<|channel|>``: ``commentary to=functions.NAME <|constrain|>json<|message|>``,
    the arguments' JSON, ``<|call|>``."""
    name = draw(NAMES)
    args = draw(st.dictionaries(free_text(max_size=3), JSON, max_size=3))
    r.text(draw, f"commentary to=functions.{name} ")
    r.delim(s, "<|constrain|>")
    r.text(draw, "json")
    r.delim(s, "<|message|>")
    r.text(draw, json.dumps(args, ensure_ascii=draw(st.booleans())))
    r.delim(s, "<|call|>")
    r.calls.append((name, args))


XML_VALUE_ENDS = ("</parameter>", "<parameter=", "</function>")
"""Tags that end a Qwen3-Coder value (the last two where its close tag is missing, as vLLM reads it): no value holds
them."""

CODER_TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "t": {"type": "string"}, "n": {"type": "integer"}}}}} for n in ("f", "g")]


def coder_call(draw, s, r: Reply) -> None:
    name = draw(st.sampled_from(["f", "g"]))
    keys = draw(st.lists(st.sampled_from(["s", "t", "n"]), unique=True, max_size=3))
    args = {k: (draw(st.integers(-999, 999)) if k == "n" else draw(free_text(exclude=XML_VALUE_ENDS))) for k in keys}
    body = f"\n<function={name}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    r.delim(s, "<tool_call>")
    r.text(draw, body + "</function>\n")
    r.delim(s, "</tool_call>")
    r.calls.append((name, args))


@st.composite
def think_tool_reply(draw, profile: str):
    """A Qwen3 / Qwen3-Coder / Hermes / DeepSeek-R1 reply: optional thought, content, tool calls, end of turn."""
    s = setup(profile)
    r = Reply(chatml()[0])
    initial, thought = C, False
    if s.profile.reasoning is not None:
        initial = draw(st.sampled_from([R, C]))
        if initial == R or draw(st.booleans()):
            thought = r.thought = True
            if initial == C:
                r.delim(s, "<think>")
            r.reasoning = draw(free_text())
            r.text(draw, r.reasoning)
            r.delim(s, "</think>")
            if draw(st.booleans()):
                r.delim(s, "</think>")               # I8: a duplicate close after a closed thought is absorbed
    call = {"qwen3": hermes_call, "hermes": hermes_call, "qwen3_coder": coder_call}.get(profile)
    contents = []
    if not thought and draw(st.booleans()):
        # I8: a close (then an open) token after a prompt that opened no thought is content verbatim
        tb = chatml()[1]
        stray = draw(free_text())
        r.ids += [tb.added_token_id("</think>")] + encode_text(r.tok, stray) + [tb.added_token_id("<think>")]
        contents.append("</think>" + stray + "<think>")
    for _ in range(draw(st.integers(0, 2)) if call else 0):
        contents.append(draw(free_text()))
        r.text(draw, contents[-1])
        call(draw, s, r)
    contents.append(draw(free_text()))
    r.text(draw, contents[-1])
    r.content = "".join(contents)
    if draw(st.booleans()):
        r.ids.append(s.delimiter_ids[s.profile.end_of_turn[0]])
    return profile, initial, r


def check_reply(s, initial, r: Reply, exact_bytes=True, **kw):
    whole = check_invariants(s, initial, r.ids, exact_bytes=exact_bytes, tok=r.tok, **kw)
    assert (whole.reasoning, whole.content) == (r.reasoning, r.content)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == r.calls
    assert [c.id for c in whole.tool_calls] == [f"call_{i}" for i in range(len(r.calls))]
    assert not whole.malformed and not whole.unclosed
    return whole


# ---------------------------------------------------------------------------------------------- property tests
@SETTINGS
@given(think_tool_reply("qwen3"))
def test_qwen3_replies(reply):
    p, initial, r = reply
    s = setup(p)
    check_reply(s, initial, r, tools=CODER_TOOLS)


@SETTINGS
@given(think_tool_reply("hermes"))
def test_hermes_replies(reply):
    p, initial, r = reply
    s = setup(p)
    check_reply(s, initial, r, tools=CODER_TOOLS)


@SETTINGS
@given(think_tool_reply("qwen3_coder"))
def test_qwen3_coder_replies(reply):
    p, initial, r = reply
    s = setup(p)
    check_reply(s, initial, r, exact_bytes=not r.calls, tools=CODER_TOOLS)


@SETTINGS
@given(think_tool_reply("qwen3"), st.sampled_from(["qwen3", "qwen3_coder", "hermes"]))
def test_without_tools_tool_markup_is_content_verbatim(reply, profile):
    """I12: no tools (or tool_choice none): everything after the thought is content, byte for byte."""
    _, initial, r = reply
    s = setup(profile)
    p = pipe(s, initial)
    f = parse_all(p, r.ids)
    thought = s.profile.reasoning is not None and r.thought
    assert f.reasoning == (r.reasoning if thought else "") and not f.tool_calls
    after = r.ids[r.ids.index(s.delimiter_ids["</think>"]) + 1:] if thought else r.ids
    if thought and after[:1] == [s.delimiter_ids["</think>"]]:
        after = after[1:]                               # a duplicate close is absorbed
    eot = {s.delimiter_ids[t] for t in s.profile.end_of_turn}
    assert f.content == s.tb.decode([i for i in after if i not in eot])


@SETTINGS
@given(st.data())
def test_none_profile_is_every_byte_as_content(data):
    s = setup("none")
    tok, tb = chatml()
    eos = tb.added_token_id("<|endoftext|>")
    body = data.draw(free_text(max_size=12))
    specials = [tb.added_token_id(t) for t in ("<think>", "</think>", "<tool_call>", "<|im_start|>")]
    ids = encode_text(tok, body) + data.draw(st.lists(st.sampled_from(specials), max_size=3)) + [eos]
    data.draw(st.randoms()).shuffle(ids)
    f = check_invariants(s, C, ids, exact_bytes=True)
    # decode(ids, skip_special_tokens=False) less the dropped EOS text: an EOS between the bytes of one character
    # interrupts it (each side decodes on its own), exactly as the EOS's own bytes would in the full decode
    runs, run = [], []
    for i in ids:
        if i == eos:
            runs.append(run)
            run = []
        else:
            run.append(i)
    assert f.content == "".join(tb.decode(r) for r in runs + [run])
    assert [d.text for d in f.dropped] == ["<|endoftext|>"] * ids.count(eos)


@pytest.mark.skipif(not HAVE_SHARED, reason="../shared/data is absent")
@SETTINGS
@given(st.data())
def test_deepseek_r1_on_deepseek_v3_vocab_with_text_matched_tags(data):
    draw = data.draw
    s = setup("deepseek_r1", "deepseek-v3")
    r = Reply(load_tokenizer("deepseek-v3"))
    tags = ("<think>", "</think>")
    r.reasoning = draw(free_text(exclude=tags).filter(lambda t: not re.search(r"</?t?h?i?n?k?$", t)))
    r.content = draw(free_text(exclude=tags))
    r.text(draw, r.reasoning + "</think>" + r.content)
    if draw(st.booleans()):
        r.ids.append(s.delimiter_ids["<｜end▁of▁sentence｜>"])
    check_reply(s, R, r, exact_channels=False)  # a token may span a text-matched tag and the text after it


@pytest.mark.skipif(not HAVE_SHARED, reason="../shared/data is absent")
@SETTINGS
@given(st.data())
def test_gpt_oss_harmony_replies(data):
    draw = data.draw
    s = setup("gpt_oss", "gpt-oss")
    r = Reply(load_tokenizer("gpt-oss"))
    if draw(st.booleans()):
        r.delim(s, "<|channel|>")
        r.text(draw, "analysis")
        r.delim(s, "<|message|>")
        r.reasoning = draw(free_text())
        r.text(draw, r.reasoning)
        r.delim(s, "<|end|>")
        r.delim(s, "<|start|>")
        r.text(draw, "assistant")
    r.delim(s, "<|channel|>")
    if draw(st.booleans()):
        harmony_call(draw, s, r)
    else:
        r.text(draw, "final")
        r.delim(s, "<|message|>")
        r.content = draw(free_text())
        r.text(draw, r.content)
        r.delim(s, "<|return|>")
    check_reply(s, C, r, tools=CODER_TOOLS)


@settings(max_examples=int(os.environ.get("EMBER_PARSER_EXAMPLES", "40")), deadline=None)
@given(st.sampled_from(["qwen3", "qwen3_coder", "hermes", "deepseek_r1", "none"]), st.sampled_from([R, C]),
       st.integers(0, 2**32), st.booleans(),
       st.sampled_from([PromptContext(), PromptContext(b"\xf0\x9f"), PromptContext(strip_space=True)]))
def test_any_token_sequence_is_total_and_chunking_invariant(profile, initial, seed, with_stop, context):
    """I13: random IDs (specials, delimiters, broken UTF-8 pieces included) never raise, in any chunking, whatever
    the prompt left unfinished or whether it has text."""
    rnd = random.Random(seed)
    s = setup(profile)
    tok, tb = chatml()
    pool = list(s.delimiter_ids.values()) + [tb.added_token_id("<|im_start|>")]
    ids = [rnd.choice(pool) if rnd.random() < 0.25 else rnd.randrange(tb.vocab_size + 10) for _ in range(40)]
    kw = {"tools": CODER_TOOLS, "stop": ["ab", "\n\n", " "] if with_stop else (), "prompt_context": context}
    p = pipe(s, initial, **kw)
    step = p.feed(ids)
    whole = fold(step.events + p.finish("length"))
    channels = resolved_channels(pipe(s, initial, **kw), [ids], "length")
    for chunks in partitions(ids, rnd):
        q = pipe(s, initial, **kw)
        events = []
        for c in chunks:
            events += q.feed(c).events
        assert fold(events + q.finish("length")) == whole
        assert resolved_channels(pipe(s, initial, **kw), chunks, "length") == channels


# ------------------------------------------------------------------------------------------------- seed cases
def ids_of(text: str) -> list[int]:
    return encode_text(chatml()[0], text)


def test_seed_spelled_close_inside_reasoning_stays_reasoning():
    s = setup("qwen3")
    ids = ids_of("Maybe I write </think> here, <tool_call> too") + [s.delimiter_ids["</think>"]] + ids_of("Answer.")
    f = parse_all(pipe(s, R), ids)
    assert f.reasoning == "Maybe I write </think> here, <tool_call> too" and f.content == "Answer."


@pytest.mark.skipif(not HAVE_SHARED, reason="../shared/data is absent")
def test_seed_text_matched_close_streamed_five_characters_at_a_time():
    tok = load_tokenizer("deepseek-v3")
    s = setup("deepseek_r1", "deepseek-v3")
    prompt = tok.encode("<｜User｜>Which?<｜Assistant｜><think>\n", add_special_tokens=False).ids
    text = "weighing it</think>Answer."
    chunks = [tok.encode(text[i:i + 5], add_special_tokens=False).ids for i in range(0, len(text), 5)]
    p = s.pipeline(prompt)
    assert p.initial == R
    events = stream(p, chunks)
    f = fold(events)
    assert (f.reasoning, f.content) == ("weighing it", "Answer.")
    assert raw_text(events) == text


def test_seed_close_after_a_prompt_that_opened_no_thought_is_content():
    s = setup("qwen3")
    tok = chatml()[0]
    prompt = tok.encode("<|im_start|>user\nPlan?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
    d = s.delimiter_ids
    ids = ids_of("Plan.") + [d["</think>"]] + ids_of("Answer.") + [d["<think>"]] + ids_of("x") + [d["</think>"]]
    p = s.pipeline(prompt, call_id=str)
    assert p.initial == C
    f = parse_all(p, ids)
    assert f.content == "Plan.</think>Answer.<think>x</think>" and f.reasoning == ""


def test_seed_qwen3_coder_malformed_parameter_tag_and_limit_still_parses():
    s = setup("qwen3_coder")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "limit": {"type": "integer"}}}}}]
    body = ("\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter city>\nx\n</parameter>\n"
            "<parameter=limit>\n5\n</parameter>\n</function>\n")
    ids = [s.delimiter_ids["<tool_call>"]] + ids_of(body) + [s.delimiter_ids["</tool_call>"]]
    for chunks in ([ids], [[i] for i in ids]):
        f = fold(stream(pipe(s, C, tools=tools), chunks))
        assert [(c.name, json.loads(c.arguments)) for c in f.tool_calls] == [("get_weather", {"city": "Paris",
                                                                                             "limit": 5})]
        assert "<parameter city>" in "".join(m.text for m in f.malformed)


# ------------------------------------------------------------------------------------------- pipeline behaviour
def byte_pieces(tb, text: str) -> list[int] | None:
    """Ordinary token ids whose bytes are exactly the single bytes of ``text`` (byte-level vocabularies)."""
    from ember.parsers.tokens import gpt2_byte_decoder

    enc = {b: c for c, b in gpt2_byte_decoder().items()}
    tok = chatml()[0]
    return [tok.token_to_id(enc[b]) for b in text.encode()]


def test_character_split_across_tokens_is_never_surfaced_broken():
    s = setup("qwen3")
    tb = s.tb
    ids = ids_of("Think ") + byte_pieces(tb, "😀東") + [s.delimiter_ids["</think>"]] + byte_pieces(tb, "é!")
    steps = []
    p = pipe(s, R)
    for i in ids:
        steps += p.feed([i]).events
    events = steps + p.finish("stop")
    assert all("\ufffd" not in raw_text([e]) for e in events)
    f = fold(events)
    assert (f.reasoning, f.content) == ("Think 😀東", "é!")


def test_dangling_bytes_before_a_delimiter_become_one_replacement_in_their_channel():
    s = setup("qwen3")
    ids = ids_of("a") + byte_pieces(s.tb, "😀")[:2] + [s.delimiter_ids["</think>"]] + byte_pieces(s.tb, "😀")[2:]
    for chunks in ([ids], [[i] for i in ids]):
        f = fold(stream(pipe(s, R), chunks))
        assert f.reasoning == "a\ufffd" and f.content == "\ufffd\ufffd"
    assert s.tb.decode(ids) == "a\ufffd</think>\ufffd\ufffd"


def test_trailing_partial_tags_are_flushed_into_their_channel_at_finish():
    s = setup("qwen3_coder")
    for tail in ("<", "</thi", "<parameter", "<|im_"):
        assert parse_all(pipe(s, R), ids_of("thinking " + tail), "length").reasoning == "thinking " + tail
        assert parse_all(pipe(s, C), ids_of("answer " + tail), "length").content == "answer " + tail


def test_token_channels_say_where_each_token_went():
    s = setup("qwen3")
    d = s.delimiter_ids
    ids = ids_of("hm") + [d["</think>"]] + ids_of("ok") + [d["<tool_call>"]] + ids_of(
        '\n{"name": "f", "arguments": {}}\n') + [d["</tool_call>"], d["<|im_end|>"]]
    step = pipe(s, R, tools=CODER_TOOLS).feed(ids)
    assert step.tokens_used == len(ids) and len(step.token_channels) == len(ids)
    n_hm, n_ok = len(ids_of("hm")), len(ids_of("ok"))
    ch = step.token_channels
    assert ch[:n_hm] == ["reasoning"] * n_hm and ch[n_hm] == DELIMITER
    assert ch[n_hm + 1:n_hm + 1 + n_ok] == ["content"] * n_ok and ch[n_hm + 1 + n_ok] == DELIMITER
    assert set(ch[n_hm + 2 + n_ok:-2]) == {"tool"} and ch[-2:] == [DELIMITER, DELIMITER]
    eos = s.tb.added_token_id("<|endoftext|>")
    step = pipe(setup("none"), C).feed(ids_of("x") + [eos])
    assert step.token_channels[-1] == DROPPED and step.events[-1] == Dropped("<|endoftext|>", "special")


def test_held_whitespace_tokens_take_the_channel_of_its_fate():
    """Whitespace held at a boundary: its tokens are PENDING until the step that surfaces it as content or drops it
    (then they are delimiters); a malformed call's text is content."""
    s = setup("qwen3")
    d = s.delimiter_ids
    nl, hi = ids_of("\n"), ids_of("hi")
    p = pipe(s, R, tools=CODER_TOOLS)
    assert p.feed([d["</think>"]]).token_channels == [DELIMITER]
    assert [p.feed([t]).token_channels for t in nl + nl] == [[PENDING]] * 2 * len(nl)
    step = p.feed(hi)
    assert step.resolved == ["content"] * 2 * len(nl) and step.token_channels == ["content"] * len(hi)
    assert fold(step.events).content == "\n\nhi"
    p = pipe(s, C, tools=CODER_TOOLS)
    assert p.feed(nl).token_channels == [PENDING] * len(nl)
    step = p.feed([d["<tool_call>"]])
    assert step.resolved == [DELIMITER] * len(nl) and step.token_channels == [DELIMITER]
    bad = ids_of("hel")
    assert p.feed(bad).token_channels == ["content"] * len(bad)
    assert resolved_channels(pipe(s, C), [nl, nl]) == ["content"] * 2 * len(nl)   # released at the finish


@pytest.mark.skipif(not HAVE_SHARED, reason="../shared/data is absent")
def test_a_harmony_header_cut_short_by_a_message_end_is_content_before_the_end():
    """gpt-oss text that began a header (`<|start|>assistant dd`) and met `<|end|>`, `<|call|>` or `<|return|>`: it
    is content, surfaced before the end token, and its tokens are content tokens (it came out at the finish, after
    the end, its tokens counted as the delimiter's: the content had no logprobs)."""
    h = setup("gpt_oss", "gpt-oss")
    tok = load_tokenizer("gpt-oss")
    head = [h.tb.added_token_id("<|channel|>"), *tok.encode("final").ids, h.tb.added_token_id("<|message|>"),
            *tok.encode("c").ids, h.tb.added_token_id("<|end|>"), h.tb.added_token_id("<|start|>")]
    broken = tok.encode("assistant dd").ids
    for end in ("<|end|>", "<|call|>", "<|return|>"):
        ids = head + broken + [h.tb.added_token_id(end)]
        for chunks in ([ids], [[t] for t in ids]):
            events = stream(pipe(h, C), chunks, "eos")
            assert fold(events).content == "cassistant dd"
            texts = [type(e).__name__ for e in events if not isinstance(e, Dropped) or e.text == end]
            assert texts[-2:] == ["Malformed", "Dropped"], events
            channels = resolved_channels(pipe(h, C), chunks, "eos")
            assert channels[len(head):-1] == ["content"] * len(broken) and channels[-1] == DELIMITER


def test_a_dropped_token_splits_neither_a_character_nor_a_stop_string():
    """A skipped special (`skip_special_tokens`) adds no text between the pieces of a character or of a stop string:
    they still join, as in the detokenized text vLLM matches stops on."""
    s = setup("qwen3")
    gap = s.tb.added_token_id("<|vision_start|>")
    e_acute = byte_pieces(s.tb, "é")
    p = pipe(s, C, special_ids_to_drop={gap})
    assert fold(stream(p, [[i] for i in ids_of("x") + e_acute[:1] + [gap] + e_acute[1:]])).content == "xé"
    p = pipe(s, C, special_ids_to_drop={gap}, stop=["AB"])
    f = fold(stream(p, [[i] for i in ids_of("xA") + [gap] + ids_of("BC")]))
    assert f.content == "x" and p.matched_stop == "AB"


def test_a_stop_token_that_is_a_delimiter_is_left_out():
    """A request's stop_token_ids end the reply without their text, even a delimiter's (`<tool_call>`, `</think>`)."""
    s = setup("qwen3")
    d = s.delimiter_ids
    for stop_id, initial in ((d["<tool_call>"], C), (d["</think>"], C), (d["</think>"], R)):
        f = parse_all(pipe(s, initial, tools=CODER_TOOLS, ending_ids={stop_id}), ids_of("Hello") + [stop_id])
        assert (f.reasoning or "") + (f.content or "") == "Hello" and not f.tool_calls


def test_other_specials_are_text_of_the_current_channel():
    s = setup("qwen3")
    im_start = s.tb.added_token_id("<|im_start|>")
    f = parse_all(pipe(s, R), ids_of("a") + [im_start] + ids_of("b"))
    assert f.reasoning == "a<|im_start|>b"


def test_stop_string_spanning_tokens_cuts_the_output_and_ends_the_request():
    s = setup("qwen3")
    d = s.delimiter_ids
    ids = ids_of("think") + [d["</think>"]] + ids_of("Answer: 42\n\nObservation: more") + ids_of(" text")
    for include in (False, True):
        for size in (1, 3, len(ids)):
            p = pipe(s, R, stop=["Observation:", "never"], include_stop_str_in_output=include)
            events, used, stopped = [], 0, False
            for i in range(0, len(ids), size):
                step = p.feed(ids[i:i + size])
                events += step.events
                used += step.tokens_used
                assert len(step.token_channels) == step.tokens_used
                if step.stopped:
                    stopped = True
                    break
            assert stopped and p.feed(ids[:3]).events == [] and p.matched_stop == "Observation:"
            f = fold(events + p.finish("stop"))
            assert f.reasoning == "think"
            assert f.content == "Answer: 42\n\n" + ("Observation:" if include else "")
            assert s.tb.decode(ids[:used]).endswith("Observation:") or "Observation:" in s.tb.decode(ids[:used])
            assert "Observation:" not in s.tb.decode(ids[:used - 1])


def test_stop_string_held_back_then_released_when_it_does_not_match():
    s = setup("qwen3")
    p = pipe(s, C, stop=["\n\nEND"])
    ids = ids_of("one\n\nEN")
    seen = fold(p.feed(ids).events)
    assert seen.content == "one"
    f = fold(p.feed(ids_of("d? no")).events + p.finish("length"))
    assert seen.content + f.content == "one\n\nENd? no" and not p.stopped and p.matched_stop is None
    q = pipe(s, C, stop=["\n\nEND"])
    assert fold(q.feed(ids_of("tail\n\nE")).events + q.finish("length")).content == "tail\n\nE"


def test_stop_string_in_reasoning_stops_there():
    s = setup("qwen3")
    f = parse_all(pipe(s, R, stop=["STOP"]), ids_of("I will STOP here") + [s.delimiter_ids["</think>"]])
    assert f.reasoning == "I will " and f.content == ""


def test_a_stop_string_may_end_in_a_non_special_delimiters_text():
    """Qwen3's <think> and <tool_call> are ordinary added tokens, part of the raw text stop strings see (as in
    vLLM): a stop string ending in one cuts the reply there, in any chunking; a partial match never runs past one."""
    s = setup("qwen3")
    d = s.delimiter_ids
    ids = [d["<think>"]] + ids_of("hmm") + [d["</think>"]] + ids_of("Hello ") + [d["<tool_call>"]] + ids_of("x")
    for stop, include, reasoning, content, used in (
            (["</think>"], False, "hmm", "", 1 + len(ids_of("hmm")) + 1),
            # kept in the output, the delimiter is still the thought's end, not reasoning text
            (["</think>"], True, "hmm", "", 1 + len(ids_of("hmm")) + 1),
            (["m</think>"], True, "hmm", "", 1 + len(ids_of("hmm")) + 1),
            (["o <tool_call>"], False, "hmm", "Hell", len(ids) - 1),
            (["<tool_call>"], True, "hmm", "Hello <tool_call>", len(ids) - 1),
            (["_call>"], False, "hmm", "Hello <tool", len(ids) - 1)):
        for size in (1, 2, len(ids)):
            p, events, n = pipe(s, R, stop=stop, include_stop_str_in_output=include), [], 0
            for i in range(0, len(ids), size):
                step = p.feed(ids[i:i + size])
                events, n = events + step.events, n + step.tokens_used
                if step.stopped:
                    break
            f = fold(events + p.finish("stop"))
            assert (f.reasoning, f.content, n, p.matched_stop) == (reasoning, content, used, stop[0]), (stop, size)
    across = parse_all(pipe(s, R, stop=["</think>Hel"]), ids)  # would run past the delimiter: no match
    assert (across.reasoning, across.content) == ("hmm", "Hello <tool_call>x")  # no tools: the tag is text


def test_a_stop_string_inside_a_tool_call_cuts_it_as_a_length_limit_does():
    """The wrapper of a call cut before its name is never content; a call cut in its arguments keeps what streamed."""
    s = setup("qwen3")
    d = s.delimiter_ids
    ids = [d["<tool_call>"]] + ids_of('\n{"name": "f", "arguments": {"s": "Paris", "t": "x"}}\n') + [d["</tool_call>"]]
    before = parse_all(pipe(s, C, tools=CODER_TOOLS, stop=['"f"']), ids)
    assert (before.content, before.tool_calls) == ("", [])
    inside = parse_all(pipe(s, C, tools=CODER_TOOLS, stop=["Paris"]), ids)
    assert inside.content == "" and [(c.name, c.arguments) for c in inside.tool_calls] == [("f", '{"s": "')]


def test_abort_emits_nothing_more():
    s = setup("qwen3")
    p = pipe(s, R)
    p.feed(ids_of("thinking <"))
    p.abort()
    assert p.feed(ids_of("more")).events == [] and p.finish("abort") == []


def test_finish_twice_and_feed_after_finish_are_empty():
    s = setup("qwen3")
    p = pipe(s, C)
    events = p.feed(ids_of("x <")).events
    assert fold(events + p.finish("length")).content == "x <"
    assert p.finish("length") == [] and p.feed(ids_of("y")).events == []


def test_unknown_and_out_of_range_ids_surface_nothing_and_do_not_raise():
    s = setup("qwen3")
    f = parse_all(pipe(s, C), ids_of("a") + [s.tb.vocab_size + 5, -1] + ids_of("b"))
    assert f.content == "ab"


def test_every_channel_ending_delimiter_is_dropped_under_its_declared_reason():
    """`CHANNEL_ENDS` names the `Dropped` reasons the Responses encoder reads to tell a closed thought or answer from
    one the cut fell in: each is what the parsers write for that delimiter."""
    from ember.parsers.events import CHANNEL_ENDS

    s = setup("qwen3")
    d = s.delimiter_ids
    seen = {e.reason for e in stream(pipe(s, C, tools=CODER_TOOLS), [ids_of("a") + [d["<think>"]] + ids_of("b")
                                                                      + [d["</think>"]] + ids_of("c")
                                                                      + [d["<tool_call>"]]]) if isinstance(e, Dropped)}
    if HAVE_SHARED:
        h = setup("gpt_oss", "gpt-oss")
        tok = load_tokenizer("gpt-oss")
        ids = [h.tb.added_token_id(t) if t.startswith("<|") else i for t in (
            "<|channel|>", "analysis", "<|message|>", "x", "<|end|>", "<|start|>", "assistant")
            for i in ([0] if t.startswith("<|") else tok.encode(t).ids)]
        seen |= {e.reason for e in stream(pipe(h, C), [ids]) if isinstance(e, Dropped)}
    assert CHANNEL_ENDS - {"harmony end", "harmony start"} <= seen
    assert not HAVE_SHARED or CHANNEL_ENDS <= seen


def test_a_call_naming_its_function_after_long_arguments_costs_linear_work(monkeypatch):
    """Hermes lets "arguments" come before "name": every token until the name is withheld, and the name's arrival
    settled each of them by scanning all the events it released (20k tokens: 7 s in one feed, the event loop
    stalled). Counted as events scanned, not timed."""
    import ember.parsers.pipeline as pipeline_module

    scanned = []
    real = pipeline_module._fate
    monkeypatch.setattr(pipeline_module, "_fate", lambda own, events: scanned.append(len(events)) or real(own, events))
    s = setup("qwen3")
    body = '{"arguments": {"s": "' + "word " * 1500 + '"}, "name": "f"}'
    ids = [s.delimiter_ids["<tool_call>"], *encode_text(chatml()[0], body), s.delimiter_ids["</tool_call>"]]
    p = pipe(s, C, tools=CODER_TOOLS)
    events = [e for i in ids for e in p.feed([i]).events] + p.finish("stop")
    assert [(c.name, json.loads(c.arguments)) for c in fold(events).tool_calls] == [("f", {"s": "word " * 1500})]
    assert sum(scanned) < 20 * len(ids), (sum(scanned), len(ids))
