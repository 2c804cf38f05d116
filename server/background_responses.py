"""Background responses (`background: true` on `/v1/responses`): the request runs as a server task after the create
call has answered, with the response `queued` (or, asked with `stream: true`, with its event stream, which a client
may leave and join again: the generation goes on either way).

While it runs, `GET /v1/responses/{id}` shows it as it stands (`queued` until its first token, then `in_progress`
with the items closed so far) and `GET /v1/responses/{id}?stream=true&starting_after=N` streams its events after
sequence number N, the ones already sent and then the new ones as they come; `POST /v1/responses/{id}/cancel`
stops it (the engine request is aborted, its slot and KV blocks freed) and leaves it `cancelled`. However it ends,
its final response goes to the response store, with its events for later replays.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from .choice import ChoiceEnd, ChoiceStep
from .responses_encoder import ResponseEncoder

log = logging.getLogger("ember.server")


@dataclass
class BackgroundResponse:
    """One running background response: its encoder (the response so far), every event it has produced, and the
    task that feeds them."""

    encoder: ResponseEncoder
    input_items: list[dict[str, Any]] = field(default_factory=list)  # as `GET .../input_items` lists them
    task: asyncio.Task | None = None
    cancelled: bool = False
    done: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) when events grow or it ends

    def view(self) -> dict[str, Any]:
        body = self.encoder.response()  # `queued` until its first step
        if self.cancelled:
            body["status"] = "cancelled"
        return body

    def _publish(self, events: list[dict[str, Any]]) -> None:
        self.events += events
        self.changed.set()
        self.changed = asyncio.Event()


async def follow(bg: BackgroundResponse, after: int) -> AsyncIterator[dict[str, Any]]:
    """``bg``'s events after sequence number ``after``: those produced so far, then each new one, until it ends."""
    i = max(0, after + 1)
    while True:
        while i < len(bg.events):
            yield bg.events[i]
            i += 1
        if bg.done:
            return
        await bg.changed.wait()


class BackgroundResponses:
    """The background responses still running, by response ID."""

    def __init__(self) -> None:
        self._running: dict[str, BackgroundResponse] = {}

    def __len__(self) -> int:
        return len(self._running)

    def get(self, response_id: str) -> BackgroundResponse | None:
        return self._running.get(response_id)

    def start(self, response_id: str, encoder: ResponseEncoder, steps: AsyncIterator[ChoiceStep],
              finish: Callable[[dict[str, Any], list[dict[str, Any]]], None],
              input_items: list[dict[str, Any]]) -> BackgroundResponse:
        """Run ``steps`` through ``encoder`` in a task; ``finish`` gets the final response (completed, incomplete,
        failed or cancelled) and its events."""
        bg = BackgroundResponse(encoder, input_items)
        bg._publish(encoder.start())
        self._running[response_id] = bg
        bg.task = asyncio.create_task(self._run(response_id, bg, steps, finish))
        return bg

    async def _run(self, response_id: str, bg: BackgroundResponse, steps: AsyncIterator[ChoiceStep],
                   finish: Callable[[dict[str, Any], list[dict[str, Any]]], None]) -> None:
        try:
            async with aclosing(steps) as it:  # closing aborts the engine request
                async for step in it:
                    events = bg.encoder.events(step)
                    if events:
                        bg._publish(events)
        except asyncio.CancelledError:
            bg.cancelled = True
        except Exception as e:  # the engine died, or a bug: the poller sees a failed response, not a hang
            log.exception("background response %s failed", response_id)
            bg._publish(bg.encoder.finish(ChoiceEnd("error", error=f"generation failed: {type(e).__name__}: {e}")))
        finally:
            self._running.pop(response_id, None)
            bg.done = True
            bg._publish([])
        try:
            finish(bg.view(), bg.events)
        except Exception:  # nothing awaits this task: say why the response was not stored
            log.exception("background response %s could not be stored", response_id)

    async def cancel(self, response_id: str) -> dict[str, Any] | None:
        """Stop a running background response and wait until it is stored; its final response, or None when it is
        not running (any more)."""
        bg = self._running.get(response_id)
        if bg is None or bg.task is None:
            return None
        bg.task.cancel()
        await asyncio.gather(bg.task, return_exceptions=True)
        return bg.view()

    async def cancel_all(self) -> None:
        """Stop every running background response (the server is shutting down)."""
        for response_id in list(self._running):
            await self.cancel(response_id)
