"""Server-sent-event streams kept open through long silences (a long prefill, a long thought whose tokens are
withheld): a comment line every `interval` seconds without a chunk, which SSE clients ignore and proxies count as
traffic."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

KEEPALIVE = ": keep-alive\n\n"


async def with_keepalive(chunks: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """`chunks` as they come, plus `KEEPALIVE` after each `interval` seconds in which none came (never when
    `interval` <= 0). Closing this stream closes `chunks`."""
    it = aiter(chunks)
    if interval <= 0:
        try:
            async for item in it:
                yield item
        finally:
            await _aclose(it)
        return
    loop = asyncio.get_running_loop()
    slot = _Slot(loop)
    pump = loop.create_task(_pump(it, slot))
    try:
        while True:
            kind, value = await slot.take(interval)
            if kind is _ITEM:
                yield value
            elif kind is _TICK:
                yield KEEPALIVE
            elif kind is _ERROR:
                raise value
            else:
                return
    finally:
        if not pump.done():
            pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)


_ITEM, _TICK, _ERROR, _END = "item", "tick", "error", "end"


class _Slot:
    """A one-item handoff from the pump task to the stream: a chunk costs two futures, not a task and a wait()
    (this sits on every streamed chunk's path)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.item: tuple[str, object] | None = None
        self.taker: asyncio.Future | None = None
        self.giver: asyncio.Future | None = None

    async def give(self, kind: str, value: object) -> None:
        self.item = (kind, value)
        if self.taker is not None and not self.taker.done():
            self.taker.set_result(None)
        self.giver = self.loop.create_future()
        await self.giver  # until the stream took it: never more than one chunk ahead

    async def take(self, timeout: float) -> tuple[str, object]:
        if self.item is None:
            self.taker = self.loop.create_future()
            timer = self.loop.call_later(timeout, _set, self.taker)
            try:
                await self.taker
            finally:
                timer.cancel()
                self.taker = None
            if self.item is None:
                return _TICK, None
        item, self.item = self.item, None
        if self.giver is not None and not self.giver.done():
            self.giver.set_result(None)
        return item


def _set(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def _pump(it: AsyncIterator[str], slot: _Slot) -> None:
    try:
        async for item in it:
            await slot.give(_ITEM, item)
        await slot.give(_END, None)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the stream re-raises it
        await slot.give(_ERROR, e)
    finally:
        await _aclose(it)


async def _aclose(it: AsyncIterator[str]) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()
