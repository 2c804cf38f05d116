"""The SSE response: keep-alive comments fill silences longer than the interval, and only those; one body message
per stream item; the stream is closed when the client goes away."""
from __future__ import annotations

import asyncio

from ember.server.sse import KEEPALIVE, RAW_SEND, EventStreamResponse


async def _chunks(delays: list[float], closed: list[bool]):
    try:
        for i, d in enumerate(delays):
            await asyncio.sleep(d)
            yield f"data: {i}\n\n"
    finally:
        closed.append(True)


async def _never() -> dict:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def _run(delays: list[float], interval: float, raw: bool = True) -> tuple[list[dict], list[dict]]:
    """(messages through the route's send, body messages through the raw send) of one response."""
    routed: list[dict] = []
    direct: list[dict] = []

    async def send(m: dict) -> None:
        routed.append(m)

    async def raw_send(m: dict) -> None:
        direct.append(m)

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    if raw:
        scope[RAW_SEND] = raw_send
    asyncio.run(EventStreamResponse(_chunks(delays, []), interval)(scope, _never, send))
    return routed, direct


def _bodies(messages: list[dict]) -> list[str]:
    return [m["body"].decode() for m in messages if m["type"] == "http.response.body" and m["body"]]


def test_a_silence_gets_keepalives_and_chunks_keep_their_order():
    _, direct = _run([0.0, 0.35, 0.0], interval=0.1)
    out = _bodies(direct)
    assert [x for x in out if x != KEEPALIVE] == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    between = out[out.index("data: 0\n\n") + 1:out.index("data: 1\n\n")]
    assert 2 <= len(between) <= 4 and set(between) == {KEEPALIVE}
    assert KEEPALIVE == ": keep-alive\n\n"


def test_no_keepalive_when_chunks_flow_or_when_off():
    _, direct = _run([0.0] * 5, interval=0.2)
    assert _bodies(direct) == [f"data: {i}\n\n" for i in range(5)]
    assert KEEPALIVE not in _bodies(_run([0.0, 0.2], interval=0)[1])


def test_start_and_end_pass_the_route_send_bodies_the_raw_one():
    routed, direct = _run([0.0, 0.0], interval=0.5)
    assert [m["type"] for m in routed] == ["http.response.start", "http.response.body"]
    assert routed[0]["status"] == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in routed[0]["headers"]
    assert routed[-1]["more_body"] is False and routed[-1]["body"] == b""
    assert all(m["more_body"] for m in direct) and len(direct) == 2
    routed, direct = _run([0.0, 0.0], interval=0.5, raw=False)  # no raw send in the scope: everything is routed
    assert direct == [] and _bodies(routed) == ["data: 0\n\n", "data: 1\n\n"]


def test_a_cancelled_response_closes_the_source():
    async def main() -> tuple[list[bool], list[str]]:
        closed: list[bool] = []
        sent: list[dict] = []

        async def send(m: dict) -> None:
            sent.append(m)

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        task = asyncio.ensure_future(EventStreamResponse(_chunks([0.0, 10.0], closed), 0.05)(scope, _never, send))
        await asyncio.sleep(0.2)  # the first chunk and a keep-alive or more; the source waits in its 10 s sleep
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return closed, _bodies(sent)

    closed, bodies = asyncio.run(main())
    assert closed == [True]
    assert bodies[0] == "data: 0\n\n" and KEEPALIVE in bodies[1:]
