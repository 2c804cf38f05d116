"""Continuous batching under a per-step token budget (vLLM v1's scheduling model).

Each step hands out at most ``max_num_batched_tokens`` token positions to at most ``max_num_seqs`` sequences:
running sequences first, oldest first (one decode token each, or the rest of a chunked prefill), then waiting ones
in FIFO order, their prefill chunked to the budget that is left. A waiting request is admitted only when the blocks
for all of its remaining tokens are free (plus a small watermark next to running sequences), so a prefill is not
preempted halfway. When a running sequence needs a block and none is free, the newest running sequence is preempted
by recompute (blocks freed, back to the front of the queue, outputs kept). The oldest request is never preempted for
a newer one, so every request that fits the cache completes.

Under the ``priority`` policy (vLLM's) "oldest" reads "first by ``(SamplingParams.priority, arrival)``": the waiting
queue and the running list are kept in that order, so a lower priority value is admitted first and a running
sequence of the highest value (the newest among equals) is the one preempted.

Each running sequence also holds one of ``max_num_seqs`` state slots (``Sequence.state_slot``), where models with
recurrent layers keep its state; it is taken at admission and given back on finish or preemption. With prefix caching
such models also keep `StateSnapshots`: a prefix hit counts only as far as a saved state reaches (restored into the
slot), and a prompt's prefill chunk ends at its last full-block boundary, where its state is saved.
"""
from __future__ import annotations

import bisect
import functools
from collections import deque
from dataclasses import dataclass, field

from ember.engine import pooling
from ember.engine.kv_cache import KVCacheManager
from ember.engine.params import FinishReason
from ember.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from ember.engine.state_snapshots import StateSnapshots


@dataclass
class ScheduledChunk:
    """Positions ``start .. start+num_tokens-1`` of ``seq`` are computed this step."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool
    """True when the chunk reaches ``seq.num_tokens`` of a generating sequence: a new token is sampled from its last
    position (a pooling request's last chunk samples nothing: the engine finishes it)."""
    draft: tuple[int, ...] = ()
    """Speculative tokens computed after the sequence's last token (``num_tokens`` is one more than their count):
    every position of the chunk is sampled, and the engine keeps the drafts up to the first position whose sampled
    token differs."""

    @functools.cached_property
    def prompt_rows(self) -> tuple[int, int]:
        """``(first position, count)`` of this chunk's positions whose hidden states the step keeps (count 0: none):
        for a pooling request the positions it pools (`ember.engine.pooling.rows`), otherwise those whose logits
        score a prompt token (`ember.engine.prompt_logprobs`): not scored yet, short of the prompt's last (the
        sampling row). Read by the runner (which rows to keep) and the engine (where they go), once per step."""
        seq = self.seq
        if seq.params.pooling is not None:
            return pooling.rows(seq.params.pooling, seq.num_prompt_tokens, self.start, self.num_tokens)
        if not seq.needs_prompt_logprobs:
            return self.start, 0
        lo = max(self.start, seq.num_prompt_logprobs)
        hi = min(self.start + self.num_tokens, seq.num_prompt_tokens - 1)
        return lo, max(0, hi - lo)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    """Running sequences oldest first, then newly admitted ones in FIFO order. Only the last chunk can be a
    partial prefill (``samples`` False), so decodes always come before prefill work. (Under the priority policy the
    order is the policy's, and a higher-priority prefill may use the budget before lower-priority decodes.)"""
    preempted: list[Sequence] = field(default_factory=list)
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    """``(snapshot slot, sequence slot)``: recurrent states to restore before this step computes (prefix hits)."""
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    """``(sequence slot, snapshot slot)``: recurrent states to save after this step computes (prompt boundaries,
    output snapshots)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Decides, step by step, which token positions of which sequences the model computes."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True, watermark: float = 0.01,
                 snapshots: StateSnapshots | None = None, policy: str = "fcfs") -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {policy!r}")
        self.by_priority = policy == "priority"
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.watermark_blocks = max(1, int(watermark * kv.num_blocks)) if watermark > 0 else 0
        """Blocks left free when admitting next to running sequences, so they can grow without thrashing."""
        self.waiting: deque[Sequence] = deque()  # sorted by `_order`: preempted ones return to the front
        self.running: list[Sequence] = []  # sorted by `_order`
        self._by_id: dict[str, Sequence] = {}
        self.snapshots = snapshots
        """For models with recurrent state and prefix caching: the saved states a prefix hit needs too."""
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        """State slots (``Sequence.state_slot``) not held by a running sequence; one per possible running one."""
        self._next_arrival = 0
        self.num_preemptions = 0

    # ---- requests ----------------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    @property
    def max_prompt_tokens(self) -> int | None:
        """The longest prompt `add` takes apart from the context length: one step's budget when chunked prefill is
        off (a prompt is prefilled in one step), else None."""
        return None if self.enable_chunked_prefill else self.max_num_batched_tokens

    def add(self, seq: Sequence) -> None:
        """Queue a new request; ValueError when it could never be served."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request_id {seq.request_id!r} is already in the engine")
        if seq.params.priority and not self.by_priority:
            raise ValueError(f"priority {seq.params.priority} needs the priority scheduling policy (the engine "
                             f"serves requests first come, first served)")
        n_prompt = seq.num_prompt_tokens
        if n_prompt == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        if n_prompt > self.max_model_len:
            raise ValueError(f"the prompt has {n_prompt} tokens, more than the maximum model length of "
                             f"{self.max_model_len}")
        if self.max_prompt_tokens is not None and n_prompt > self.max_prompt_tokens:
            raise ValueError(f"the prompt has {n_prompt} tokens, more than max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) with chunked prefill disabled")
        max_tokens = 0 if seq.params.pooling is not None else seq.params.max_tokens
        longest = self.max_model_len if max_tokens is None else min(self.max_model_len, n_prompt + max_tokens)
        longest = max(longest, n_prompt)
        need = self.kv.blocks_for(longest)
        if need > self.kv.num_blocks:
            raise ValueError(f"the request can reach {longest} tokens (prompt {n_prompt}, max_tokens {max_tokens}), "
                             f"which needs {need} KV blocks of {self.kv.block_size}, but the whole cache has "
                             f"{self.kv.num_blocks}; lower max_tokens or enlarge the KV cache")
        seq.status = SequenceStatus.WAITING
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=self._order)
        else:
            self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        """Remove the request wherever it is and free its blocks; None when it is not here."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark ``seq`` finished, free its blocks and forget it."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release_slot(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._by_id.pop(seq.request_id, None)

    # ---- steps -------------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks; every scheduled position has a slot in its sequence's ``block_ids``."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # Running sequences oldest first (in `_order`). At most one of them is mid-prefill, and under FCFS it is the
        # newest: a chunk stops short only when it uses up the budget, after which nothing newer is admitted. So
        # decodes come first.
        allocate, max_len, running = self.kv.allocate_slots, self.max_model_len, SequenceStatus.RUNNING
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not running or self._ends_when_read(seq):  # preempted earlier in this loop, or done
                continue
            start, num_tokens = seq.num_computed_tokens, seq.num_tokens
            if seq.draft and start == num_tokens - 1:  # a speculative decode, when its blocks are free
                k = min(len(seq.draft), budget - 1, max_len - num_tokens)
                if k > 0 and allocate(seq, 1 + k):
                    out.chunks.append(ScheduledChunk(seq, start, 1 + k, True, tuple(seq.draft[:k])))
                    budget -= 1 + k
                    continue
            n = self._cap(seq, start, min(num_tokens if num_tokens < max_len else max_len, start + budget) - start)
            if n <= 0:  # waiting for the engine to append its sampled token, or at max_model_len
                continue
            while not allocate(seq, n):
                victim = self.running[-1]  # the newest; not yet scheduled, as the loop goes oldest first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.chunks.append(self._chunk(seq, n))
                budget -= n
                if self._save_at_boundary(seq, start, n, out):
                    budget = 0  # (see _cap): the chunk stopped short, so nothing newer runs this step
                else:
                    self._save_output_block(seq, start + n, out)

        if out.preempted:
            return out  # admitting now would only thrash

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = [] if seq.computes_whole_prompt else self.kv.lookup(seq)
            restore = None
            if self.snapshots is not None and hits:  # the KV hit counts only as far as a saved state reaches
                k, restore = self.snapshots.longest(seq.block_hashes[:len(hits)])
                hits = hits[:k]
            num_computed = len(hits) * self.kv.block_size
            n = seq.num_tokens - num_computed
            if n > budget:
                if self.enable_chunked_prefill:
                    n = budget
                elif n > self.max_num_batched_tokens and budget == self.max_num_batched_tokens:
                    n = budget  # a preempted sequence longer than any step: its recompute must be chunked
                else:
                    break
            n = self._cap(seq, num_computed, n)
            reserve = self.watermark_blocks if self.running else 0
            # Admit only when all of its remaining tokens fit, not just this chunk: a prefill that runs out of
            # blocks halfway preempts itself and its work is lost.
            whole = self.kv.num_blocks_to_allocate(seq, seq.num_tokens - num_computed, hits)
            if whole + reserve > self.kv.num_free_blocks or not self.kv.allocate_slots(seq, n, hits, reserve):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = num_computed
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = min(num_computed, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            seq.state_slot = self._free_slots.pop()
            if restore is not None:
                out.state_restores.append((restore, seq.state_slot))
                self.snapshots.num_restores += 1
            bisect.insort(self.running, seq, key=self._order)
            out.chunks.append(self._chunk(seq, n))
            budget -= n
            if self._save_at_boundary(seq, num_computed, n, out):
                break
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> None:
        """Record a step's results: computed positions advance, sampling chunks get ``sampled[request_id]``: one
        token, or for a speculative chunk the tokens kept (its kept drafts' positions then count as computed, the
        rejected ones' do not).

        Sequences finished or aborted since ``schedule`` are skipped.
        """
        kv = self.kv
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.num_computed_tokens != chunk.start:
                raise RuntimeError(f"request {seq.request_id!r}: update for a chunk at {chunk.start} but "
                                   f"{seq.num_computed_tokens} tokens are computed (update called twice?)")
            seq.draft = []
            if chunk.draft:
                kept = sampled[seq.request_id]
                assert isinstance(kept, list) and 1 <= len(kept) <= chunk.num_tokens, kept
                seq.num_computed_tokens += len(kept)
                seq.output_token_ids.extend(kept)
            else:
                seq.num_computed_tokens += chunk.num_tokens
            if chunk.samples and not chunk.draft:
                try:
                    seq.append_token(sampled[seq.request_id])
                except KeyError:
                    raise KeyError(f"request {seq.request_id!r} sampled this step but no token was given") from None
            if seq.num_computed_tokens // kv.block_size > seq.num_registered_blocks:
                kv.cache_full_blocks(seq)
        if self.snapshots is not None:
            self.snapshots.commit()

    def check_integrity(self) -> None:
        """The KV invariants, with every block held by exactly the running sequences' block tables."""
        self.kv.check_integrity(self.running)
        for seq in self.waiting:
            if seq.block_ids or seq.num_computed_tokens or seq.state_slot != -1:
                raise AssertionError(f"waiting request {seq.request_id!r} holds blocks, computed tokens or a slot")
        held = sorted(s.state_slot for s in self.running)
        if sorted(held + self._free_slots) != list(range(self.max_num_seqs)):
            raise AssertionError(f"state slots: running hold {held}, free {sorted(self._free_slots)}")

    # ---- internals ---------------------------------------------------------------------------------------------

    def _snapshot_boundary(self, seq: Sequence) -> int:
        """Where a snapshot of ``seq``'s state is worth taking: its prompt's last full-block boundary before the
        prompt's last token (0: none)."""
        bs = self.kv.block_size
        return (seq.num_prompt_tokens - 1) // bs * bs

    def _ends_when_read(self, seq: Sequence) -> bool:
        """Whether ``seq``'s last token is still on the device (asynchronous scheduling) and ends it by length
        whatever its value: ``max_tokens`` or ``max_model_len`` reached. Another step would compute a row that
        nothing reads; the engine finishes ``seq`` when it reads that token."""
        out = seq.output_token_ids
        if not out or out[-1] != PLACEHOLDER:
            return False
        limit = seq.params.max_tokens
        return (limit is not None and len(out) >= limit) or seq.num_tokens >= self.max_model_len

    def _cap(self, seq: Sequence, start: int, n: int) -> int:
        """``n`` new positions from ``start``, cut to end at the snapshot boundary when they would cross it. The cut
        chunk ends this step's scheduling, so at most the newest scheduled chunk is a partial prefill."""
        if self.snapshots is None:
            return n
        boundary = self._snapshot_boundary(seq)
        return boundary - start if start < boundary < start + n else n

    def _save_at_boundary(self, seq: Sequence, start: int, n: int, out: SchedulerOutput) -> bool:
        """Ask for a snapshot when this chunk ends at ``seq``'s boundary; True when it does (whether or not a new
        snapshot was needed)."""
        if self.snapshots is None or start + n != self._snapshot_boundary(seq) or start + n == 0:
            return False
        slot = self.snapshots.reserve(self.kv.block_hash(seq, (start + n) // self.kv.block_size))
        if slot is not None:
            out.state_saves.append((seq.state_slot, slot))
        return True

    def _save_output_block(self, seq: Sequence, end: int, out: SchedulerOutput) -> None:
        """Roll ``seq``'s output snapshot forward when this step's chunk ends on a block boundary past its prompt
        snapshot (`StateSnapshots`)."""
        if self.snapshots is None or end % self.kv.block_size or end <= self._snapshot_boundary(seq):
            return
        key = self.kv.block_hash(seq, end // self.kv.block_size)
        slot = self.snapshots.reserve(key, output=True, replaces=seq.output_snapshot)
        if slot is not None:
            out.state_saves.append((seq.state_slot, slot))
            seq.output_snapshot = key

    def _order(self, seq: Sequence) -> tuple[int, int]:
        """Where ``seq`` stands in the waiting queue and the running list: by arrival, or by priority first."""
        return (seq.params.priority if self.by_priority else 0, seq.arrival)

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(seq=seq, start=start, num_tokens=n,
                              samples=start + n == seq.num_tokens and seq.params.pooling is None)

    def _release_slot(self, seq: Sequence) -> None:
        self._free_slots.append(seq.state_slot)
        seq.state_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_slot(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:  # ahead of every waiting request it outranks
            bisect.insort(self.waiting, seq, key=self._order)
        else:
            self.waiting.appendleft(seq)
