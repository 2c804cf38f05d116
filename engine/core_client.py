"""`ProcessEngineClient`: the `EngineClient` whose engine core runs in a child process (`ember.engine.core_process`).

One receiver thread polls the events socket and the child's process sentinel together: each step message is decoded
once and handed to each event loop in one callback, which puts every request's output into its `OutputStream`
(merging what a lagging consumer has not taken). The child's death is seen at once through the sentinel: every
stream in flight fails with `EngineDeadError`, `is_alive()` turns False and the ``on_death`` callbacks run.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from typing import Any, AsyncIterator, Callable, Iterator

import zmq

from ember.engine import core_process, wire
from ember.engine.args import EngineArgs
from ember.engine.client import EngineDeadError, ModelInfo, OutputStream, SettingError, settle
from ember.engine.engine import EngineStats
from ember.engine.params import RequestOutput, SamplingParams

log = logging.getLogger("ember.engine.client")


class ProcessEngineClient:
    """The engine core in a spawned child process, reached over ZMQ (an `EngineClient`)."""

    def __init__(self, model_dir: str | os.PathLike, args: EngineArgs | None = None,
                 constraint_factory: Callable[[str, str | None], Any] | None = None, *,
                 startup_timeout: float | None = None,
                 log_level: str = "WARNING") -> None:
        import dataclasses

        args = args or EngineArgs()
        self._ctx = zmq.Context()
        base = os.path.join(tempfile.gettempdir(), f"ember-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._addrs = (f"ipc://{base}-cmd", f"ipc://{base}-evt")
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.bind(self._addrs[0])
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.RCVHWM, 0)
        self._events.bind(self._addrs[1])
        self._send_lock = threading.Lock()
        self._streams: dict[str, OutputStream] = {}
        self._streams_lock = threading.Lock()
        self._lora_calls: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._stats: EngineStats | None = None
        self._dead: str | None = None
        self._fatal: str | None = None  # what the engine process reported before it stopped itself
        self._stopping = False
        self.on_death: list[Callable[[str], None]] = []
        self.steps_received = 0
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        self.process = mp.get_context("spawn").Process(
            target=core_process.main, name="ember-engine-core",
            args=(str(model_dir), fields, constraint_factory, self._addrs[0], self._addrs[1], os.getpid(), log_level))
        with _sigint_ignored():  # inherited: Ctrl-C while it starts must not kill its interpreter mid-import
            self.process.start()  # not a daemon: it starts tensor-parallel workers of its own; it exits with its parent
        try:
            self.model_info: ModelInfo = self._wait_ready(startup_timeout)
        except BaseException:
            self._kill()
            self._close_sockets()
            raise
        self._stats = EngineStats(num_running=0, num_waiting=0, kv_usage=0.0,
                                  num_free_blocks=self.model_info.num_kv_blocks,
                                  num_total_blocks=self.model_info.num_kv_blocks, prefix_cache_hit_rate=0.0,
                                  prefix_cache_hits=0, prefix_cache_queries=0, num_preemptions=0, last_batch_size=0)
        self._thread = threading.Thread(target=self._receive, name="ember-engine-receiver", daemon=True)
        self._thread.start()

    # ---- start-up ----------------------------------------------------------------------------------------------

    def _wait_ready(self, timeout: float | None) -> ModelInfo:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._events.poll(100, zmq.POLLIN):
                msg = wire.unpack(self._events.recv())
                if msg[0] == "ready":
                    info = wire.decode_fields(ModelInfo, msg[1])
                    import dataclasses

                    return dataclasses.replace(info, eos_token_ids=tuple(info.eos_token_ids))
                if msg[0] == "fatal":
                    self.process.join(10)
                    if len(msg) > 2 and msg[2] is not None:  # a setting the model or machine cannot take
                        raise SettingError(msg[2], msg[3])
                    raise RuntimeError(f"the engine failed to start: {msg[1]}")
                continue
            if not self.process.is_alive():
                raise EngineDeadError(f"the engine process exited during start-up (exit code "
                                      f"{self.process.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not start within {timeout} s")

    # ---- EngineClient ------------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, constraint: Any = None) -> AsyncIterator[RequestOutput]:
        """Each step's output for this request (merged when the consumer lags), the last with ``finished`` set.

        Raises ValueError (before the first output) when the engine refuses the request, `EngineDeadError` when the
        engine process is gone."""
        rid = request_id if request_id is not None else uuid.uuid4().hex
        stream = OutputStream(asyncio.get_running_loop())
        with self._streams_lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if rid in self._streams:  # the engine would refuse it; its stream must stay the live request's
                raise ValueError(f"request_id {rid!r} is already in the engine")
            self._streams[rid] = stream
        finished = False
        try:
            self._send(["add", rid, [int(t) for t in prompt_ids], wire.encode_params(params or SamplingParams()),
                        constraint])
            while True:
                item = await stream.get()  # a failure (engine gone, refused) leaves nothing to abort
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Drop the request: a consumer still reading its stream gets its end (``finish_reason`` "abort") at once,
        not once the engine process answers, which a long or stalled step would hold back past a shutdown deadline."""
        with self._streams_lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            _call(stream, stream.put, RequestOutput(request_id, [], finished=True, finish_reason="abort"))
        if self._dead is None:
            try:
                self._send(["abort", [request_id]])
            except EngineDeadError:
                pass

    async def update_lora(self, name: str, path: str | None) -> None:
        import dataclasses

        loop = asyncio.get_running_loop()
        token, done = uuid.uuid4().hex, loop.create_future()
        with self._streams_lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            self._lora_calls[token] = (loop, done)
        try:
            self._send(["lora", token, name, path])
            adapters = await done
        finally:
            with self._streams_lock:
                self._lora_calls.pop(token, None)
        self.model_info = dataclasses.replace(self.model_info, lora_adapters=tuple(map(tuple, adapters)))

    def stats(self) -> EngineStats:
        """The counters the engine sent with its latest step."""
        return self._stats  # type: ignore[return-value]

    def is_alive(self) -> bool:
        return self._dead is None and not self._stopping

    @property
    def is_running(self) -> bool:
        return self.is_alive()

    @property
    def death_reason(self) -> str | None:
        return self._dead

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine process to stop, wait for it (killing it after ``timeout``), fail what is in flight."""
        if self._stopping:
            return
        self._stopping = True
        if self._dead is None:
            try:
                self._send(["shutdown"])
            except EngineDeadError:
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("the engine process did not stop in %.0f s; killing it", timeout)
            self._kill()
        self._thread.join(5)
        self._fail_all("the engine is shut down")
        self._close_sockets()

    # ---- internals ---------------------------------------------------------------------------------------------

    def _send(self, msg: list) -> None:
        """Queue ``msg`` for the engine process without waiting; EngineDeadError once it is gone, even before the
        receiver has seen it die (a PUSH socket with no peer would block the sender forever)."""
        data = wire.pack(msg)
        with self._send_lock:
            if self._dead is not None or self._commands.closed:
                raise EngineDeadError(self._dead or "the engine is shut down")
            try:
                self._commands.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # no high-water mark: only an engine no longer connected refuses a message
                raise EngineDeadError(self._dead or "the engine process is gone") from None

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._events, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        sock = self._events
        while True:
            ready = dict(poller.poll(1000))
            if sock in ready:
                while True:
                    try:
                        data = sock.recv(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    self._dispatch(wire.unpack(data))
                continue
            if self.process.sentinel in ready or not self.process.is_alive():
                while sock.poll(0, zmq.POLLIN):  # the last messages it sent
                    self._dispatch(wire.unpack(sock.recv()))
                if self._stopping:
                    return
                self.process.join(1)
                reason = f"the engine process died (exit code {self.process.exitcode})"
                if self._fatal is not None:
                    reason += f": {self._fatal}"
                log.error("%s; failing every request in flight", reason)
                self._dead = reason
                self._fail_all(reason)
                for cb in list(self.on_death):
                    try:
                        cb(reason)
                    except Exception:
                        log.exception("on_death callback failed")
                return

    def _dispatch(self, msg: list) -> None:
        kind = msg[0]
        if kind == "step":
            self.steps_received += 1
            self._stats = wire.decode_fields(EngineStats, msg[2])
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput]]] = defaultdict(list)
            with self._streams_lock:
                streams = self._streams
                for values in msg[1]:
                    stream = streams.get(values[0])
                    if stream is not None:
                        by_loop[stream.loop].append((stream, wire.decode_output(values)))
            for loop, items in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_put_all, items)
                except RuntimeError:  # that event loop is closed
                    pass
        elif kind == "reject":
            with self._streams_lock:
                stream = self._streams.get(msg[1])
            if stream is not None:
                _call(stream, stream.fail, ValueError(msg[2]))
        elif kind == "lora":
            with self._streams_lock:
                call = self._lora_calls.get(msg[1])
            if call is not None:
                loop, fut = call
                error = None if msg[2] is None else ValueError(msg[2])
                loop.call_soon_threadsafe(settle, fut, error, msg[3])
        elif kind == "fatal":  # the engine process stops: dead to new requests (and /health) from now on
            self._fatal = msg[1]
            log.error("engine process: %s", msg[1])
            with self._streams_lock:
                self._dead = self._dead or f"the engine process is stopping: {msg[1]}"

    def _fail_all(self, reason: str) -> None:
        with self._streams_lock:
            streams = list(self._streams.values())
            calls = list(self._lora_calls.values())
        for s in streams:
            _call(s, s.fail, EngineDeadError(reason))
        for loop, fut in calls:
            try:
                loop.call_soon_threadsafe(settle, fut, EngineDeadError(reason), None)
            except RuntimeError:  # that event loop is closed
                pass

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def _close_sockets(self) -> None:
        with self._send_lock:
            self._commands.close(linger=0)
        self._events.close(linger=0)
        self._ctx.term()
        for addr in self._addrs:
            try:
                os.unlink(addr.removeprefix("ipc://"))
            except OSError:
                pass


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored in this process while the block runs (from the main thread only, where handlers live); a
    process spawned meanwhile starts with it ignored, before its own code could ignore it (an ignored disposition is
    the only one that survives exec: a blocked mask does not). A Ctrl-C in these few milliseconds is lost; the next
    one stops the start."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _call(stream: OutputStream, fn: Callable[..., None], *args: Any) -> None:
    try:
        stream.loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _put_all(items: list[tuple[OutputStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put(out)
