"""gpt-oss (harmony) replies that continue a message the prompt opened: `continue_final_message` and Anthropic assistant
prefills render `...<|start|>assistant<|channel|>final<|message|>PREFILL`, so the reply is that message's body, not a
header. With the real o200k_harmony tokenizer and the real gpt-oss chat template from ../shared (skipped where absent).
"""
from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given, strategies as st

from ember.parsers.events import ContentDelta, Dropped, Malformed, ReasoningDelta
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import parse_all
from ember.parsers.result import fold
from tests.conftest import SHARED_DATA
from tests.parsers.test_pipeline import (SETTINGS, R, C, Reply, check_invariants, check_reply, encode_text, free_text,
                                         harmony_call, pipe, setup)
from tests.parsers.test_tokens import load_tokenizer

HC, CH = InitialState.HARMONY_CONTENT, InitialState.HARMONY_CHANNEL
TEMPLATE = SHARED_DATA / "templates" / "llama.cpp" / "openai-gpt-oss-120b.jinja"
HAVE_GPT_OSS = (SHARED_DATA / "tokenizers" / "gpt-oss" / "tokenizer.json.gz").exists() and TEMPLATE.exists()
pytestmark = pytest.mark.skipif(not HAVE_GPT_OSS, reason="../shared/data (gpt-oss tokenizer, template) is absent")
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
ASK = {"role": "user", "content": "Say hello"}


def gpt_oss():
    return setup("gpt_oss", "gpt-oss")


@functools.lru_cache(maxsize=None)
def tok():
    return load_tokenizer("gpt-oss")


def render(messages: list[dict], continue_final_message: bool = False) -> str:
    """The real gpt-oss template rendered as transformers renders it; ``continue_final_message`` cuts the text right
    after the final message's content, as transformers does."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    text = env.from_string(TEMPLATE.read_text()).render(
        messages=messages, add_generation_prompt=not continue_final_message, strftime_now=lambda fmt: "2026-01-01")
    if continue_final_message:
        final = messages[-1]["content"]
        text = text[:text.rindex(final) + len(final)]
    return text


def prompt_ids(text: str) -> list[int]:
    return tok().encode(text, add_special_tokens=False).ids


def ids(*parts: str) -> list[int]:
    """Harmony specials as their single token; other text as ordinary tokens."""
    d = gpt_oss().delimiter_ids
    return [i for p in parts for i in ([d[p]] if p in d else encode_text(tok(), p))]


def start_of(text: str) -> InitialState:
    return gpt_oss().initial_state(prompt_ids(text))


HEAD = "<|start|>user<|message|>hi<|end|><|start|>assistant"


# ---------------------------------------------------------------------------------------------- the initial state
def test_template_prompts_start_where_the_prompt_leaves_the_reply():
    assert render([ASK]).endswith("<|start|>assistant")
    assert start_of(render([ASK])) == C                               # the generation prompt: a header comes first
    prefill = render([ASK, {"role": "assistant", "content": "Hello"}], continue_final_message=True)
    assert prefill.endswith("<|start|>assistant<|channel|>final<|message|>Hello")
    assert start_of(prefill) == HC
    history = [ASK, {"role": "assistant", "content": "Hi there"}, ASK, {"role": "assistant", "content": "Hello"}]
    assert start_of(render(history, continue_final_message=True)) == HC
    assert start_of(render(history[:3])) == C                         # closed history turns never count


@pytest.mark.parametrize("tail, state", [
    ("", C), ("<|channel|>", CH), ("<|channel|> \n", CH),
    ("<|channel|>final<|message|>", HC), ("<|channel|>final<|message|>Hello", HC),
    ("<|channel|>analysis<|message|>", R), ("<|channel|>analysis<|message|>Let me think", R),
    ("<|channel|>commentary<|message|>I will check", HC),             # a preamble is content
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"ci", HC),  # not a call: see below
    ("<|channel|>analysis<|message|>x<|end|>", C),                    # the message is closed: a header comes next
    ("<|channel|>final<|message|>x<|return|>", C),
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>y", HC),
    ("<|channel|>final<|message|>y<|end|><|start|>assistant<|channel|>analysis<|message|>z", R),
    ("<|channel|>fin", C),                                            # a header cut mid-word: read as the header
])
def test_hand_built_tails(tail, state):
    assert start_of(HEAD + tail) == state


def test_analysis_text_in_history_or_the_body_does_not_count():
    assert start_of(HEAD + "<|channel|>final<|message|>the word analysis<|channel|> and <|message|> as text") == HC
    assert start_of("<|start|>user<|message|>hi") == C                # no generation header at all


# ---------------------------------------------------------------------------------------------- streaming
def test_a_continued_final_message_streams_token_by_token_and_return_ends_it():
    s = gpt_oss()
    prompt = render([ASK, {"role": "assistant", "content": "Hello"}], continue_final_message=True)
    text = ", world! And then the model keeps writing its answer, sentence after sentence."
    out = ids(text, "<|return|>")
    p = s.pipeline(prompt_ids(prompt))
    assert p.initial is HC
    streamed, events = "", []
    for k, tid in enumerate(out[:-1]):
        step = p.feed([tid]).events
        events += step
        streamed += "".join(e.text for e in step if isinstance(e, ContentDelta))
        assert streamed == tok().decode(out[:k + 1]), k                # nothing withheld: no terminal is text here
    events += p.feed(out[-1:]).events + p.finish("stop")
    assert [e for e in events if isinstance(e, (Malformed, ReasoningDelta))] == []
    assert [(e.text, e.reason) for e in events if isinstance(e, Dropped)] == [("<|return|>", "harmony end")]
    assert fold(events).content == text == parse_all(s.pipeline(prompt_ids(prompt)), out).content


def test_the_generation_prompt_still_reads_a_header():
    s = gpt_oss()
    p = s.pipeline(prompt_ids(render([ASK])))
    out = ids("<|channel|>", "final", "<|message|>", "Hello, world!", "<|return|>")
    events = p.feed(out[:3]).events
    assert not [e for e in events if isinstance(e, ContentDelta)]     # the header surfaces as nothing
    f = fold(events + p.feed(out[3:]).events + p.finish("stop"))
    assert f.content == "Hello, world!" and not f.malformed
    assert [(d.text, d.reason) for d in f.dropped] == [("<|channel|>final<|message|>", "harmony header"),
                                                        ("<|return|>", "harmony end")]


def test_a_continued_analysis_message_is_reasoning_then_the_answer():
    s = gpt_oss()
    out = ids(" so the answer is 4.", "<|end|>", "<|start|>", "assistant", "<|channel|>", "final", "<|message|>",
              "4", "<|return|>")
    p = s.pipeline(prompt_ids(HEAD + "<|channel|>analysis<|message|>2+2"))
    assert p.initial is R
    first = p.feed(out[:1]).events
    assert [type(e) for e in first] == [ReasoningDelta]
    f = check_invariants(s, R, out, tok=tok())
    assert (f.reasoning, f.content, f.malformed) == (" so the answer is 4.", "4", [])


def test_after_the_prompts_channel_the_header_is_read_whole():
    """A prompt ending `<|channel|>`: the model writes the channel name; that `<|channel|>` is prompt, not an event."""
    s = gpt_oss()
    assert s.initial_state(prompt_ids(HEAD + "<|channel|>")) is CH
    out = ids("analysis", "<|message|>", "hmm", "<|end|>", "<|start|>", "assistant", "<|channel|>", "final",
              "<|message|>", "Hi", "<|return|>")
    f = check_invariants(s, CH, out, tok=tok())
    assert (f.reasoning, f.content, f.malformed) == ("hmm", "Hi", [])
    assert f.dropped[0].text == "analysis<|message|>"
    call = ids("commentary to=functions.get_weather ", "<|constrain|>", "json", "<|message|>", '{"city": "Paris"}',
               "<|call|>")
    f = check_invariants(s, CH, call, tok=tok(), tools=TOOLS)
    assert [(c.name, c.arguments) for c in f.tool_calls] == [("get_weather", '{"city": "Paris"}')] and not f.content
    # from the generation prompt the same output is a channel-less header: content, not reasoning
    assert fold(s.pipeline(prompt_ids(HEAD)).feed(ids("analysis", "<|message|>", "x")).events).reasoning == ""


def test_a_continued_tool_call_body_is_content():
    """The call's name, id and arguments so far are prompt, not output: the continuation surfaces as text."""
    s = gpt_oss()
    prompt = HEAD + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
    out = ids('"Paris"}', "<|call|>")
    f = parse_all(s.pipeline(prompt_ids(prompt), tools=TOOLS), out)
    assert (f.content, f.tool_calls, f.malformed) == ('"Paris"}', [], [])
    assert [(d.text, d.reason) for d in f.dropped] == [("<|call|>", "harmony end")]


# ---------------------------------------------------------------------------------------------- properties
@SETTINGS
@given(st.data())
def test_continued_final_replies(data):
    """Any chunking of a continued answer equals its final parse (and every truncation streams as it folds)."""
    draw = data.draw
    s = gpt_oss()
    r = Reply(tok())
    r.content = draw(free_text())
    r.text(draw, r.content)
    end = draw(st.sampled_from(["<|return|>", "<|end|>", None]))
    if end is not None:
        r.delim(s, end)
    if end == "<|end|>" and draw(st.booleans()):               # another message follows: a call
        r.delim(s, "<|start|>")
        r.text(draw, "assistant")
        r.delim(s, "<|channel|>")
        harmony_call(draw, s, r)
    check_reply(s, HC, r, tools=[{"type": "function", "function": {"name": n}} for n, _ in r.calls] or None)


@SETTINGS
@given(st.data())
def test_continued_analysis_replies(data):
    draw = data.draw
    s = gpt_oss()
    r = Reply(tok())
    r.reasoning = draw(free_text())
    r.text(draw, r.reasoning)
    r.delim(s, "<|end|>")
    r.delim(s, "<|start|>")
    r.text(draw, "assistant")
    r.delim(s, "<|channel|>")
    r.text(draw, "final")
    r.delim(s, "<|message|>")
    r.content = draw(free_text())
    r.text(draw, r.content)
    r.delim(s, "<|return|>")
    check_reply(s, R, r)


def test_pipe_helper_matches_the_prompt_path():
    """`ParserSetup.pipeline(prompt_ids)` (the server's path) and an explicit initial state parse alike."""
    s = gpt_oss()
    prompt = prompt_ids(render([ASK, {"role": "assistant", "content": "Hello"}], continue_final_message=True))
    out = ids(" there", "<|return|>")
    assert parse_all(s.pipeline(prompt), out) == parse_all(pipe(s, HC), out)
