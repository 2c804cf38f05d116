"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the scores of a step's prompt rows (which rows those are:
`ScheduledChunk.prompt_rows`).

The row at position ``p`` predicts token ``p + 1``, so a prompt of ``P`` tokens has ``P - 1`` scored tokens
(positions ``0 .. P - 2``; the last prompt position is the sampling row). A sequence that needs them is never served
from the prefix cache (its prompt must be computed), and a recompute after preemption skips what was already scored.
"""
from __future__ import annotations

import torch

from ember.engine.params import TokenLogprob


def score(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """Each row's log-probability of its target token and the ``top`` best alternatives (fp32 log-softmax)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(targets, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
    if top <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(targets, chosen)]
    values, ids = logp.topk(min(top, logp.shape[1]), dim=-1)
    return [TokenLogprob(t, lp, list(zip(i, v))) for t, lp, i, v in zip(targets, chosen, ids.tolist(),
                                                                       values.tolist())]
