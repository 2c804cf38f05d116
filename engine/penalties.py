"""Per-request token statistics for repetition / presence / frequency penalties, kept on the device.

Each request with a penalty holds a slot: a row of ``counts`` (how often each token was generated, fp32 ``[V]``) and
of ``prompt_seen`` (which tokens its prompt holds, bool ``[V]``). A slot is built once, from the request's prompt and
outputs, the first time it samples; after each step the sampled tokens are added on the device (`count_sampled`),
so nothing is re-uploaded per step and nothing is read back. A slot whose count of outputs disagrees with its
sequence (or that belongs to another `Sequence` object under the same request ID) is rebuilt.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.engine.sequence import Sequence


@dataclass
class _Slot:
    index: int
    seq: Sequence
    counted: int
    """Output tokens in ``counts[index]`` (the sequence's outputs once the step's token is appended)."""


@dataclass
class Rebuild:
    """Token IDs to (re)load into slots before this step's penalties apply (one upload for all of them)."""

    slots: list[int]
    output_slots: list[int]
    output_ids: list[int]
    prompt_slots: list[int]
    prompt_ids: list[int]


class PenaltyState:
    """Device rows of token counts and prompt presence, one per request that uses a penalty (grown on demand)."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.float32, device=device)
        self.prompt_seen = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self._slots: dict[str, _Slot] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def forget(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot.index)

    def slots_for(self, seqs: list[Sequence]) -> tuple[list[int], Rebuild]:
        """Each sequence's slot (assigned or reused) and what must be loaded into new or stale ones."""
        rb = Rebuild([], [], [], [], [])
        out: list[int] = []
        for seq in seqs:
            slot = self._slots.get(seq.request_id)
            if slot is None or slot.seq is not seq or slot.counted != seq.num_output_tokens:
                if slot is None:
                    slot = _Slot(self._take(), seq, 0)
                    self._slots[seq.request_id] = slot
                slot.seq, slot.counted = seq, seq.num_output_tokens
                rb.slots.append(slot.index)
                rb.output_slots += [slot.index] * seq.num_output_tokens
                rb.output_ids += seq.output_token_ids
                rb.prompt_slots += [slot.index] * seq.num_prompt_tokens
                rb.prompt_ids += seq.prompt_token_ids
            out.append(slot.index)
        return out, rb

    def load(self, slots: torch.Tensor, out_slots: torch.Tensor, out_ids: torch.Tensor, prompt_slots: torch.Tensor,
             prompt_ids: torch.Tensor) -> None:
        """Reset ``slots`` and fill them from the uploaded token lists (device tensors of a `Rebuild`)."""
        self.counts[slots] = 0.0
        self.prompt_seen[slots] = False
        if out_ids.numel():
            self.counts.index_put_((out_slots, out_ids), torch.ones_like(out_ids, dtype=torch.float32),
                                   accumulate=True)
        if prompt_ids.numel():
            self.prompt_seen.index_put_((prompt_slots, prompt_ids), torch.ones_like(prompt_ids, dtype=torch.bool))

    def count_sampled(self, seqs: list[Sequence], slots: torch.Tensor, tokens: torch.Tensor,
                      kept: torch.Tensor | None = None) -> None:
        """Add this step's sampled ``tokens`` (device) to ``slots``, each weighted by ``kept`` (1.0 or 0.0 per row;
        all 1.0 when None); the engine appends one token to each of ``seqs`` (and kept drafts, see `advance`)."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.float32) if kept is None
                               else kept, accumulate=True)
        for seq in seqs:
            self._slots[seq.request_id].counted += 1

    def advance(self, seq: Sequence, kept: int) -> None:
        """``kept`` more of ``seq``'s outputs (kept speculative drafts) are already in its counts."""
        slot = self._slots.get(seq.request_id)
        if slot is not None:
            slot.counted += kept

    def _take(self) -> int:
        if not self._free:
            cap = self.counts.shape[0]
            self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            self.prompt_seen = torch.cat([self.prompt_seen, torch.zeros_like(self.prompt_seen)])
            self._free = list(range(2 * cap - 1, cap - 1, -1))
        return self._free.pop()
