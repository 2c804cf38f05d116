"""`parallel_tool_calls: false` / `disable_parallel_tool_use` without a grammar: only a choice's first tool call is
returned, and the stream (as the official SDKs rebuild it) and the non-streaming body agree for every split."""
from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from ember.parsers.events import ContentDelta, Dropped, ToolCallArguments, ToolCallEnd, ToolCallStart
from ember.server.anthropic_encoder import MessageEncoder
from ember.server.call_limit import first_call_only
from ember.server.choice import ChoiceEnd, ChoiceStep, TokenInfo
from ember.server.openai_encoder import ChatChoiceEncoder, ChunkMeta, chat_body, usage

EVENTS = [
    ContentDelta("Checking both."), ToolCallStart(0, "call_a", "get_weather"), ToolCallArguments(0, '{"city": '),
    ToolCallArguments(0, '"Paris"}'), ToolCallEnd(0), ToolCallStart(1, "call_b", "get_time"),
    ToolCallArguments(1, '{"tz": "CET"}'), ToolCallEnd(1), ToolCallStart(2, "call_c", "get_weather"),
    ToolCallArguments(2, "{}"), ToolCallEnd(2), Dropped("<|im_end|>", "special"),
]


def _steps(cuts: list[int]) -> list[ChoiceStep]:
    bounds = [0, *sorted(set(cuts)), len(EVENTS)]
    steps = [ChoiceStep(0, [TokenInfo(100 + i)], list(EVENTS[a:b])) for i, (a, b) in enumerate(zip(bounds,
                                                                                                     bounds[1:]))]
    steps[-1].end = ChoiceEnd("eos")
    return [first_call_only(s) for s in steps]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(EVENTS) - 1), max_size=6))
def test_openai_stream_and_body_carry_only_the_first_call(cuts):
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    steps = _steps(cuts)
    meta = ChunkMeta(id="chatcmpl-x", created=1, model="m")
    enc = ChatChoiceEncoder(meta, 0, lambda t: b"")
    chunks = [enc.start()]
    for s in steps:
        chunks += enc.step(s)
    body = chat_body(meta, steps, lambda t: b"", n=1, prompt_token_ids=None, usage_body=usage(3, enc.num_tokens))
    state = ChatCompletionStreamState()
    for ch in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(ch))
    rebuilt = state.get_final_completion().choices[0]
    msg = body["choices"][0]["message"]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("call_a", "get_weather", '{"city": "Paris"}')]
    assert [(t.id, t.function.name, t.function.arguments) for t in rebuilt.message.tool_calls] == [
        ("call_a", "get_weather", '{"city": "Paris"}')]
    assert msg["content"] == rebuilt.message.content == "Checking both."
    assert body["choices"][0]["finish_reason"] == rebuilt.finish_reason == "tool_calls"


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(EVENTS) - 1), max_size=6))
def test_anthropic_stream_and_body_carry_only_the_first_call(cuts):
    from anthropic.lib.streaming._messages import accumulate_event

    steps = _steps(cuts)
    enc = MessageEncoder("msg_1", "m", input_tokens=3)
    evs = enc.start()
    for s in steps:
        evs += enc.events(s.events, len(s.tokens))
    evs += enc.finish(steps[-1].end)
    snapshot, bufs = None, {}
    for ev in json.loads(json.dumps(evs)):
        snapshot = accumulate_event(event=ev, current_snapshot=snapshot, json_bufs=bufs)
    body = MessageEncoder("msg_1", "m", input_tokens=3).body(steps)
    blocks = [(b["type"], b.get("name"), b.get("input")) for b in body["content"]]
    assert blocks == [("text", None, None), ("tool_use", "get_weather", {"city": "Paris"})]
    sdk = snapshot.to_dict()
    assert [(b["type"], b.get("name"), b.get("input")) for b in sdk["content"]] == blocks
    assert body["stop_reason"] == sdk["stop_reason"] == "tool_use"
