"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the scores of a step's prompt rows (which rows those are:
`ScheduledChunk.prompt_rows`).

The logits of those rows are computed a slice of at most ``max_rows`` rows at a time (the engine passes
``max_num_seqs``, the logits rows its memory profile counts), so scoring a long prompt never needs more memory than a
step that samples every sequence.

The row at position ``p`` predicts token ``p + 1``, so a prompt of ``P`` tokens has ``P - 1`` scored tokens
(positions ``0 .. P - 2``; the last prompt position is the sampling row). A sequence that needs them is never served
from the prefix cache (its prompt must be computed), and a recompute after preemption skips what was already scored.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ember.engine.params import TokenLogprob


def score(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """Each row's log-probability of its target token, the token's rank, and the ``top`` best alternatives (fp32
    log-softmax)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(targets, device=logp.device).unsqueeze(1))
    ranks = ((logp > chosen).sum(dim=1) + 1).tolist()
    lps = chosen.squeeze(1).tolist()
    if top <= 0:
        return [TokenLogprob(t, lp, [], r) for t, lp, r in zip(targets, lps, ranks)]
    values, ids = logp.topk(min(top, logp.shape[1]), dim=-1)
    return [TokenLogprob(t, lp, list(zip(i, v)), r)
            for t, lp, r, i, v in zip(targets, lps, ranks, ids.tolist(), values.tolist())]


def score_rows(logits_of: Callable[[int, int], torch.Tensor], first: int, targets: list[int], top: int,
               max_rows: int) -> list[TokenLogprob]:
    """`score` of rows ``first .. first + len(targets) - 1``, whose logits ``logits_of(lo, hi)`` computes,
    ``max_rows`` rows at a time."""
    out: list[TokenLogprob] = []
    for a in range(0, len(targets), max_rows):
        b = min(a + max_rows, len(targets))
        out += score(logits_of(first + a, first + b), targets[a:b], top)
    return out
