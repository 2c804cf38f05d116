"""SSE keep-alive comments fill silences longer than the interval, and only those."""
from __future__ import annotations

import asyncio

from ember.server.sse import KEEPALIVE, with_keepalive


async def _chunks(delays: list[float], closed: list[bool]):
    try:
        for i, d in enumerate(delays):
            await asyncio.sleep(d)
            yield f"data: {i}\n\n"
    finally:
        closed.append(True)


def _collect(delays: list[float], interval: float) -> list[str]:
    async def main() -> list[str]:
        return [x async for x in with_keepalive(_chunks(delays, []), interval)]

    return asyncio.run(main())


def test_a_silence_gets_keepalives_and_chunks_keep_their_order():
    out = _collect([0.0, 0.35, 0.0], interval=0.1)
    data = [x for x in out if x != KEEPALIVE]
    assert data == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    between = out[out.index("data: 0\n\n") + 1:out.index("data: 1\n\n")]
    assert 2 <= len(between) <= 4 and set(between) == {KEEPALIVE}
    assert KEEPALIVE == ": keep-alive\n\n"


def test_no_keepalive_when_chunks_flow_or_when_off():
    assert _collect([0.0] * 5, interval=0.2) == [f"data: {i}\n\n" for i in range(5)]
    assert KEEPALIVE not in _collect([0.0, 0.2], interval=0)


def test_closing_the_stream_closes_the_source():
    async def main() -> list[bool]:
        closed: list[bool] = []
        stream = with_keepalive(_chunks([0.0, 10.0], closed), 0.05)
        assert await anext(stream) == "data: 0\n\n"
        assert await anext(stream) == KEEPALIVE  # the source is now waiting inside its 10 s sleep
        await stream.aclose()
        return closed

    assert asyncio.run(main()) == [True]
