"""MXFP4 (OCP Microscaling FP4, as OpenAI's gpt-oss checkpoints store their experts) reference quantize / dequantize.

Format:
- elements are FP4 E2M1, the same codes as NVFP4 (:mod:`ember.kernels.nvfp4`: ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and
  negatives), two per uint8 along the contraction (K) dimension, element ``2i`` in the low nibble;
- one E8M0 scale per 32 consecutive K elements: a uint8 biased exponent, ``scale = 2 ** (s - 127)`` (no tensor
  scale).

``W[n, k] = E2M1(code[n, k]) * 2 ** (scales[n, k // 32] - 127)``. gpt-oss checkpoints name them
``mlp.experts.{gate_up,down}_proj_blocks`` (``[E, N, K/32, 16]`` uint8, viewed here as ``[E, N, K/2]``) and
``..._scales`` (``[E, N, K/32]`` uint8), with rows ``N`` the output features (transformers transposes after
dequantizing).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.kernels.nvfp4 import E2M1_MAX, e2m1_to_float, pack_e2m1, round_e2m1, unpack_e2m1

BLOCK = 32
E8M0_BIAS = 127


@dataclass
class MXFP4Tensor:
    """One quantized 2-D (or stacked 3-D) weight: ``weight`` uint8 ``[..., N, K/2]`` (packed E2M1), ``scale`` uint8
    ``[..., N, K/32]`` (E8M0 exponents)."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (unpacked) shape."""
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 2)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.scale, dtype)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> float32 powers of two (byte 255, NaN in the spec, is not expected in weights)."""
    return torch.exp2(scale.to(torch.float32) - E8M0_BIAS)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed ``[..., N, K/2]`` with E8M0 ``[..., N, K/32]`` -> ``[..., N, K]`` in ``dtype`` (exact in fp32)."""
    k = weight.shape[-1] * 2
    v = e2m1_to_float(unpack_e2m1(weight)).view(*weight.shape[:-1], k // BLOCK, BLOCK)
    return (v * e8m0_to_float(scale).unsqueeze(-1)).flatten(-2).to(dtype)


def quantize(w: torch.Tensor) -> MXFP4Tensor:
    """Quantize ``w`` ``[..., N, K]`` (K a multiple of 32) as the OCP MX spec does: each block's scale is
    ``2 ** (floor(log2(amax)) - 2)`` (2 = E2M1's largest exponent), elements rounded half to even to E2M1 and
    saturated at 6. An all-zero block gets the smallest scale and zero codes."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {BLOCK}, got {w.shape[-1]}")
    wb = w.float().view(*w.shape[:-1], -1, BLOCK)
    amax = wb.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
    x = (wb / torch.exp2(exp).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    codes = round_e2m1(x).flatten(-2)
    return MXFP4Tensor(pack_e2m1(codes), (exp + E8M0_BIAS).to(torch.uint8))
