"""Asynchronous scheduling: which steps may run ahead of their own tokens, and how the next step reads them.

With ``async_scheduling`` the engine launches step N+1 before it reads step N's sampled tokens, so the host's work
between steps (recording tokens, stop checks, outputs, scheduling, metadata) runs while the device computes instead
of between its steps. A deferred step appends `sequence.PLACEHOLDER` to each sampling sequence, which keeps every count
right (positions, KV slots, ``min_tokens``, seeded draws, penalty counts, the scheduler's lengths) while the value is
unknown; step N+1's input row for that position takes the token on the device (`CarriedTokens`), and the engine
writes the real value over the placeholder when it reads step N, before anything hashes or shows it.

A sequence that step N ends by a stop token is computed once more in step N+1 and that row is dropped; one that
step N ends by length (``max_tokens``, ``max_model_len``) is known to end from the count, so the scheduler leaves
it out of step N+1 and the read finishes it. A grammar needs each token before it masks the next, and bad words
before they ban the next: step N+1 then reads step N after launching its forward and before its sampler
(`reads_before_sampling`), so that work still runs while the device computes. What needs the value of the token
before the next step can be scheduled keeps a step in order (`defer_blocker`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ember.engine.model_runner import CarriedTokens
from ember.engine.sampler import DeferredSample
from ember.engine.scheduler import ScheduledChunk, SchedulerOutput
from ember.engine.sequence import Sequence, SequenceStatus


@dataclass
class InFlightStep:
    """A launched step whose tokens are not read yet: sampler row ``i`` belongs to ``chunks[i]``, whose sequence's
    output token ``at[i]`` is its placeholder."""

    chunks: list[ScheduledChunk]
    at: list[int]
    sample: DeferredSample

    def rows(self) -> dict[Sequence, int]:
        return {c.seq: i for i, c in enumerate(self.chunks)}


def defer_blocker(sched: SchedulerOutput, sampling: list[ScheduledChunk], scores_prompt: bool) -> str | None:
    """Why this step must read its tokens before the next one is scheduled (None: it may run ahead)."""
    if scores_prompt:
        return "prompt rows are scored or pooled"
    for c in sched.chunks:
        p = c.seq.params
        if p.pooling is not None:
            return "a pooling request"
    for c in sampling:
        if c.draft or c.seq.drafter is not None:
            return "speculative decoding drafts from the tokens"
    return None


def carried_tokens(sched: SchedulerOutput, inflight: InFlightStep | None) -> CarriedTokens | None:
    """The input rows of ``sched`` whose tokens ``inflight`` sampled: each such sequence runs as a one-token decode
    of its placeholder."""
    if inflight is None:
        return None
    src = inflight.rows()
    rows, sampled_rows = [], []
    row = 0
    for c in sched.chunks:
        i = src.get(c.seq)
        if i is not None:
            if c.num_tokens != 1 or c.start != c.seq.num_tokens - 1:
                raise RuntimeError(f"request {c.seq.request_id!r}: scheduled at {c.start} for {c.num_tokens} tokens "
                                   f"while its token at {c.seq.num_tokens - 1} is still on the device")
            rows.append(row)
            sampled_rows.append(i)
        row += c.num_tokens
    return CarriedTokens(rows, sampled_rows, inflight.sample.tokens) if rows else None


def reads_before_sampling(chunks: list[ScheduledChunk], inflight: InFlightStep | None) -> bool:
    """Whether a sequence of this step's sampling ``chunks`` whose next token depends on its last has that token in
    ``inflight``: its grammar must accept it before this step's bitmask is filled, or its bad words be matched
    against it before this step bans their last tokens."""
    if inflight is None:
        return False
    src = inflight.rows()
    return any((c.seq.constraint is not None or c.seq.params.bad_words_ids) and c.seq in src for c in chunks)


def still_running(chunks: list[ScheduledChunk], logits: torch.Tensor
                  ) -> tuple[list[ScheduledChunk], torch.Tensor]:
    """The sampling ``chunks`` whose sequences have not finished since they were scheduled, with their logits rows
    (one per sampled position); the same objects when none has."""
    if all(c.seq.status is not SequenceStatus.FINISHED for c in chunks):
        return chunks, logits
    starts = list(itertools.accumulate((1 + len(c.draft) for c in chunks), initial=0))
    keep = [(c, range(a, b)) for c, a, b in zip(chunks, starts, starts[1:])
            if c.seq.status is not SequenceStatus.FINISHED]
    rows = torch.tensor([r for _, span in keep for r in span], dtype=torch.long)
    if logits.is_cuda:  # a pageable upload would wait for the forward queued before it
        rows = rows.pin_memory().to(logits.device, non_blocking=True)
    return [c for c, _ in keep], logits.index_select(0, rows)
