"""Triton gated activations for fused gate_up projections: SiLU-and-mul and GELU(tanh)-and-mul (references:
`reference_ops.silu_and_mul`, `reference_ops.gelu_tanh_and_mul`)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr, ACT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == "gelu_tanh":
        # 0.5 * (1 + tanh(y)) == sigmoid(2y), y = sqrt(2/pi) * (g + 0.044715 g^3); exp of -|2y| never overflows
        z = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp(-tl.abs(z))
        y = gate * tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * up
    else:
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, block: int, act: str) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    blk = min(block, triton.next_power_of_2(inter))
    if x2.shape[0]:
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, blk))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=blk, ACT=act, num_warps=4, num_stages=1,
        )
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` ``[..., 2I]``; a new ``[..., I]`` tensor of ``x``'s dtype."""
    return _act_and_mul(x, block, "silu")


def gelu_tanh_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``gelu_tanh(x[..., :I]) * x[..., I:]`` (GELU's tanh approximation, fp32 math) for ``x`` ``[..., 2I]``; a new
    ``[..., I]`` tensor of ``x``'s dtype."""
    return _act_and_mul(x, block, "gelu_tanh")



@triton.jit
def _sigmoid_gate_kernel(x_ptr, g_ptr, out_ptr, stride_x, stride_gt, stride_gh, stride_o, D: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + t * stride_x + h * D + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * stride_gt + h * stride_gh + offs, mask=mask, other=0.0).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded, as torch's sigmoid
    tl.store(out_ptr + t * stride_o + h * D + offs, (x * s).to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` for ``x [T, H*D]`` (rows contiguous) and ``gate [T, H, D]``, a strided view (each head's
    gate read in place, as Qwen3-Next's attention output gate between its heads' queries): a new ``[T, H*D]`` of
    ``x``'s dtype, rounded as torch rounds ``x * torch.sigmoid(gate)`` (the sigmoid to the dtype, then the product),
    in one launch."""
    t, h, d = gate.shape
    if x.shape != (t, h * d) or x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("sigmoid_gate_mul needs x [T, H*D] and gate [T, H, D], each with contiguous last dims")
    out = torch.empty(t, h * d, dtype=x.dtype, device=x.device)
    if t:
        _sigmoid_gate_kernel[(t, h)](x, gate, out, x.stride(0), gate.stride(0), gate.stride(1), out.stride(0), D=d,
                                     BLOCK_D=triton.next_power_of_2(d), num_warps=4, num_stages=1)
    return out
