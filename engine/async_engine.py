"""The in-process `EngineClient`: the `Engine` step loop runs in one background thread of this process; callers get
per-request async iterators of `RequestOutput`.

The thread sleeps on a condition when there is nothing to do (no busy spin). `add`/`abort` travel to it through a
command queue, so the `Engine` is only ever touched by that thread. Each step's outputs reach each event loop in one
callback; per request they land in an `OutputStream`, which merges what a lagging consumer has not taken yet.
Closing or cancelling a `generate` iterator (a client that disconnects) aborts its request, which frees its KV
blocks. A step that raises ends the requests it carried with finish_reason "error"; the loop keeps running.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections import defaultdict, deque
from typing import Any, AsyncIterator

from ember.engine.client import EngineDeadError, ModelInfo, OutputStream, apply_lora_update, settle
from ember.engine.engine import Engine, EngineStats
from ember.engine.params import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class EngineShutdown(EngineDeadError):
    """The engine stopped while a request was in flight or was being added."""


class StepClock:
    """Mean wall time of the recent engine steps that ran a forward."""

    def __init__(self, window: int = 256) -> None:
        self._times: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self._times.append(seconds)

    @property
    def mean_ms(self) -> float:
        return 1e3 * sum(self._times) / len(self._times) if self._times else 0.0


class AsyncEngine:
    """Thread-backed async wrapper around one `Engine` (an `EngineClient`)."""

    def __init__(self, engine: Engine, model_info: ModelInfo | None = None, constraints: Any = None) -> None:
        from ember.engine.launch import model_info_of

        self.engine = engine
        self.model_info: ModelInfo = model_info if model_info is not None else model_info_of(engine)
        self._constraints = constraints  # a ConstraintBackend turning specs into Constraints, or None
        self._clock = StepClock()
        self._cond = threading.Condition()
        self._commands: deque[tuple[Any, ...]] = deque()
        self._streams: dict[str, OutputStream] = {}
        self._stopped = False
        self._death: str | None = None  # why the loop stopped on its own (a dead tensor-parallel worker)
        self._thread = threading.Thread(target=self._run, name="ember-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, **options: Any) -> "AsyncEngine":
        """`Engine.from_pretrained` with the same options, wrapped."""
        return cls(Engine.from_pretrained(model_dir, **options))

    @classmethod
    def from_args(cls, model_dir: str | os.PathLike, args: Any, constraints: Any = None) -> "AsyncEngine":
        """The engine `EngineArgs` describe, in this process; ``constraints`` is a `ConstraintBackend` or None."""
        from ember.engine.launch import build_engine

        engine, info = build_engine(model_dir, args, constraints)
        return cls(engine, info, constraints)

    # ---- EngineClient ------------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, constraint: Any = None) -> AsyncIterator[RequestOutput]:
        """Each step's output for this request (merged when the consumer lags), the last one with ``finished`` set.

        Raises ValueError (before the first output) when the request is invalid.
        """
        loop = asyncio.get_running_loop()
        rid = request_id if request_id is not None else uuid.uuid4().hex
        stream = OutputStream(loop)
        added = loop.create_future()
        finished = False
        self._submit(("add", rid, list(prompt_ids), params or SamplingParams(), constraint, stream, added))
        try:
            await asyncio.shield(added)  # refused (a duplicate ID...): nothing of ours to abort
        except asyncio.CancelledError:  # abort it once added, never another request of the same ID
            added.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or self.abort(rid))
            raise
        try:
            while True:
                item = await stream.get()  # a failure (engine gone, refused) leaves nothing to abort
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its iterator then ends with finish_reason "abort"."""
        self._submit(("abort", request_id))

    async def update_lora(self, name: str, path: str | None) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._submit(("lora", name, path, loop, done))
        adapters = await done
        self.model_info = dataclasses.replace(self.model_info, lora_adapters=adapters)

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.engine.stats(), step_ms=self._clock.mean_ms)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    @property
    def death_reason(self) -> str | None:
        return self._death

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop thread (which then shuts the engine down, stopping any tensor-parallel workers); requests
        still in flight end with `EngineShutdown`."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self.is_alive()

    # ---- the loop thread ---------------------------------------------------------------------------------------

    def _submit(self, cmd: tuple[Any, ...]) -> None:
        with self._cond:
            if self._stopped:
                if cmd[0] == "add":
                    stream, fut = cmd[5], cmd[6]
                    stream.loop.call_soon_threadsafe(settle, fut, EngineShutdown("the engine is shut down"))
                elif cmd[0] == "lora":
                    cmd[3].call_soon_threadsafe(settle, cmd[4], EngineShutdown("the engine is shut down"))
                return
            self._commands.append(cmd)
            self._cond.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """One callback per event loop per step, carrying that loop's outputs."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput]]] = defaultdict(list)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop[stream.loop].append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is closed
                pass

    def _apply(self, cmd: tuple[Any, ...]) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, constraint, stream, fut = cmd
            try:
                if constraint is not None and self._constraints is not None and not hasattr(constraint,
                                                                                            "fill_bitmask"):
                    constraint = self._constraints.build(constraint)
                self.engine.add_request(prompt, params, request_id=rid, constraint=constraint)
            except Exception as e:
                stream.loop.call_soon_threadsafe(settle, fut, e)
                return
            self._streams[rid] = stream
            stream.loop.call_soon_threadsafe(settle, fut, None)
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
        elif cmd[0] == "lora":
            _, name, path, loop, fut = cmd
            try:
                adapters = apply_lora_update(self.engine, name, path)
            except ValueError as e:
                loop.call_soon_threadsafe(settle, fut, e)
                return
            except Exception as e:  # an adapter the checks did not foresee fails its call, never the engine
                log.exception("LoRA update %r failed", name)
                loop.call_soon_threadsafe(settle, fut, ValueError(f"LoRA adapter {name!r}: {type(e).__name__}: {e}"))
                return
            loop.call_soon_threadsafe(settle, fut, None, adapters)

    def _run(self) -> None:
        # with tensor-parallel workers, an idle loop still looks for one that died every second
        idle_wait = 1.0 if getattr(self.engine.runner, "dead_worker", None) is not None else None
        while True:
            with self._cond:
                while not self._stopped and not self._commands and not self.engine.has_unfinished():
                    if not self._cond.wait(idle_wait) and self._group_broken([]):
                        break
                if self._stopped:
                    break
                commands = list(self._commands)
                self._commands.clear()
            outputs: list[RequestOutput] = []
            try:
                for cmd in commands:
                    self._apply(cmd)
                if self.engine.has_unfinished():
                    t0, n0 = time.perf_counter(), self.engine.num_steps
                    outputs = self.engine.step()
                    if self.engine.num_steps != n0:
                        self._clock.add(time.perf_counter() - t0)
            except Exception as e:  # a bug outside the forward: fail what is in flight, keep serving
                log.exception("engine loop error")
                try:
                    outputs = self.engine.fail_all(f"engine error: {type(e).__name__}: {e}")
                except Exception:
                    log.exception("could not fail the in-flight requests")
            failed = any(o.finish_reason == "error" and not o.rejected for o in outputs)
            if failed and self._group_broken(outputs, wait=self.engine.failed_step_wait_s):
                break
            self._deliver(outputs)
        self._close_streams()
        try:  # the loop thread owns the engine, so it is the one to stop tensor-parallel workers
            self.engine.shutdown()
        except Exception:
            log.exception("engine shutdown failed")

    def _group_broken(self, outputs: list[RequestOutput], wait: float = 0.0) -> bool:
        """True once a tensor-parallel worker has died (`Engine.broken_group`): every request then ends with an
        error naming it, the engine is dead (`death_reason`, so the server answers 503 and stops) and the loop must
        stop: the group cannot run another step."""
        broken = self.engine.broken_group(outputs, wait)
        if broken is None:
            return False
        self._death, ended = broken
        log.error("%s", self._death)
        self._deliver(ended)
        with self._cond:
            self._stopped = True
        return True

    def _close_streams(self) -> None:
        with self._cond:
            leftover = list(self._commands)
            self._commands.clear()
        for cmd in leftover:
            if cmd[0] == "add":
                cmd[5].loop.call_soon_threadsafe(settle, cmd[6], EngineShutdown("the engine is shut down"))
        for stream in self._streams.values():
            try:
                stream.loop.call_soon_threadsafe(stream.fail, EngineShutdown("the engine shut down"))
            except RuntimeError:
                pass
        self._streams.clear()


def _put_all(items: list[tuple[OutputStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put(out)
