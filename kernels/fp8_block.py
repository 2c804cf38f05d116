"""Block-scaled FP8 weights (DeepSeek-V3's and Qwen's ``-FP8`` releases): reference dequantize and quantize.

Format: ``weight`` e4m3 (``torch.float8_e4m3fn``) ``[..., N, K]``; ``scale`` float32 ``[..., ceil(N/bn),
ceil(K/bk)]`` (the checkpoints' ``weight_scale_inv``), one per ``bn x bk`` block, the last row and column of blocks
possibly partial. ``W[n, k] = e4m3(weight[n, k]) * scale[n // bn, k // bk]``. Per-channel scales are the block
``(1, CHANNEL)``: one scale per row, spanning any K.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
CHANNEL = 1 << 30
"""A block extent longer than any weight: ``(1, CHANNEL)`` is one scale per output row."""


@dataclass
class FP8BlockTensor:
    """One block-scaled FP8 weight, 2-D or stacked per expert (3-D)."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.scale, self.block, dtype)


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...] | torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """The per-element float32 scale of a weight of ``shape`` (each element's block's entry of ``scale``)."""
    rows = torch.arange(shape[-2], device=scale.device) // block[0]
    cols = torch.arange(shape[-1], device=scale.device) // block[1]
    return scale.float().index_select(-2, rows).index_select(-1, cols)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight * scale`` per block, in ``dtype`` (exact in fp32)."""
    w = weight.view(torch.float8_e4m3fn) if weight.dtype == torch.uint8 else weight
    return (w.float() * expand_scale(scale, weight.shape, block)).to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> FP8BlockTensor:
    """``w`` ``[..., N, K]`` as the FP8 releases store it: each block's scale is its ``amax / 448`` (a zero block
    gets a tiny positive scale), the weight divided by it and rounded to e4m3."""
    n, k = w.shape[-2], w.shape[-1]
    bn, bk = min(block[0], n), min(block[1], k)  # a block longer than the weight is the whole extent
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(*w.shape[:-2], gn * bn, gk * bk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float()
    amax = padded.unflatten(-1, (gk, bk)).unflatten(-3, (gn, bn)).abs().amax(dim=(-3, -1))
    scale = amax.clamp(min=1e-12) / E4M3_MAX
    q = (w.float() / expand_scale(scale, w.shape, block)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return FP8BlockTensor(q, scale, tuple(block))
