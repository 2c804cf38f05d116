"""`ChatChoiceEncoder.step_sse` (the streaming fast path: fixed chunk text around an encoded delta) writes the same
bytes as encoding each chunk dict of `step` with `sse_line`, for every kind of step."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ember.parsers.events import (ContentDelta, Dropped, Malformed, ReasoningDelta, ToolCallArguments, ToolCallEnd,
                                  ToolCallStart)
from ember.server.choice import ChoiceEnd, ChoiceStep, TokenInfo
from ember.server.openai_encoder import ChatChoiceEncoder, ChunkMeta, sse_line

_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_event = st.one_of(
    st.builds(ContentDelta, _text), st.builds(ReasoningDelta, _text), st.builds(Malformed, _text, st.just("x")),
    st.builds(Dropped, _text, st.just("x")), st.builds(ToolCallStart, st.integers(0, 2), _text, _text),
    st.builds(ToolCallArguments, st.integers(0, 2), _text), st.builds(ToolCallEnd, st.integers(0, 2)))
_token = st.builds(TokenInfo, st.integers(0, 50000), st.one_of(st.none(), st.floats(-20, 0)),
                   st.lists(st.tuples(st.integers(0, 300), st.floats(-20, 0)), max_size=3),
                   st.sampled_from([None, "content", "reasoning", "tool"]))
_end = st.one_of(st.none(), st.builds(ChoiceEnd, st.sampled_from(["eos", "stop_string", "length", "abort", "error"]),
                                      stop_string=st.one_of(st.none(), st.text(max_size=4)),
                                      stop_token=st.one_of(st.none(), st.integers(0, 99))))
_meta = st.builds(ChunkMeta, id=_text, created=st.integers(0, 2**40), model=_text, logprobs=st.booleans(),
                  top_logprobs=st.integers(0, 3), return_token_ids=st.booleans(), include_usage=st.booleans(),
                  continuous_usage=st.booleans())


def _tb(token_id: int) -> bytes:
    return bytes([token_id % 256]) * (1 + token_id % 3)


@settings(max_examples=150, deadline=None)
@given(_meta, st.integers(0, 3), st.lists(st.tuples(st.lists(_event, max_size=5), st.lists(_token, max_size=3),
                                                     _end), min_size=1, max_size=4))
def test_step_sse_equals_the_encoded_chunk_dicts(meta, index, steps):
    if meta.continuous_usage and not meta.include_usage:
        meta.continuous_usage = False  # the server sets it only with include_usage
    slow, fast = ChatChoiceEncoder(meta, index, _tb, 11), ChatChoiceEncoder(meta, index, _tb, 11)
    for events, tokens, end in steps:
        step = ChoiceStep(index, tokens, events, end)
        assert fast.step_sse(step) == "".join(sse_line(c) for c in slow.step(step))
    assert (fast.completed_calls, fast.num_tokens) == (slow.completed_calls, slow.num_tokens)


def test_a_content_token_chunk_byte_for_byte():
    meta = ChunkMeta(id="chatcmpl-1", created=7, model="m\u00e9", return_token_ids=True, include_usage=True)
    out = ChatChoiceEncoder(meta, 0, _tb).step_sse(ChoiceStep(0, [TokenInfo(5)], [ContentDelta('a"\n\u00e9')]))
    assert out == ('data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m\u00e9",'
                   '"choices":[{"index":0,"delta":{"content":"a\\"\\n\u00e9"},"logprobs":null,"finish_reason":null,'
                   '"token_ids":[5]}],"usage":null}\n\n')
