"""The one seam between the HTTP front end and the engine: `EngineClient` and the plain facts of `ModelInfo`.

Two implementations: `ember.engine.async_engine.AsyncEngine` (the engine in a thread of this process: tests, tiny
models, ``--in-process``) and `ember.engine.core_client.ProcessEngineClient` (the engine core in its own process,
the default of ``ember serve``). The server touches the engine only through this interface.

`OutputStream` is the per-request mailbox both use: it holds at most one pending `RequestOutput`; outputs that
arrive while the consumer lags are merged into it (token lists concatenated), so a slow client costs one item of
memory per step it is behind, never a queue entry per token.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, runtime_checkable

from ember.engine.config import SettingError as SettingError  # the front end's way to it: start-up argument errors
from ember.engine.params import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from ember.engine.engine import EngineStats


class EngineDeadError(RuntimeError):
    """The engine stopped (shut down or its process died) while a request was in flight or being added."""


class UnknownAdapterError(ValueError):
    """A request names a LoRA adapter that is not loaded (one unloaded while the request was prepared, too). Its
    message starts with `MESSAGE_START`, which survives the engine process's boundary where the type does not."""

    MESSAGE_START = "unknown LoRA adapter "

    def __init__(self, name: str, loaded: list[str]) -> None:
        super().__init__(f"{self.MESSAGE_START}{name!r} (loaded: {', '.join(loaded) or 'none'})")


@dataclass(frozen=True)
class ModelInfo:
    """What the front end may know about the served model and the engine's capacity (plain, picklable data)."""

    model_dir: str
    tokenizer_path: str
    model_type: str | None
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]  # end-of-turn / stop IDs from `ember.engine.eos.end_of_turn_ids`
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    tensor_parallel_size: int
    kv_cache_dtype: str
    load_seconds: float
    num_params: int
    labels: tuple[str, ...] = ()  # a classifier's class names, in logit order (empty: the model generates)
    label_activation: str = ""  # a classifier's "softmax" or "sigmoid" (`ember.engine.models.classifier.activation`)
    score_activation: str = "sigmoid"  # a cross-encoder's score of its logit (`classifier.score_activation`)
    joins_pairs: bool = False  # a cross-encoder reads a text pair joined into one text (vLLM's use_pad_token: false)
    encoder: bool = False  # a bidirectional encoder (BERT, XLM-RoBERTa): generates nothing; pools [CLS] by default
    lora_adapters: tuple[tuple[str, str], ...] = ()  # (name, folder) of each LoRA adapter requests may name
    max_prompt_tokens: int | None = None  # the longest prompt one step prefills whole (chunked prefill off)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


@runtime_checkable
class EngineClient(Protocol):
    """An engine as the server sees it."""

    model_info: ModelInfo

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None, request_id: str | None = None,
                 constraint: Any = None) -> AsyncIterator[RequestOutput]:
        """Per-step outputs of one request, the last with ``finished`` set (an async generator). ``constraint`` is a
        plain-data spec (a `ember.grammar.GrammarPlan`) the engine side turns into its Constraint. Raises ValueError
        before the first output when the engine refuses the request, `EngineDeadError` when the engine is gone.
        Closing the iterator early aborts the request (its KV blocks are freed)."""
        ...

    def abort(self, request_id: str) -> None:
        """End a request now (thread-safe, idempotent)."""
        ...

    async def update_lora(self, name: str, path: str | None) -> None:
        """Load LoRA adapter ``name`` from ``path`` (replacing one loaded under that name; ``path`` None: unload it)
        between two engine steps, then list the adapters in ``model_info``; ValueError naming why the engine
        refused."""
        ...

    def stats(self) -> "EngineStats":
        """The engine's latest counters (cheap; never waits on the engine loop)."""
        ...

    def is_alive(self) -> bool:
        """False once the engine stopped or died."""
        ...

    def shutdown(self) -> None:
        """Stop the engine; requests in flight end with `EngineDeadError`."""
        ...


def settle(fut: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
    """Finish ``fut`` (on its loop) with ``error`` or ``result``, unless it is done already (a cancelled caller)."""
    if fut.done():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


def apply_lora_update(engine: Any, name: str, path: str | None) -> tuple[tuple[str, str], ...]:
    """What every `EngineClient.update_lora` runs next to the engine (between steps): load, unload, or replace an
    adapter loaded under ``name`` (vLLM's ``load_inplace``: refused while requests run under it, and the old
    weights stay when the new ones fail to load, even from the same folder rewritten), then the adapters now
    served."""
    if path is None:
        engine.unload_lora(name)
    else:
        engine.load_lora(name, path, replace=engine.lora is not None and name in engine.lora.adapters)
    return engine.lora.listed()


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One output carrying ``old``'s tokens then ``new``'s, with ``new``'s status (the coalescing of a lagging
    stream). ``old``'s lists are extended in place, so coalescing N outputs costs O(N): the caller owns them."""
    if new.new_token_ids:  # steps that carried tokens (a prompt-logprobs chunk's output carries none)
        old.steps = old.steps + new.steps if old.new_token_ids else new.steps
    old.new_token_ids.extend(new.new_token_ids)
    if new.logprobs is not None:
        if old.logprobs is None:
            old.logprobs = []
        old.logprobs.extend(new.logprobs)
    for name in ("finished", "finish_reason", "stop_token_id", "error", "num_prompt_tokens", "num_cached_tokens",
                 "embedding", "rejected"):
        setattr(old, name, getattr(new, name))
    for name in ("queue_seconds", "scheduled_at", "prompt_logprobs"):  # first-output facts: the first that had them
        if getattr(old, name) is None:
            setattr(old, name, getattr(new, name))
    return old


class OutputStream:
    """A single-consumer mailbox of `RequestOutput`s living on one event loop; `put` never blocks and coalesces."""

    __slots__ = ("loop", "_pending", "_owned", "_error", "_waiter", "puts")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: RequestOutput | None = None
        self._owned = False  # whether `_pending`'s lists are this stream's own copies (merged into in place)
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self.puts = 0

    def put(self, out: RequestOutput) -> None:
        """Deliver (on the stream's loop). Nothing follows a finished output (a local abort that crossed the
        engine's own end keeps that end)."""
        if self._pending is not None and self._pending.finished:
            return
        self.puts += 1
        if self._pending is None:
            self._pending, self._owned = out, False
        else:
            if not self._owned:
                p = self._pending
                p.new_token_ids = list(p.new_token_ids)
                p.logprobs = None if p.logprobs is None else list(p.logprobs)
                self._owned = True
            merge_outputs(self._pending, out)
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    @property
    def pending(self) -> RequestOutput | None:
        return self._pending

    async def get(self) -> RequestOutput:
        """Everything delivered since the last `get`, merged into one output; raises a failure once drained."""
        while self._pending is None:
            if self._error is not None:
                raise self._error
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out, self._pending = self._pending, None
        return out
