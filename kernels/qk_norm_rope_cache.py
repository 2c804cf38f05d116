"""From the qkv projection to attention's inputs in one launch: per-head q/k RMSNorm, neox RoPE and the paged KV write.

Unfused, a decode layer's attention prologue is five to seven launches (q and k norms, each after a copy of its
strided view, rotary, a copy of ``v``, the cache write), each a few microseconds of a CUDA-graph replay for almost no
work. `qk_norm_rope_cache` does the same arithmetic in one: the normed heads are rounded to the activation dtype
before they rotate, and the rotated keys before they are scaled into an FP8 cache, exactly as the chain of
`ember.kernels.norm.rms_norm`, `ember.kernels.rotary.rotary_neox` and `ember.kernels.attention.reshape_and_cache`
round them (reference: `ember.kernels.reference_ops.qk_norm_rope_cache`).

Grid ``(T, q head blocks + kv head blocks)``: a program takes ``BLOCK_H`` query heads of one token (normed, rotated,
written to the contiguous query output) or ``BLOCK_H`` KV heads (keys normed and rotated, values as they are, both
written at the token's slot; slot ``-1``, a padding row, writes nothing). Nothing depends on device values, so the
call can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normed_rotated(x_ptr, stride_xt, stride_xh, t, heads, hmask, w_ptr, eps, cos, sin,
                    HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROT: tl.constexpr, HEAD_SIZE: tl.constexpr,
                    TAIL_PAD: tl.constexpr, HAS_NORM: tl.constexpr, OFFSET: tl.constexpr):
    """``BLOCK_H`` heads of token ``t``, each normed over all its ``HEAD_SIZE`` channels (rounded to the input dtype)
    and its first ``ROT`` channels rotated: the rotated halves and the tail (channels past ``ROT``), in fp32."""
    offs_r = tl.arange(0, HALF_PAD)
    rmask = offs_r < HALF
    m = hmask[:, None] & rmask[None, :]
    row = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    x1 = tl.load(row + offs_r[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + offs_r[None, :], mask=m, other=0.0).to(tl.float32)
    offs_tail = ROT + tl.arange(0, TAIL_PAD if TAIL_PAD > 0 else 1)
    tmask = hmask[:, None] & (offs_tail < HEAD_SIZE)[None, :]
    if TAIL_PAD > 0:
        x3 = tl.load(row + offs_tail[None, :], mask=tmask, other=0.0).to(tl.float32)
    else:
        x3 = tl.zeros((x1.shape[0], 1), dtype=tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if TAIL_PAD > 0:
            ss += tl.sum(x3 * x3, axis=1)
        r = tl.rsqrt(ss / HEAD_SIZE + eps)[:, None]
        w1 = tl.load(w_ptr + offs_r, mask=rmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_r, mask=rmask, other=0.0).to(tl.float32)[None, :]
        w3 = tl.load(w_ptr + offs_tail, mask=offs_tail < HEAD_SIZE, other=0.0).to(tl.float32)[None, :]
        if OFFSET:
            w1, w2, w3 = 1.0 + w1, 1.0 + w2, 1.0 + w3
        dt = x_ptr.dtype.element_ty
        x1 = (x1 * r * w1).to(dt).to(tl.float32)
        x2 = (x2 * r * w2).to(dt).to(tl.float32)
        x3 = (x3 * r * w3).to(dt).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    return o1, o2, x3, m, offs_tail, tmask


@triton.jit
def _store_heads(base, o1, o2, o3, m, offs_tail, tmask,
                 HALF: tl.constexpr, TAIL_PAD: tl.constexpr):
    """Store a ``[BLOCK_H, HEAD_SIZE]`` block (``base`` points at each head's first channel) in ``base``'s dtype."""
    offs_r = tl.arange(0, o1.shape[1])
    ty = base.dtype.element_ty
    tl.store(base + offs_r[None, :], o1.to(ty), mask=m)
    tl.store(base + HALF + offs_r[None, :], o2.to(ty), mask=m)
    if TAIL_PAD > 0:
        tl.store(base + offs_tail[None, :], o3.to(ty), mask=tmask)


@triton.jit
def _qk_norm_rope_cache_kernel(
    pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, qo_ptr, k_cache_ptr, v_cache_ptr, cs_ptr, qw_ptr, kw_ptr,
    eps, k_scale, v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh, stride_cs,
    stride_kc0, stride_kc1, stride_kc2, stride_vc0, stride_vc1, stride_vc2,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROT: tl.constexpr, HEAD_SIZE: tl.constexpr,
    TAIL_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr, OFFSET: tl.constexpr, USE_SCALE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, HALF_PAD)
    cos = tl.load(cs_ptr + pos * stride_cs + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)
    if hb < q_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < num_q_heads
        o1, o2, o3, m, offs_tail, tmask = _normed_rotated(
            q_ptr, stride_qt, stride_qh, t, heads, hmask, qw_ptr, eps, cos, sin,
            HALF, HALF_PAD, ROT, HEAD_SIZE, TAIL_PAD, HAS_NORM, OFFSET)
        _store_heads(qo_ptr + t * stride_qot + heads[:, None] * stride_qoh, o1, o2, o3, m, offs_tail, tmask,
                     HALF, TAIL_PAD)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        heads = (hb - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < tl.where(slot >= 0, num_kv_heads, 0)  # a padding row writes nothing
        o1, o2, o3, m, offs_tail, tmask = _normed_rotated(
            k_ptr, stride_kt, stride_kh, t, heads, hmask, kw_ptr, eps, cos, sin,
            HALF, HALF_PAD, ROT, HEAD_SIZE, TAIL_PAD, HAS_NORM, OFFSET)
        kdt = k_ptr.dtype.element_ty
        o1, o2, o3 = o1.to(kdt).to(tl.float32), o2.to(kdt).to(tl.float32), o3.to(kdt).to(tl.float32)
        if USE_SCALE:
            o1, o2, o3 = o1 / k_scale, o2 / k_scale, o3 / k_scale
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        _store_heads(k_cache_ptr + blk * stride_kc0 + off * stride_kc1 + heads[:, None] * stride_kc2,
                     o1, o2, o3, m, offs_tail, tmask, HALF, TAIL_PAD)
        offs_d = tl.arange(0, HEAD_PAD)
        vm = hmask[:, None] & (offs_d < HEAD_SIZE)[None, :]
        v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=vm, other=0.0)
        if USE_SCALE:
            v = v.to(tl.float32) / v_scale
        tl.store(v_cache_ptr + blk * stride_vc0 + off * stride_vc1 + heads[:, None] * stride_vc2 + offs_d[None, :],
                 v.to(v_cache_ptr.dtype.element_ty), mask=vm)


def qk_norm_rope_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float | None = None,
    v_scale: float | None = None,
    *,
    offset: bool = False,
    block_h: int = 4,
) -> torch.Tensor:
    """The rotated (and, with ``q_weight``/``k_weight``, per-head RMS-normed) queries ``[T, Hq, D]``, a new contiguous
    tensor; the keys, normed and rotated the same way, and the values written into the ``[blocks, block_size, Hkv,
    D]`` caches at ``slot_mapping`` (``-1`` skips), divided by ``k_scale``/``v_scale`` first for an FP8 cache.

    ``q``/``k``/``v`` may be strided views (e.g. of one fused qkv output) with contiguous heads. ``offset``: the
    zero-centred norm (weights apply as ``1 + w``). Only the first ``cos_sin_cache.shape[1]`` channels rotate."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1 or x.stride(1) < x.shape[2]:
            raise ValueError(f"{name}: each head's channels must be contiguous, got strides {x.stride()}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight go together")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV caches' head channels must be contiguous")
    num_tokens, hq, d = q.shape
    hkv = k.shape[1]
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    q_out = torch.empty((num_tokens, hq, d), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    use_scale = k_scale is not None or v_scale is not None
    grid = (num_tokens, triton.cdiv(hq, block_h) + triton.cdiv(hkv, block_h))
    _qk_norm_rope_cache_kernel[grid](
        positions, slot_mapping, q, k, v, q_out, k_cache, v_cache, cos_sin_cache,
        q_weight if q_weight is not None else q, k_weight if k_weight is not None else k,
        float(eps), float(k_scale if k_scale is not None else 1.0), float(v_scale if v_scale is not None else 1.0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), hq, hkv,
        HALF=half, HALF_PAD=triton.next_power_of_2(half), ROT=rot, HEAD_SIZE=d,
        TAIL_PAD=triton.next_power_of_2(d - rot) if d > rot else 0, HEAD_PAD=triton.next_power_of_2(d), BLOCK_H=block_h,
        BLOCK_SIZE=k_cache.shape[1], HAS_NORM=q_weight is not None, OFFSET=offset, USE_SCALE=use_scale,
        num_warps=4, num_stages=1,
    )
    return q_out
