"""Triton RMSNorm and fused residual-add + RMSNorm: one program per row, fp32 statistics (reference: `reference_ops`).

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
