"""Triton SiLU-and-mul for fused gate_up projections (reference: `reference_ops.silu_and_mul`)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` ``[..., 2I]``; a new ``[..., I]`` tensor of ``x``'s dtype."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    blk = min(block, triton.next_power_of_2(inter))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, blk))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=blk, num_warps=4, num_stages=1,
        )
    return out.view(*x.shape[:-1], inter)
