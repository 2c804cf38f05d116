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
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                pending = None
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await _aclose(it)


async def _aclose(it: AsyncIterator[str]) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()
