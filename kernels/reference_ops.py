"""Plain torch references for the row-wise kernels (RMSNorm, gated RMSNorm, neox rotary, SiLU- and GELU-tanh-and-mul,
the fused attention prologue); also usable on CPU.

Each computes in fp32 and returns the input dtype, as the Triton kernels in `norm`, `rotary` and `activation` do.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension; with ``offset`` the zero-centred ``* (1 + weight)``
    (`OffsetRMSNorm`'s math: the whole product in fp32, then cast)."""
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    w = weight.float()
    return (xf * torch.rsqrt(var + eps) * (1.0 + w if offset else w)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual, offset=offset), x + residual)``: the pre-norm of the next sublayer and the new
    residual stream.

    The sum is rounded to the residual's dtype before normalising, as a model that stores the residual would.
    """
    new_residual = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm(new_residual, weight, eps, offset).to(x.dtype), new_residual


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's gated norm ``weight * rmsnorm(x) * silu(gate)`` in ``gate``'s dtype: ``x`` rounded to it, the norm
    rounded before the weight, the weighted norm before the fp32 gate (transformers' rounding)."""
    xf = x.to(gate.dtype).float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(gate.dtype)
    return (weight * normed * torch.nn.functional.silu(gate.float())).to(gate.dtype)


def rotary_cos_sin_cache(rotary_dim: int, max_position: int, base: float, dtype: torch.dtype = torch.float32,
                         device: torch.device | str | None = None) -> torch.Tensor:
    """``[max_position, rotary_dim]``: cos of each position's angles in the first half, sin in the second (vLLM)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim))
    t = torch.arange(max_position, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def rotary_neox(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding of ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` at ``positions``.

    Only the first ``rotary_dim = cos_sin_cache.shape[1]`` dims rotate; returns new tensors.
    """
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    cs = cos_sin_cache[positions.long()].float()
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def apply(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1 = xf[..., :half]
        x2 = xf[..., half:rot]
        out = xf.clone()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rot] = x2 * cos + x1 * sin
        return out.to(x.dtype)

    return apply(q), apply(k)


def qk_norm_rope_cache(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None, eps: float = 1e-6, k_scale: float | None = None,
    v_scale: float | None = None, *, offset: bool = False,
) -> torch.Tensor:
    """`ember.kernels.qk_norm_rope_cache`'s contract as the unfused chain: per-head `rms_norm` of q and k (with
    weights), `rotary_neox`, the keys and values written by `ember.kernels.reference.reshape_and_cache`; returns the
    rotated queries."""
    from ember.kernels import reference

    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps, offset), rms_norm(k, k_weight, eps, offset)
    q, k = rotary_neox(positions, q, k, cos_sin_cache)
    reference.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` ``[..., 2I]`` (gate first, as a fused gate_up projection)."""
    i = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :i]) * xf[..., i:]).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :I]) * x[..., I:]`` for ``x`` ``[..., 2I]`` (Gemma's gated MLP; GELU's tanh
    approximation)."""
    i = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.gelu(xf[..., :i], approximate="tanh") * xf[..., i:]).to(x.dtype)
