"""Pooling requests (`SamplingParams.pooling`): a prompt's final hidden states (after the model's last norm, what
transformers calls ``last_hidden_state``) reduced to one fp32 vector, the embedding.

- ``last``: the hidden state of the prompt's last position (decoder embedding models: Qwen3-Embedding, E5-Mistral,
  GTE-Qwen2);
- ``mean``: the mean over every prompt position;
- ``cls``: the first position's.

Which positions a step keeps for a sequence is `rows`; the engine folds each step's kept rows into
``Sequence.pooled`` with `fold` and turns the pool into the embedding with `result` once the prompt is computed; a
classifier's pool goes through its head (`ember.engine.models.classifier`). The vector is not normalized: normalizing
and truncating (Matryoshka ``dimensions``) belong to the caller. A pooling over more than the last position needs
every position computed, so such a sequence is never served from the prefix cache (``Sequence.computes_whole_prompt``),
and a recompute after preemption starts its pool again.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler imports `rows`; the scheduling core stays free of torch
    import torch

POOLING_TYPES = ("last", "mean", "cls")


def rows(kind: str, num_prompt_tokens: int, start: int, num_tokens: int) -> tuple[int, int]:
    """``(first position, count)`` of the chunk ``start .. start + num_tokens - 1`` that ``kind`` pools."""
    lo, hi = {"last": (num_prompt_tokens - 1, num_prompt_tokens), "mean": (0, num_prompt_tokens),
              "cls": (0, 1)}[kind]
    lo, hi = max(lo, start), min(hi, start + num_tokens)
    return lo, max(0, hi - lo)


def fold(kind: str, pooled: torch.Tensor | None, first: int, hidden: torch.Tensor) -> torch.Tensor:
    """The pool after this step's kept rows ``hidden`` ``[q, H]`` (positions ``first ..``): a fp32 sum over the
    positions for ``mean`` (restarted when ``first`` is 0), the one row otherwise."""
    part = hidden.float().sum(dim=0) if kind == "mean" else hidden[0].float()
    if kind != "mean" or first == 0 or pooled is None:
        return part
    return pooled + part


def result(kind: str, pooled: torch.Tensor, num_prompt_tokens: int,
           head: torch.nn.Module | None = None) -> list[float]:
    """The embedding of a finished pool; with a classifier's ``head`` (a module from hidden state to logits), its
    logits for that embedding (computed in the head's dtype, as the model would, and returned in fp32)."""
    vec = pooled / num_prompt_tokens if kind == "mean" else pooled
    if head is not None:
        import torch

        with torch.inference_mode():
            vec = head(vec.to(next(head.parameters()).dtype)).float()
    return vec.cpu().tolist()
