"""Triton RMSNorm, fused residual-add + RMSNorm and Qwen3-Next's gated RMSNorm: one program per row, fp32
statistics (reference: `reference_ops`).

``offset=True`` is the zero-centred form (Gemma, Qwen3-Next): the weight applies as ``1 + w``, in fp32."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, n, eps,
    BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        w = 1.0 + w
    y = x * tl.rsqrt(var + eps) * w
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(n: int) -> int:
    return 8 if n >= 4096 else 4


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """``x / rms(x) * weight`` (``* (1 + weight)`` with ``offset``) over the last dimension (any leading shape); a new
    tensor of ``x``'s dtype."""
    n = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2, weight, out, out, x2.stride(0), x2.stride(0), out.stride(0), out.stride(0), n, float(eps),
            BLOCK_N=triton.next_power_of_2(n), HAS_RESIDUAL=False, OFFSET=offset, num_warps=_num_warps(n), num_stages=1,
        )
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual, offset=offset), x + residual)`` in one pass; the sum is rounded to ``residual``'s
    dtype first."""
    n = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(r2.shape, dtype=residual.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), n, float(eps),
            BLOCK_N=triton.next_power_of_2(n), HAS_RESIDUAL=True, OFFSET=offset, num_warps=_num_warps(n), num_stages=1,
        )
    return out.view(x.shape), res_out.view(residual.shape)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, stride_x, stride_g, stride_o, n, eps,
                           BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(dt).to(tl.float32) * (g / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + row * stride_o + offs, y.to(dt), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x) * silu(gate)`` over the last dimension in ``gate``'s dtype, one launch: ``x`` (any
    float dtype, e.g. the delta rule's float32 output) rounded to that dtype first, the norm rounded before the
    weight, the product before the gate, as the torch code (`reference_ops.gated_rms_norm`) rounds."""
    n = x.shape[-1]
    x2, g2 = _rows(x), _rows(gate)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if x2.shape[0]:
        _gated_rms_norm_kernel[(x2.shape[0],)](
            x2, g2, weight, out, x2.stride(0), g2.stride(0), out.stride(0), n, float(eps),
            BLOCK_N=triton.next_power_of_2(n), num_warps=_num_warps(n), num_stages=1,
        )
    return out.view(gate.shape)
