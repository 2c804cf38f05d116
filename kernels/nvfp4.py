"""NVFP4 (NVIDIA ModelOpt format) reference quantize / dequantize in plain torch.

Format, as ModelOpt writes it (``nvidia/*-FP4`` checkpoints):
- elements are FP4 E2M1 (``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives; code ``c``: sign ``c & 8``, magnitude
  index ``c & 7``), rounded half-to-even with saturation at 6;
- two codes per uint8 along the contraction (K) dimension, element ``2i`` in the low nibble;
- one FP8 E4M3FN block scale per 16 consecutive K elements (``weight_scale [N, K/16]``, linear row-major layout);
- one FP32 tensor scale ``weight_scale_2 = amax(|W|) / (6 * 448)``.

``W[n, k] = E2M1(code[n, k]) * float(weight_scale[n, k // 16]) * weight_scale_2``.

Quantizing a tensor that is exactly representable (a dequantized one, whose per-block maxima are code 7 = 6.0)
reproduces its codes and block scales bit for bit, ``-0`` included (the sign comes from ``signbit``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Upper bounds of the magnitude intervals; a value equal to an odd-indexed bound rounds up (half to even).
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)


@dataclass
class NVFP4Tensor:
    """One quantized 2-D (or stacked 3-D) weight: ``weight`` uint8 ``[..., N, K/2]``, ``weight_scale`` float8_e4m3fn
    ``[..., N, K/16]``, ``weight_scale_2`` float32 scalar (or ``[E]`` for a stack)."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (unpacked) shape."""
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 2)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.weight_scale_2, dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of ``x`` (already divided by its scales): round half to even, saturate at 6.

    The magnitude index is the number of interval bounds strictly below ``|x|`` (a value on a bound goes down),
    plus one on the bounds whose upper neighbour has the even mantissa. Elementwise only (no host tensors), so it
    can run inside a CUDA graph.
    """
    x = x.float()
    mag = x.abs()
    idx = torch.zeros_like(mag, dtype=torch.uint8)
    for b in _BOUNDS:
        idx += (mag > b).to(torch.uint8)
    for t in _TIES_UP:
        idx += (mag == t).to(torch.uint8)
    return idx | (torch.signbit(x).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes -> ``[..., K/2]`` uint8, element ``2i`` in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of E2M1 codes ({codes.shape[-1]})")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` uint8 -> ``[..., K]`` codes (uint8)."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> float32 values (code 8 gives -0.0)."""
    table = torch.tensor(E2M1_VALUES, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def dequantize(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """ModelOpt's ``NVFP4QTensor.dequantize``: packed ``[..., N, K/2]`` -> ``[..., N, K]`` in ``dtype``.

    ``weight_scale_2`` is a scalar, or one per leading (expert) index of a stacked ``[E, N, K/2]`` weight.
    """
    k = weight.shape[-1] * 2
    v = e2m1_to_float(unpack_e2m1(weight)).view(*weight.shape[:-1], k // BLOCK, BLOCK)
    s = weight_scale.view(torch.float8_e4m3fn).float()
    s2 = weight_scale_2.float()
    if s2.dim() > 0:
        s2 = s2.reshape(*s2.shape, *([1] * (s.dim() - s2.dim())))
    return (v * (s * s2).unsqueeze(-1)).flatten(-2).to(dtype)


def tensor_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """``amax / (6 * 448)`` as float32: ModelOpt's ``weight_scale_2`` (and ``input_scale`` from an activation amax)."""
    return (torch.as_tensor(amax, dtype=torch.float32) / (E2M1_MAX * E4M3_MAX)).float()


def quantize(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None) -> NVFP4Tensor:
    """Quantize ``w`` ``[..., N, K]`` (K a multiple of 16) exactly as ModelOpt does without calibration data.

    ``weight_scale_2`` defaults to ``amax(|w|) / (6 * 448)``; pass one to share it across fused partitions
    (q/k/v, gate/up), as ModelOpt does. Deviation from ModelOpt: a block whose E4M3 scale underflows to 0 (ModelOpt
    divides by zero there) gets codes 0, i.e. dequantizes to zeros.
    """
    if w.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the input dimension to be a multiple of {BLOCK}, got {w.shape[-1]}")
    wf = w.float()
    s2 = tensor_scale(wf.abs().amax()) if weight_scale_2 is None else weight_scale_2.float().reshape(())
    wb = wf.view(*wf.shape[:-1], -1, BLOCK)
    s = (wb.abs().amax(-1) / (E2M1_MAX * s2)).clamp(max=E4M3_MAX)
    s = torch.where(s == 0, torch.ones_like(s), s).to(torch.float8_e4m3fn)
    denom = (s.float() * s2).unsqueeze(-1)
    x = torch.where(denom == 0, torch.zeros_like(wb), wb / torch.where(denom == 0, torch.ones_like(denom), denom))
    codes = round_e2m1(x).flatten(-2)
    return NVFP4Tensor(pack_e2m1(codes), s, s2.clone())


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-16 activation quantization for W4A4 (vLLM ``scaled_fp4_quant(x, 1/input_scale)`` semantics).

    Returns packed codes ``[..., K/2]`` uint8 and E4M3 block scales ``[..., K/16]``; the value is
    ``E2M1(code) * scale * input_scale``.
    """
    g = 1.0 / input_scale.float()
    xb = x.float().view(*x.shape[:-1], -1, BLOCK)
    s = (g * xb.abs().amax(-1) / E2M1_MAX).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    sf = s.float().unsqueeze(-1)
    q = torch.where(sf == 0, torch.zeros_like(xb), xb * g / torch.where(sf == 0, torch.ones_like(sf), sf))
    codes = round_e2m1(q.clamp(-E2M1_MAX, E2M1_MAX)).flatten(-2)
    return pack_e2m1(codes), s


def dequantize_activations(packed: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_activations`, float32."""
    return dequantize(packed, scale, input_scale.float().reshape(()))
