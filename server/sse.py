"""Server-sent-event responses: one body message per item of the stream (a step's events joined into one item), and
a comment line after every `interval` seconds without one (a long prefill, a long thought whose tokens are
withheld), which SSE clients ignore and proxies count as traffic.

This sits on every streamed token's path, so it is lean: the body messages skip the middleware chain's send
wrappers (the response start and the final message still pass through it), and the keep-alive is one timer per
interval, not a task or a timer per chunk."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Mapping

from starlette.responses import StreamingResponse

KEEPALIVE = ": keep-alive\n\n"
RAW_SEND = "ember.raw_send"
"""Scope key of the ASGI `send` outside the per-route wrappers (set by the outermost middleware of ours)."""


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` of `chunks` (str, one body message each), plus `KEEPALIVE` after each `interval` seconds
    in which no chunk was sent (never when `interval` <= 0). The stream is closed when the response ends, also when
    the client went away."""

    def __init__(self, chunks: AsyncIterator[str], interval: float, headers: Mapping[str, str] | None = None):
        super().__init__(chunks, media_type="text/event-stream", headers=headers)
        self.interval = interval
        self._body_send: Any = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self._body_send = scope.get(RAW_SEND)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = self._body_send or send
        keepalive = _KeepAlive(body, self.interval) if self.interval > 0 else None
        it = self.body_iterator
        try:
            async for chunk in it:
                if keepalive is not None:
                    keepalive.last = keepalive.loop.time()
                await body({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        finally:
            if keepalive is not None:
                keepalive.stop()
            await _aclose(it)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _KeepAlive:
    """Sends `KEEPALIVE` from a timer when `last` (the latest chunk's loop time) is `interval` seconds old."""

    def __init__(self, send: Any, interval: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.send = send
        self.interval = interval
        self.last = self.loop.time()
        self.closed = False
        self.task: asyncio.Task | None = None
        self.timer = self.loop.call_at(self.last + interval, self._tick)

    def _tick(self) -> None:
        if self.closed:
            return
        now = self.loop.time()
        due = self.last + self.interval
        if now + 1e-3 >= due:  # timers may fire up to the clock's resolution early
            self.last = now
            due = now + self.interval
            if self.task is None or self.task.done():
                self.task = self.loop.create_task(self._send())
        self.timer = self.loop.call_at(due, self._tick)

    async def _send(self) -> None:
        if self.closed:
            return
        try:
            await self.send({"type": "http.response.body", "body": KEEPALIVE.encode(), "more_body": True})
        except Exception:  # the client went away: the stream's own send notices
            pass

    def stop(self) -> None:
        self.closed = True
        self.timer.cancel()


async def _aclose(it: AsyncIterator[str]) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()
