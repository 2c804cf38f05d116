"""The Responses encoder on its own: for any reply and any split into engine steps, the stream's deltas rebuild each
final item byte for byte, the openai SDK's stream accumulator accepts every event, and the final response does not
depend on the split."""
from __future__ import annotations

import openai
from hypothesis import given, settings, strategies as st
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from ember.parsers.events import (ContentDelta, Dropped, Malformed, ReasoningDelta, ToolCallArguments, ToolCallEnd,
                                  ToolCallStart)
from ember.server.choice import ChoiceEnd, ChoiceStep, TokenInfo
from ember.server.responses_encoder import ResponseEncoder

_EVENT = TypeAdapter(ResponseStreamEvent)
HEAD = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m", "parallel_tool_calls": True,
        "tool_choice": "auto", "tools": []}
text = st.text(alphabet=st.sampled_from("ab é\n{}\"\U0001F600"), min_size=1, max_size=6)


@st.composite
def replies(draw):
    """A plausible event sequence: runs of thought, answer (with malformed bytes) and calls; a call may be left
    open (the flush at the end closes it)."""
    events, calls = [], 0
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["reasoning", "content", "malformed", "call", "dropped"]))
        if kind == "reasoning":
            events.append(ReasoningDelta(draw(text)))
        elif kind == "content":
            events.append(ContentDelta(draw(text)))
        elif kind == "malformed":
            events.append(Malformed(draw(text), "x"))
        elif kind == "dropped":
            events.append(Dropped("</think>", "delimiter"))
        else:
            events.append(ToolCallStart(calls, f"call_{calls}", "f"))
            events += [ToolCallArguments(calls, draw(text)) for _ in range(draw(st.integers(0, 3)))]
            events.append(ToolCallEnd(calls))
            calls += 1
    return events


def _split(events, cuts, reason):
    """The events as engine steps (one token per event), the last step ending the reply."""
    bounds = sorted({c % (len(events) + 1) for c in cuts} | {0, len(events)})
    steps = [ChoiceStep(0, [TokenInfo(7)] * (b - a), events[a:b]) for a, b in zip(bounds, bounds[1:])]
    steps = steps or [ChoiceStep(0)]
    steps[-1].end = ChoiceEnd(reason)
    steps[-1].finish_at = len(steps[-1].events)
    return steps


def _encode(steps):
    enc = ResponseEncoder(dict(HEAD), lambda t: b"x", input_tokens=3)
    events = enc.start()
    for s in steps:
        events += enc.events(s)
    return events


@settings(max_examples=300, deadline=None)
@given(replies(), st.lists(st.integers(0, 50), max_size=6), st.lists(st.integers(0, 50), max_size=6),
       st.sampled_from(["eos", "length", "stop_string"]))
def test_any_split_gives_the_same_response_and_valid_events(reply, cuts_a, cuts_b, reason):
    a = _encode(_split(reply, cuts_a, reason))
    b = _encode(_split(reply, cuts_b, reason))
    strip = lambda r: {**r, "completed_at": None, "output": [{**o, "id": None} for o in r["output"]]}  # noqa: E731
    assert strip(a[-1]["response"]) == strip(b[-1]["response"])
    assert [e["sequence_number"] for e in a] == list(range(len(a)))
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)  # raises on any inconsistent event
    for e in a:
        state.handle_event(_EVENT.validate_python(e))
    final = a[-1]["response"]
    assert final["status"] == ("incomplete" if reason == "length" else "completed")
    # every byte of the reply lands in exactly one delta of the item that holds it, in order
    deltas: dict[str, list[str]] = {}
    for e in a:
        if e["type"].endswith(".delta"):
            deltas.setdefault(e["item_id"], []).append(e["delta"])
    for item in final["output"]:
        got = "".join(deltas.get(item["id"], []))
        if item["type"] == "function_call":
            assert got == item["arguments"]
        else:
            assert got == item["content"][0]["text"]
    streamed = [(e["item"]["type"], "".join(deltas.get(e["item"]["id"], []))) for e in a
                if e["type"] == "response.output_item.done"]
    want = []
    for ev in reply:
        kind = {ReasoningDelta: "reasoning", ContentDelta: "message", Malformed: "message",
                ToolCallStart: "function_call", ToolCallArguments: "function_call"}.get(type(ev))
        piece = getattr(ev, "text", None) or getattr(ev, "fragment", "")
        if kind is None:
            continue
        if not want or want[-1][0] != kind or isinstance(ev, ToolCallStart):
            want.append((kind, ""))
        want[-1] = (kind, want[-1][1] + piece)
    assert streamed == want


def test_a_call_closed_by_the_length_flush_is_incomplete():
    events = [ToolCallStart(0, "call_0", "f"), ToolCallArguments(0, '{"a": '), ToolCallEnd(0)]
    steps = [ChoiceStep(0, [TokenInfo(1)], events[:2]), ChoiceStep(0, [TokenInfo(2)], events[2:], ChoiceEnd("length"),
                                                                   finish_at=0)]
    final = _encode(steps)[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["output"][0]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    steps[1].finish_at = 1  # the call's own end token came before the cut: complete
    assert _encode(steps)[-1]["response"]["output"][0]["status"] == "completed"


def test_content_logprobs_ride_with_the_text_they_belong_to():
    enc = ResponseEncoder(dict(HEAD), lambda t: str(t).encode(), input_tokens=1, top_logprobs=1)
    withheld = ChoiceStep(0, [TokenInfo(5, -0.5, [(5, -0.5)], "content")], [])  # text held back (a partial tag)
    shown = ChoiceStep(0, [TokenInfo(6, -0.25, [(6, -0.25)], "content")], [ContentDelta("56")], ChoiceEnd("eos"))
    events = enc.events(withheld) + enc.events(shown)
    [delta] = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [lp["token"] for lp in delta["logprobs"]] == ["5", "6"]
    part = events[-1]["response"]["output"][0]["content"][0]
    assert [lp["logprob"] for lp in part["logprobs"]] == [-0.5, -0.25]
    assert events[-1]["response"]["usage"]["output_tokens"] == 2


def test_a_step_of_several_tokens_streams_one_delta_with_all_their_logprobs():
    """A lagging client gets merged steps: each delta still carries exactly its own tokens' logprobs."""
    enc = ResponseEncoder(dict(HEAD), lambda t: str(t).encode(), input_tokens=1, top_logprobs=0)
    merged = ChoiceStep(0, [TokenInfo(5, -0.5, [], "content"), TokenInfo(6, -0.25, [], "content")],
                        [ContentDelta("5"), ContentDelta("6")])
    last = ChoiceStep(0, [TokenInfo(7, -1.0, [], "content")], [ContentDelta("7")], ChoiceEnd("eos"))
    deltas = [e for e in enc.events(merged) + enc.events(last) if e["type"] == "response.output_text.delta"]
    assert [(d["delta"], [lp["token"] for lp in d["logprobs"]]) for d in deltas] == [("56", ["5", "6"]),
                                                                                     ("7", ["7"])]


def test_a_failed_generation_ends_in_response_failed():
    steps = [ChoiceStep(0, [TokenInfo(1)], [ContentDelta("a")]),
             ChoiceStep(0, [], [], ChoiceEnd("error", error="boom"))]
    final = _encode(steps)[-1]
    assert final["type"] == "response.failed" and final["response"]["status"] == "failed"
    assert final["response"]["error"] == {"code": "server_error", "message": "boom"}
    assert final["response"]["output"][0]["content"][0]["text"] == "a"
    refused = _encode([ChoiceStep(0, [], [], ChoiceEnd("error", error="too long", rejected=True))])[-1]
    assert refused["response"]["error"] == {"code": "invalid_prompt", "message": "too long"}  # the client's fault


def test_an_item_whose_channel_closed_before_the_cut_is_complete():
    """The cut falls after `</think>` (or after a call's opener), in structure no item holds: the reasoning (or
    message) item ended normally; only the response is incomplete, in the stream and in the final response."""
    for text, close in ((ReasoningDelta("hm"), Dropped("</think>", "reasoning close")),
                        (ContentDelta("Checking."), Dropped("<tool_call>", "tool call open"))):
        closed = [text, close, Dropped("\n", "template whitespace")]
        for events, status in ((closed, "completed"), ([text], "incomplete")):
            out = _encode([ChoiceStep(0, [TokenInfo(1)] * len(events), events, ChoiceEnd("length"),
                                      finish_at=len(events))])
            [done] = [e for e in out if e["type"] == "response.output_item.done"]
            assert done["item"]["status"] == out[-1]["response"]["output"][0]["status"] == status
            assert out[-1]["type"] == "response.incomplete"


def test_a_background_response_is_queued_until_its_first_step():
    enc = ResponseEncoder(dict(HEAD), lambda t: b"x", input_tokens=3, queued=True)
    start = enc.start()
    assert [(e["type"], e["response"]["status"]) for e in start] == [("response.created", "queued"),
                                                                     ("response.queued", "queued")]
    assert enc.response()["status"] == "queued"
    first = enc.events(ChoiceStep(0, [TokenInfo(1)], [ContentDelta("a")]))
    assert (first[0]["type"], first[0]["response"]["status"]) == ("response.in_progress", "in_progress")
    assert [e["sequence_number"] for e in start + first] == list(range(len(start + first)))
