"""The wire encoders are pure: any split of the same events into steps gives the same non-streaming body (built from
the one fold of the events, `parsers.result.fold`), and the official SDKs' own stream accumulators rebuild exactly
that body from our chunks / events."""
from __future__ import annotations

import dataclasses
import json

from hypothesis import given, settings, strategies as st
import pytest

from ember.parsers.events import (ContentDelta, Dropped, Malformed, ReasoningDelta, ToolCallArguments, ToolCallEnd,
                                  ToolCallStart)
from ember.server.anthropic_encoder import MessageEncoder
from ember.server.choice import ChoiceEnd, ChoiceStep, TokenInfo
from ember.server.openai_encoder import ChatChoiceEncoder, ChunkMeta, chat_body, usage

EVENTS = [
    ReasoningDelta("Let me "), ReasoningDelta("think."), Dropped("</think>", "delimiter"), ContentDelta("Calling "),
    Malformed("<oops", "bad tag"), ContentDelta(" now"), Dropped("\n", "whitespace"),
    ToolCallStart(0, "call_a", "get_weather"), ToolCallArguments(0, '{"city": '), ToolCallArguments(0, '"Paris"}'),
    ToolCallEnd(0), ToolCallStart(1, "call_b", "get_time"), ToolCallArguments(1, "{}"), ToolCallEnd(1),
    Dropped("<|im_end|>", "special"),
]


def _tb(tid: int) -> bytes:
    return f"<{tid}>".encode()


def _steps(events, cuts, end):
    bounds = [0, *sorted(set(cuts)), len(events)]
    steps = [ChoiceStep(0, [TokenInfo(100 + i, -0.5, [(100 + i, -0.5)], "content")], list(events[a:b]))
             for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    steps[-1].end = end
    return steps


def _chat_body(steps, meta):
    enc = ChatChoiceEncoder(meta, 0, _tb)
    chunks = [enc.start([1, 2, 3])]
    for s in steps:
        chunks += enc.step(s)
    return chunks, chat_body(meta, steps, _tb, n=1, prompt_token_ids=[1, 2, 3], usage_body=usage(3, enc.num_tokens))


def _sdk_rebuilt(chunks):
    """The non-streaming completion the OpenAI SDK rebuilds from our chunks."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    for ch in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(ch))
    return state.get_final_completion()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(EVENTS) - 1), max_size=8))
def test_chat_fold_is_independent_of_step_boundaries(cuts):
    meta = ChunkMeta(id="chatcmpl-x", created=1, model="m", return_token_ids=True)
    _, whole = _chat_body(_steps(EVENTS, [], ChoiceEnd("eos")), meta)
    chunks, split = _chat_body(_steps(EVENTS, cuts, ChoiceEnd("eos")), meta)
    msg = split["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "Let me think."
    assert msg["content"] == "Calling <oops now"
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("call_a", "get_weather", '{"city": "Paris"}'), ("call_b", "get_time", "{}")]
    assert split["choices"][0]["finish_reason"] == "tool_calls"
    assert split["choices"][0]["message"] == whole["choices"][0]["message"]
    # one channel per chunk; every token id in exactly one chunk
    for ch in chunks:
        delta = ch["choices"][0]["delta"]
        assert len({"content", "reasoning_content", "tool_calls"} & delta.keys()) <= 1
    assert split["choices"][0]["token_ids"] == [100 + i for i in range(len(set(cuts)) + 1)]
    assert split["prompt_token_ids"] == [1, 2, 3]
    rebuilt = _sdk_rebuilt(chunks).choices[0]
    assert rebuilt.message.content == msg["content"] and rebuilt.finish_reason == "tool_calls"
    assert [(t.id, t.function.name, t.function.arguments) for t in rebuilt.message.tool_calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]


def test_openai_sdk_accumulator_rebuilds_the_folded_body():
    meta = ChunkMeta(id="chatcmpl-y", created=1, model="m", logprobs=True, top_logprobs=1)
    chunks, body = _chat_body(_steps(EVENTS, [2, 5, 9, 12], ChoiceEnd("eos")), meta)
    final = _sdk_rebuilt(chunks)
    msg = final.choices[0].message
    assert msg.content == body["choices"][0]["message"]["content"]
    want = body["choices"][0]["message"]["tool_calls"]
    assert [(t.id, t.function.name, t.function.arguments) for t in msg.tool_calls] == [
        (t["id"], t["function"]["name"], t["function"]["arguments"]) for t in want]
    assert final.choices[0].finish_reason == "tool_calls"
    assert len(final.choices[0].logprobs.content) == len(body["choices"][0]["logprobs"]["content"]) == 5


def test_a_withheld_token_still_gets_its_own_chunk():
    meta = ChunkMeta(id="c", created=1, model="m", return_token_ids=True, logprobs=True)
    enc = ChatChoiceEncoder(meta, 0, _tb)
    chunks = enc.step(ChoiceStep(0, [TokenInfo(7, -1.0, [], None)], []))
    assert len(chunks) == 1 and chunks[0]["choices"][0]["delta"] == {}
    assert chunks[0]["choices"][0]["token_ids"] == [7]
    assert chunks[0]["choices"][0]["logprobs"] == {"content": []}  # a delimiter's logprob is not content


def test_length_wins_over_tool_calls_and_stop_string_is_stop():
    enc = ChatChoiceEncoder(ChunkMeta(id="c", created=1, model="m"), 0, _tb)
    enc.step(ChoiceStep(0, [], [ToolCallStart(0, "call_z", "f"), ToolCallEnd(0)]))
    assert enc.finish_reason(ChoiceEnd("length")) == "length"
    assert enc.finish_reason(ChoiceEnd("stop_string", stop_string="x")) == "stop"
    assert enc.finish_reason(ChoiceEnd("eos")) == "tool_calls"


def _anthropic_events(steps, end):
    enc = MessageEncoder("msg_1", "m", input_tokens=3)
    evs = enc.start()
    for s in steps:
        evs += enc.events(s.events, len(s.tokens))
    evs += enc.finish(end)
    return evs


def _anthropic_body(steps, end):
    steps = [*steps[:-1], dataclasses.replace(steps[-1], end=end)]
    return MessageEncoder("msg_1", "m", input_tokens=3).body(steps)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(EVENTS) - 1), max_size=6))
def test_anthropic_sdk_accumulator_equals_fold(cuts):
    from anthropic.lib.streaming._messages import accumulate_event

    steps = _steps(EVENTS, cuts, None)
    evs = _anthropic_events(steps, ChoiceEnd("eos"))
    assert [e["type"] for e in evs[:2]] == ["message_start", "ping"]
    assert [e["type"] for e in evs[-2:]] == ["message_delta", "message_stop"]
    snapshot, bufs = None, {}
    for ev in json.loads(json.dumps(evs)):
        snapshot = accumulate_event(event=ev, current_snapshot=snapshot, json_bufs=bufs)
    folded = _anthropic_body(steps, ChoiceEnd("eos"))
    assert folded == _anthropic_body(_steps(EVENTS, [], None), ChoiceEnd("eos")) | {"usage": folded["usage"]}
    sdk = snapshot.to_dict()
    assert [b["type"] for b in folded["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert folded["content"][0]["thinking"] == "Let me think." and folded["content"][0]["signature"]
    assert folded["content"][1]["text"] == "Calling <oops now"
    assert folded["content"][2]["input"] == {"city": "Paris"} and folded["content"][3]["input"] == {}
    assert folded["stop_reason"] == "tool_use"
    assert folded["usage"] == {"input_tokens": 3, "output_tokens": len(set(cuts)) + 1}
    assert len(folded["content"]) == len(sdk["content"])
    for mine, theirs in zip(folded["content"], sdk["content"]):
        assert {k: theirs[k] for k in mine} == mine
    assert sdk["stop_reason"] == folded["stop_reason"]


@pytest.mark.parametrize("raw", ['{"x": -4249e4242491}', '{"x": ' + "7" * 5000 + "}"])
def test_anthropic_tool_input_with_a_number_no_body_can_carry_keeps_its_raw_text(raw):
    """A finished call whose number JSON spells but a double (or Python's digit limit) cannot hold: before, the body
    held inf and its serialization was a 500; now `input` is {} and the raw text is in `partial_input`."""
    steps = [ChoiceStep(0, [], [ToolCallStart(0, "call_q", "f"), ToolCallArguments(0, raw), ToolCallEnd(0)])]
    msg = _anthropic_body(steps, ChoiceEnd("eos"))
    json.dumps(msg, allow_nan=False)
    assert msg["content"][0]["input"] == {} and msg["content"][0]["partial_input"] == raw


def test_anthropic_truncated_tool_input_is_empty_with_raw_text():
    steps = [ChoiceStep(0, [], [ToolCallStart(0, "call_q", "f"), ToolCallArguments(0, '{"a": [1')])]
    evs = _anthropic_events(steps, ChoiceEnd("length"))
    msg = _anthropic_body(steps, ChoiceEnd("length"))
    assert msg["stop_reason"] == "max_tokens"
    assert msg["content"][0]["input"] == {} and msg["content"][0]["partial_input"] == '{"a": [1'
    assert [e["type"] for e in evs].count("content_block_stop") == 1


_CLOSED_INVALID = {'{"city": Paris}': {}, "{'city': 'Paris'}": {}, '{"city": "Paris",}': {"city": "Paris"},
                   '{"city": True}': {}, "[1, 2]": {}, '"Paris"': {}, '{"a": "x\x01"}': {}, '{"a": 1.}': {},
                   '{"a": 1}{"b": 2}': {"a": 1}}


@settings(max_examples=40, deadline=None)
@given(raw=st.sampled_from(sorted(_CLOSED_INVALID)), cuts=st.lists(st.integers(min_value=1, max_value=17), max_size=5))
def test_a_call_the_model_closed_on_invalid_json_streams_what_the_anthropic_sdk_can_parse(raw, cuts):
    """The model ended its call, but its arguments are no JSON object: the body has `input: {}` and the raw text in
    `partial_input`; the stream's `input_json_delta`s stop where no object could go on, so the SDK's stream
    accumulator (which parses every prefix) rebuilds the message instead of raising, with the members that came
    complete before the break."""
    from anthropic.lib.streaming._messages import accumulate_event

    bounds = [0, *sorted({c for c in cuts if c < len(raw)}), len(raw)]
    events = [ToolCallStart(0, "call_q", "get_weather"),
              *(ToolCallArguments(0, raw[a:b]) for a, b in zip(bounds, bounds[1:])), ToolCallEnd(0)]
    steps = [ChoiceStep(0, [], events)]
    msg = _anthropic_body(steps, ChoiceEnd("eos"))
    assert msg["stop_reason"] == "tool_use"
    assert msg["content"][0]["input"] == {} and msg["content"][0]["partial_input"] == raw
    snapshot, bufs = None, {}
    for ev in json.loads(json.dumps(_anthropic_events(steps, ChoiceEnd("eos")))):
        snapshot = accumulate_event(event=ev, current_snapshot=snapshot, json_bufs=bufs)
    [block] = snapshot.to_dict()["content"]
    assert block["input"] == _CLOSED_INVALID[raw], block


def test_interleaved_reply_stream_equals_body_in_both_apis():
    """Text between two calls, a thought after content, and stray text inside an open call: the Anthropic tool_use
    block is never split, it carries all the call's arguments and the stray text follows it, in the stream and the
    body alike."""
    from anthropic.lib.streaming._messages import accumulate_event

    events = [ContentDelta("a"), ToolCallStart(0, "call_a", "f"), ToolCallArguments(0, '{"x": 1}'), ToolCallEnd(0),
              ContentDelta("between"), ReasoningDelta("hmm"), ContentDelta("b"),
              ToolCallStart(1, "call_b", "g"), ToolCallArguments(1, '{"y": '), Malformed("<oops", "bad"),
              ToolCallArguments(1, "2}"), ToolCallEnd(1), ContentDelta("end")]
    for cuts in ([], [1, 4, 6, 9, 10, 11]):
        steps = _steps(events, cuts, ChoiceEnd("eos"))
        chunks, body = _chat_body(steps, ChunkMeta(id="c", created=1, model="m"))
        rebuilt = _sdk_rebuilt(chunks).choices[0].message
        msg = body["choices"][0]["message"]
        assert msg["content"] == rebuilt.content == "abetweenb<oopsend" and msg["reasoning"] == "hmm"
        assert [c["function"]["arguments"] for c in msg["tool_calls"]] == [
            t.function.arguments for t in rebuilt.tool_calls] == ['{"x": 1}', '{"y": 2}']
        evs = _anthropic_events(steps[:-1] + [dataclasses.replace(steps[-1], end=None)], ChoiceEnd("eos"))
        snapshot, bufs = None, {}
        for ev in json.loads(json.dumps(evs)):
            snapshot = accumulate_event(event=ev, current_snapshot=snapshot, json_bufs=bufs)
        sdk = snapshot.to_dict()
        folded = _anthropic_body(steps, ChoiceEnd("eos"))
        assert [b["type"] for b in folded["content"]] == [
            "text", "tool_use", "text", "thinking", "text", "tool_use", "text"]
        assert len(sdk["content"]) == len(folded["content"])
        for mine, theirs in zip(folded["content"], sdk["content"]):
            assert {k: theirs[k] for k in mine} == mine
        assert [b["input"] for b in folded["content"] if b["type"] == "tool_use"] == [{"x": 1}, {"y": 2}]
        assert folded["content"][-1]["text"] == "<oopsend"
        assert folded["stop_reason"] == sdk["stop_reason"] == "tool_use"


def _merged(deltas: list[dict]) -> list[dict]:
    """Consecutive deltas of one channel as one: text concatenated, a call's argument fragments onto its entry."""
    out: list[dict] = []
    for d in deltas:
        prev = out[-1] if out else {}
        if "content" in d and "content" in prev:
            prev["content"] += d["content"]
        elif "reasoning" in d and "reasoning" in prev:
            prev["reasoning_content"] += d["reasoning_content"]
            prev["reasoning"] += d["reasoning"]
        elif "tool_calls" in d and "tool_calls" in prev:
            for entry in d["tool_calls"]:
                last = prev["tool_calls"][-1]
                if "id" not in entry and last["index"] == entry["index"]:
                    last["function"]["arguments"] += entry["function"]["arguments"]
                else:
                    prev["tool_calls"].append(entry)
        else:
            out.append(d)
    return out


def test_a_coalesced_step_of_many_events_gives_the_deltas_of_one_step_per_event():
    """A lagging client's step merges thousands of events: its deltas hold exactly the text that one step per event
    gives, concatenated per channel and per call, in the chunk dicts, the SSE text and the completion's text."""
    from ember.server.openai_encoder import CompletionChoiceEncoder, event_deltas, sse_line

    events = []
    for r in range(4):
        events += [ReasoningDelta(f"r{k} ") for k in range(300)] + [Dropped("</think>", "delimiter")]
        events += [Malformed("<x", "bad") if k % 50 == 0 else ContentDelta(f"é{k} ") for k in range(300)]
        events += [ToolCallStart(2 * r, f"call_{r}", "f"), *[ToolCallArguments(2 * r, f"{k},") for k in range(300)],
                   ToolCallEnd(2 * r), ToolCallStart(2 * r + 1, f"call_{r}b", "g"), ToolCallArguments(2 * r + 1, "{}"),
                   ToolCallArguments(2 * r, "]"), ToolCallEnd(2 * r + 1), ContentDelta("")]
    one_by_one = _merged([d for ev in events for d in event_deltas([ev])])
    coalesced = event_deltas(events)
    assert coalesced == one_by_one and len(coalesced) == 12
    assert coalesced[0]["reasoning"] == coalesced[0]["reasoning_content"] == "".join(f"r{k} " for k in range(300))
    assert coalesced[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": "".join(f"{k}," for k in range(300))}
    step = ChoiceStep(0, [TokenInfo(5, channel="content")], events)
    meta = ChunkMeta(id="c", created=1, model="m")
    chunks = ChatChoiceEncoder(meta, 0, _tb).step(step)
    assert [ch["choices"][0]["delta"] for ch in chunks] == coalesced
    assert ChatChoiceEncoder(meta, 0, _tb).step_sse(step) == "".join(sse_line(ch) for ch in chunks)
    text = CompletionChoiceEncoder(meta, 0, _tb).step(step)[0]["choices"][0]["text"]
    assert text == "".join(d.get("reasoning", "") + d.get("content", "") for d in one_by_one)
