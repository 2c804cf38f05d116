"""Triton kernel that splits Qwen3-Next's linear-attention projections into the layouts the layer consumes, in one
launch.

``in_proj_qkvz`` writes its outputs grouped per key head (the head's q, its k, then its ``r = hv / hk`` value heads'
v and z) and ``in_proj_ba`` likewise (the group's b then a). The conv wants ``q | k | v`` in channel order
(all heads' q, then k, then v), the gated norm wants z per value head, the delta rule b and a per value head. In
torch that is six strided copies and a concatenation per layer and step (reference:
`ember.engine.models.qwen3_next.GatedDeltaNet._project`'s torch path); here one program per (token, key head) moves its
group's pieces. Pure copies: the outputs equal the torch path's bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_kernel(qkvz_ptr, ba_ptr, mixed_ptr, z_ptr, b_ptr, a_ptr, stride_p, stride_ba, hk,
                  DK: tl.constexpr, RDV: tl.constexpr, R: tl.constexpr,
                  BLOCK_DK: tl.constexpr, BLOCK_RDV: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    src = qkvz_ptr + t * stride_p + h * (2 * DK + 2 * RDV)
    channels = 2 * hk * DK + hk * RDV
    dst = mixed_ptr + t * channels
    d = tl.arange(0, BLOCK_DK)
    dm = d < DK
    tl.store(dst + h * DK + d, tl.load(src + d, mask=dm), mask=dm)
    tl.store(dst + hk * DK + h * DK + d, tl.load(src + DK + d, mask=dm), mask=dm)
    v = tl.arange(0, BLOCK_RDV)
    vm = v < RDV
    tl.store(dst + 2 * hk * DK + h * RDV + v, tl.load(src + 2 * DK + v, mask=vm), mask=vm)
    tl.store(z_ptr + t * hk * RDV + h * RDV + v, tl.load(src + 2 * DK + RDV + v, mask=vm), mask=vm)
    r = tl.arange(0, BLOCK_R)
    rm = r < R
    gates = ba_ptr + t * stride_ba + h * 2 * R
    tl.store(b_ptr + t * hk * R + h * R + r, tl.load(gates + r, mask=rm), mask=rm)
    tl.store(a_ptr + t * hk * R + h * R + r, tl.load(gates + R + r, mask=rm), mask=rm)


def split_projections(qkvz: torch.Tensor, ba: torch.Tensor, hk: int, dk: int, hv: int, dv: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q|k|v [T, 2*hk*dk + hv*dv], z [T, hv, dv], b [T, hv], a [T, hv])`` from ``qkvz [T, hk*(2*dk + 2*r*dv)]``
    and ``ba [T, hk*2*r]`` grouped per key head (``r = hv // hk``); every output contiguous, in the inputs'
    dtypes."""
    t = qkvz.shape[0]
    r = hv // hk
    if qkvz.stride(-1) != 1 or ba.stride(-1) != 1:
        raise ValueError("split_projections needs the projections' columns contiguous")
    mixed = torch.empty(t, 2 * hk * dk + hv * dv, dtype=qkvz.dtype, device=qkvz.device)
    z = torch.empty(t, hv, dv, dtype=qkvz.dtype, device=qkvz.device)
    b = torch.empty(t, hv, dtype=ba.dtype, device=ba.device)
    a = torch.empty(t, hv, dtype=ba.dtype, device=ba.device)
    if t:
        _split_kernel[(t, hk)](
            qkvz, ba, mixed, z, b, a, qkvz.stride(0), ba.stride(0), hk,
            DK=dk, RDV=r * dv, R=r, BLOCK_DK=triton.next_power_of_2(dk), BLOCK_RDV=triton.next_power_of_2(r * dv),
            BLOCK_R=triton.next_power_of_2(r), num_warps=4, num_stages=1,
        )
    return mixed, z, b, a
