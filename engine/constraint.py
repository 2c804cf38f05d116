"""The seam through which structured output (``ember.grammar``) restricts sampling.

Bitmask format (llguidance's): ``int32 [rows, ceil(vocab/32)]``; bit ``j`` of word ``i`` set means token ``32*i + j``
is allowed. The engine keeps the bitmask in a host buffer (pinned on CUDA; rows zeroed before each fill), asks the
filler to fill the rows of constrained requests, uploads the packed words with one non-blocking copy, expands them
on the device to mask those rows' logits to -inf where the bit is clear, samples, then calls ``accept_token`` with
the sampled token. Fillers and ``fill_bitmask`` write host (CPU) int32 rows only.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import torch


class Constraint(Protocol):
    """Per-request (per-choice) token constraint."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``."""

    def accept_token(self, token_id: int) -> bool:
        """Advance past a sampled token; False (or an exception) ends the request with finish_reason ``error``."""

    def is_terminated(self) -> bool:
        """True once the constraint allows nothing further; the engine then finishes the request with ``stop``."""

    def error_message(self) -> str | None:
        """Why the constraint failed, for the ``error`` field of the request's output."""


@runtime_checkable
class LookaheadConstraint(Constraint, Protocol):
    """A constraint that can mask a position past tokens it has not accepted: a speculative chunk's later rows
    (`ember.engine.speculative`). Only requests under such a constraint speculate."""

    def fill_bitmask_after(self, draft: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        """Write into ``bitmask[row]`` the tokens allowed once ``draft`` were accepted, leaving this constraint as
        it was. When the constraint refuses a token of ``draft``, the row can never be kept (the row before it
        could not sample that token): write any mask that allows a token."""


BitmaskFiller = Callable[[Sequence[Constraint], torch.Tensor], None]
"""Fills ``bitmask[i]`` for ``constraints[i]``; the grammar backend supplies a parallel one."""


def fill_bitmasks_serial(constraints: Sequence[Constraint], bitmask: torch.Tensor) -> None:
    """Default filler: one constraint after another."""
    for row, c in enumerate(constraints):
        c.fill_bitmask(bitmask, row)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
