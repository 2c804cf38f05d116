"""Triton neox-style rotary embedding over a ``[max_pos, rotary_dim]`` cos|sin cache (reference: `reference_ops`).

One program per token rotates all of its query and key heads; dims past ``rotary_dim`` pass through unchanged.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, o_ptr, stride_xt, stride_xh, stride_ot, stride_oh, t, num_heads, cos, sin,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROT: tl.constexpr, HEAD_SIZE: tl.constexpr,
                  TAIL_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, HALF_PAD)
    rmask = offs_r < HALF
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + offs_h
        hmask = heads < num_heads
        m = hmask[:, None] & rmask[None, :]
        xrow = x_ptr + t * stride_xt + heads[:, None] * stride_xh
        orow = o_ptr + t * stride_ot + heads[:, None] * stride_oh
        x1 = tl.load(xrow + offs_r[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xrow + HALF + offs_r[None, :], mask=m, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(orow + offs_r[None, :], o1.to(o_ptr.dtype.element_ty), mask=m)
        tl.store(orow + HALF + offs_r[None, :], o2.to(o_ptr.dtype.element_ty), mask=m)
        if TAIL_PAD > 0:
            offs_tail = ROT + tl.arange(0, TAIL_PAD)
            tm = hmask[:, None] & (offs_tail < HEAD_SIZE)[None, :]
            tail = tl.load(xrow + offs_tail[None, :], mask=tm, other=0.0)
            tl.store(orow + offs_tail[None, :], tail.to(o_ptr.dtype.element_ty), mask=tm)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_c,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROT: tl.constexpr, HEAD_SIZE: tl.constexpr,
    TAIL_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, HALF_PAD)
    rmask = offs_r < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_r, mask=rmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_r, mask=rmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, num_q_heads, cos, sin,
                  HALF, HALF_PAD, ROT, HEAD_SIZE, TAIL_PAD, BLOCK_H)
    _rotate_heads(k_ptr, ko_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, num_k_heads, cos, sin,
                  HALF, HALF_PAD, ROT, HEAD_SIZE, TAIL_PAD, BLOCK_H)


def rotary_neox(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    *, inplace: bool = False, block_h: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` at ``positions`` ``[T]`` (neox, rotate-half).

    ``q``/``k`` may be strided views (e.g. slices of a fused qkv output) with a contiguous last dim. With ``inplace``
    they are overwritten and returned; otherwise new contiguous tensors are returned.
    """
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    num_tokens, hq, d = q.shape
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    qo = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, qo, ko, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
            cos_sin_cache.stride(0), hq, k.shape[1],
            HALF=half, HALF_PAD=triton.next_power_of_2(half), ROT=rot, HEAD_SIZE=d,
            TAIL_PAD=triton.next_power_of_2(d - rot) if d > rot else 0, BLOCK_H=block_h, num_warps=4, num_stages=1,
        )
    return qo, ko
