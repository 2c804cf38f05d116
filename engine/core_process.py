"""The engine core in its own process: it owns the `Engine` and its step loop, and talks to the front end over two
ZMQ sockets (format: `ember.engine.wire`).

The loop never waits on the front end: commands are drained without blocking between steps, each step's outputs
leave as one message on a send queue with no high-water mark, and the loop only blocks (on the command socket) when
it has nothing to run. Constraint specs are turned into Constraints on a helper thread, so compiling a new grammar
never stalls the steps of other requests. The process exits when told to, when its parent dies, or on a fatal error
(reported as a ``fatal`` event first), such as a tensor-parallel worker's death.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ember.engine import wire
from ember.engine.client import apply_lora_update
from ember.engine.params import RequestOutput

log = logging.getLogger("ember.engine.core")

_IDLE_POLL_MS = 500


def main(model_dir: str, args_fields: dict[str, Any], constraint_factory: Any, commands_addr: str,
         events_addr: str, parent: int, log_level: str = "WARNING") -> None:
    """Process entry point (spawned by `ProcessEngineClient`, whose process ID is ``parent``: read here, after the
    imports, a front end that died meanwhile would read as init, and this process would outlive it). SIGINT is
    ignored: Ctrl-C reaches the whole process group, and the front end stops the engine itself once its own
    shutdown has drained the requests in flight."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    events = ctx.socket(zmq.PUSH)
    events.setsockopt(zmq.SNDHWM, 0)
    events.setsockopt(zmq.LINGER, 1000)
    events.connect(events_addr)
    commands = ctx.socket(zmq.PULL)
    commands.setsockopt(zmq.RCVHWM, 0)
    commands.connect(commands_addr)
    try:
        core = _Core(model_dir, args_fields, constraint_factory, events)
    except BaseException as e:
        events.send(wire.pack(["fatal", f"{type(e).__name__}: {e}", getattr(e, "flag", None), str(e)]))
        log.debug("engine start-up failed:\n%s", traceback.format_exc())
        _close(ctx, events, commands)
        logging.shutdown()
        sys.stderr.flush()
        # a failed build has reaped what it started: the interpreter's teardown (seconds, with torch loaded) would
        # only hold back the front end's error line, which waits for this process to exit
        os._exit(1)
    try:
        core.run(commands, parent)
    finally:
        core.close()
        _close(ctx, events, commands)
        if os.getppid() != parent:  # the front end died (SIGKILL) without removing its socket files
            for addr in (commands_addr, events_addr):
                with contextlib.suppress(OSError):
                    os.unlink(addr.removeprefix("ipc://"))
    # closed, its workers reaped: exit at once, so the front end sees the engine gone (a fatal error) or finishes its
    # shutdown (the interpreter's teardown, seconds with torch loaded, held it past docker stop's grace)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(1 if core.fatal is not None else 0)


def _close(ctx: Any, events: Any, commands: Any) -> None:
    """Close both sockets, then the context: `term` blocks for as long as any socket of it is open. The events
    socket lingers (up to its LINGER) so the last message still reaches the front end."""
    events.close()
    commands.close(linger=0)
    ctx.term()


class _Core:
    def __init__(self, model_dir: str, args_fields: dict[str, Any], constraint_factory: Any, events: Any) -> None:
        from ember.engine.args import EngineArgs
        from ember.engine.async_engine import StepClock
        from ember.engine.launch import build_engine

        args = EngineArgs(**args_fields)
        args.apply_threads()
        self.constraints = constraint_factory(model_dir, args.tokenizer) if constraint_factory is not None else None
        self.engine, info = build_engine(model_dir, args, self.constraints)
        self.events = events
        self.clock = StepClock()
        self.builder: ThreadPoolExecutor | None = None
        self.building: dict[str, tuple[Future, list, Any]] = {}
        self.stopping = False
        self.fatal: str | None = None
        events.send(wire.pack(["ready", wire.encode_fields(info)]))

    def run(self, commands: Any, parent: int) -> None:
        import zmq

        engine = self.engine
        last_parent_check = time.monotonic()
        while not self.stopping:
            busy = engine.has_unfinished()
            if not busy:
                timeout = 5 if self.building else _IDLE_POLL_MS
                if not commands.poll(timeout, zmq.POLLIN):
                    self._adopt_built()
                    if os.getppid() != parent:
                        log.warning("the front-end process is gone; the engine core exits")
                        return
                    if self._group_broken([]):
                        return
                    continue
            while True:  # drain every queued command, never waiting
                try:
                    msg = commands.recv(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                self._apply(wire.unpack(msg))
            if self.building:
                self._adopt_built()
            if self.stopping:
                return
            if engine.has_unfinished():
                t0, n0 = time.perf_counter(), engine.num_steps
                try:
                    outputs = engine.step()
                except Exception as e:  # outside the forward (the engine catches those): fail what is in flight
                    log.exception("engine loop error")
                    outputs = engine.fail_all(f"engine error: {type(e).__name__}: {e}")
                if engine.num_steps != n0:
                    self.clock.add(time.perf_counter() - t0)
                # a worker that died breaks the step's collectives; its exit may trail the broken connection
                failed = any(o.finish_reason == "error" and not o.rejected for o in outputs)
                if failed and self._group_broken(outputs, wait=self.engine.failed_step_wait_s):
                    return
                if outputs:
                    self._send_step(outputs)
            now = time.monotonic()
            if now - last_parent_check > 1.0:
                last_parent_check = now
                if os.getppid() != parent:
                    log.warning("the front-end process is gone; the engine core exits")
                    return
                if self._group_broken([]):
                    return

    def _group_broken(self, outputs: list[RequestOutput], wait: float = 0.0) -> bool:
        """True once a tensor-parallel worker has died (`Engine.broken_group`): a ``fatal`` event goes first (so the
        front end answers unhealthy and refuses new requests before any client sees its request fail), then every
        request, those that end in ``outputs`` and those still building included, ends with an error naming the
        worker, and the loop must stop (the group cannot run another step)."""
        broken = self.engine.broken_group(outputs, wait)
        if broken is None:
            return False
        self.fatal, ended = broken
        ended += [RequestOutput(rid, [], finished=True, finish_reason="error", error=self.fatal,
                                num_prompt_tokens=len(prompt)) for rid, (_, prompt, _) in self.building.items()]
        self.building.clear()
        self.events.send(wire.pack(["fatal", self.fatal]))
        if ended:
            self._send_step(ended)
        return True

    def _send_step(self, outputs: list) -> None:
        stats = dataclasses.replace(self.engine.stats(), step_ms=self.clock.mean_ms)
        self.events.send(wire.pack(["step", [wire.encode_output(o) for o in outputs], wire.encode_fields(stats)]))

    def _apply(self, msg: list) -> None:
        kind = msg[0]
        if kind == "add":
            _, rid, prompt, params, spec = msg
            if spec is not None and self.constraints is not None:
                if self.builder is None:
                    self.builder = ThreadPoolExecutor(1, thread_name_prefix="ember-constraints")
                self.building[rid] = (self.builder.submit(self.constraints.build, spec), prompt, params)
                return
            if spec is not None:
                self._reject(rid, "structured output is not available on this server")
                return
            self._add(rid, prompt, params, None)
        elif kind == "abort":
            ended = []
            for rid in msg[1]:
                built = self.building.pop(rid, None)
                if built is None:
                    self.engine.abort(rid)
                else:  # its grammar was still compiling: it ends here, as the engine ends an aborted request
                    ended.append(RequestOutput(rid, [], finished=True, finish_reason="abort",
                                               num_prompt_tokens=len(built[1])))
            if ended:
                self._send_step(ended)
        elif kind == "lora":
            _, token, name, path = msg
            try:
                self.events.send(wire.pack(["lora", token, None, apply_lora_update(self.engine, name, path)]))
            except ValueError as e:
                self.events.send(wire.pack(["lora", token, str(e), None]))
            except Exception as e:  # an adapter the checks did not foresee fails its call, never the engine
                log.exception("LoRA update %r failed", name)
                self.events.send(wire.pack(["lora", token, f"LoRA adapter {name!r}: {type(e).__name__}: {e}", None]))
        elif kind == "shutdown":
            self.stopping = True

    def _add(self, rid: str, prompt: list, params: list, constraint: Any) -> None:
        try:
            self.engine.add_request(prompt, wire.decode_params(params), request_id=rid, constraint=constraint)
        except ValueError as e:
            self._reject(rid, str(e))
        except Exception as e:
            log.exception("add_request failed")
            self._reject(rid, f"{type(e).__name__}: {e}")

    def _adopt_built(self) -> None:
        for rid in [r for r, (f, _, _) in self.building.items() if f.done()]:
            fut, prompt, params = self.building.pop(rid)
            try:
                constraint = fut.result()
            except Exception as e:
                self._reject(rid, str(e))
                continue
            self._add(rid, prompt, params, constraint)

    def _reject(self, rid: str, message: str) -> None:
        self.events.send(wire.pack(["reject", rid, message]))

    def close(self) -> None:
        if self.builder is not None:
            self.builder.shutdown(wait=False, cancel_futures=True)
        try:
            self.engine.shutdown()
        except Exception:
            log.exception("engine shutdown failed")
