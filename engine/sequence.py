"""One request's state inside the engine: its tokens, how many of them have KV in the cache, and its block table.

A sequence only tracks ``num_computed_tokens`` against its token list (vLLM v1's model): the scheduler hands out
the positions ``num_computed_tokens .. num_tokens-1`` over one or more steps, and a new token is sampled once
every position is computed. Tokens are append-only: the prefix cache keys a sequence's full blocks by their content.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.engine.params import FinishReason, SamplingParams

if TYPE_CHECKING:  # constraint.py imports torch; the scheduling core stays pure Python
    from ember.engine.constraint import Constraint


PLACEHOLDER = -1
"""The output token a step launched ahead of its read (asynchronous scheduling) appends until its value is read."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request in flight. Identity equality: two sequences are the same only if they are the same object."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    constraint: Constraint | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens (from the start of ``all_token_ids``) whose KV is in the cache."""
    block_ids: list[int] = field(default_factory=list)
    """The block table, in order: position ``p`` lives in block ``block_ids[p // block_size]``."""
    block_mirror: tuple | None = field(default=None, repr=False)
    """The model runner's int32 copy of ``block_ids`` and the list it mirrors (`ember.engine.block_rows`)."""
    num_cached_tokens: int = 0
    """Prompt tokens served by the prefix cache at the first admission."""
    arrival: int = -1
    """Admission order, set by ``Scheduler.add``; lower is older."""
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    """Content hashes of this sequence's full blocks (a prefix of them, extended lazily by the KV cache manager)."""
    num_registered_blocks: int = 0
    """Leading entries of ``block_ids`` that are in the prefix cache (hit at admission or registered since)."""
    lora_slot: int = -1
    """The LoRA adapter slot this sequence runs under (`ember.engine.lora`); -1: the base model."""
    cache_root: bytes | None = None
    """The root of this sequence's prefix-cache hashes (None: the base model's); an adapter has its own."""
    state_slot: int = -1
    """The slot of the per-sequence recurrent state (hybrid models) while running; -1 otherwise."""
    output_snapshot: bytes | None = None
    """The key of the latest state snapshot taken inside this sequence's output (recurrent models), replaced as the
    output grows."""
    prompt_logprobs: list | None = field(default_factory=list)
    """`TokenLogprob`s of prompt tokens ``1 .. num_prompt_logprobs`` computed so far (prompt_logprobs); None once
    sent with the first output."""
    num_prompt_logprobs: int = 0
    """Prompt tokens (after the first) whose logprob has been computed."""
    pooled: object | None = None
    """A pooling request's running pool of the hidden states computed so far (`ember.engine.pooling`)."""
    draft: list[int] = field(default_factory=list)
    """Speculative tokens proposed for the next step (`ember.engine.speculative`); the scheduler may take a prefix."""
    drafter: object | None = None
    """The sequence's `ember.engine.speculative.Drafter` when it speculates (None: it never does)."""
    queued_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None
    """`time.monotonic()` when it was added and when a step first scheduled it (its queue time is the difference)."""

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are not computed yet (its prompt must be computed, not cached)."""
        return self.params.prompt_logprobs is not None and self.num_prompt_logprobs < self.num_prompt_tokens - 1

    @property
    def computes_whole_prompt(self) -> bool:
        """The prefix cache must not serve this sequence: prompt logprobs or a pooling over every prompt position
        need each position's hidden state."""
        return self.needs_prompt_logprobs or self.params.pooling in ("mean", "cls")

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without concatenating the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
