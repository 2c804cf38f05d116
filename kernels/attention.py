"""Triton paged attention over Ember's KV cache: the CUDA path behind the signatures of `kernels.reference`.

KV layout (chosen for coalesced loads): per layer, ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size,
num_kv_heads, head_dim]`` ("NHD", as vLLM's flash layout). One token's head row is ``head_dim`` contiguous elements
(256 B for hd 128 in bf16), so a K/V tile of ``TILE`` tokens x ``head_dim`` is ``TILE`` fully coalesced row reads even
when consecutive tokens sit in different physical blocks. Strides are kernel arguments, so any permutation of the
cache (e.g. HND) works without changing the API. The cache may be bf16, fp16 or FP8 e4m3 with per-tensor scales
(stored value = real value / scale; loads multiply the scale back in before the matmul in Q's dtype).

Kernels:
- ``reshape_and_cache``: one program per new token writes all its K/V heads at ``slot_mapping[t]``; slot ``-1``
  (CUDA-graph or batch padding) writes nothing.
- ``_unified_attention_2d``: grid ``(q_blocks, num_kv_heads)`` in the style of vLLM's unified attention. Each program
  takes ``BLOCK_Q`` query tokens of one sequence times the ``group = Hq / Hkv`` query heads of one KV head, packed into
  ``BLOCK_M = BLOCK_Q * group`` rows, so even a one-token decode is an M=16 ``tl.dot``. It walks the sequence's KV
  tiles through the block table with an fp32 online softmax and the causal rule ``key_pos <= context_len + q_pos``
  (``context_len = seq_len - query_len``), which serves prefill, chunked prefill, prefix-cached prefill and decode
  alike. ``q_blocks = T // BLOCK_Q + B`` is a static upper bound (CUDA-graph safe); surplus programs exit.
- ``_unified_attention_3d`` + ``_reduce_segments``: split-KV for decode-only batches with too few programs to fill the
  GPU: each program takes one of ``NUM_SEGMENTS`` KV segments of one sequence and KV head and writes fp32 partials
  (max, exp-sum, unnormalised acc); the reduce kernel rescales and sums them. Empty segments (short sequences) write
  ``max = -inf``, ``expsum = 0`` and are weighed out.

Sliding window (``WINDOW`` constexpr, 0 = none): a query at ``pos`` sees keys ``pos - WINDOW < key_pos <= pos``; the
2D kernel starts at the first tile its first query's window touches and the split-KV kernel divides only the tiles
that overlap the window among its segments, so tiles wholly outside are never loaded. Sinks (``HAS_SINKS``, gpt-oss):
one logit per query head added to the softmax denominator only, ``exp(sink - m)`` against the running max in the 2D
kernel and against the common max of the segments in the reduce. Soft-cap (``SOFTCAP`` constexpr, Gemma 2's
``attn_logit_softcapping``): each scaled score becomes ``c * tanh(s / c)`` before the mask, ``c`` a runtime argument.
Chunked attention (``CHUNK`` constexpr, Llama 4's ``attention_chunk_size``): a query at ``pos`` sees keys
``(pos // CHUNK) * CHUNK <= key_pos <= pos``; as with a window, tiles before the first query's chunk are skipped.

Dispatch (``paged_attention``): split-KV when ``max_seqlen_q == 1`` and ``num_seqs * num_kv_heads`` is at most
``SPLIT_KV_MAX_PROGRAMS`` (128, about one wave of an H200's 132 SMs), the 2D kernel otherwise. Nothing depends on
device values, so calls can be captured in CUDA graphs.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SPLIT_KV_MAX_PROGRAMS = 128
"""Largest ``num_seqs * num_kv_heads`` of a decode-only batch that still takes the split-KV path."""

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_DEFAULT_TILE_PREFILL = 16 if _INTERPRET else 32
_DECODE_TILE_2D = 16 if _INTERPRET else 64
_DECODE_TILE_SPLIT = 16 if _INTERPRET else 32
"""KV tokens per inner step of a 16-bit decode, from an H200 sweep (2026-12-04, 32 q / 8 kv heads, hd 128, CUDA-graph
replays): the 2D kernel reads 4.0 TB/s with 64-token tiles at B=64, ctx=4k (2.3 with 16, 3.4 with 32); split-KV
segments are short, and 32 is best or within 2% of best at B=1, 8 and 16. fp32 (IEEE FMA products) keeps 16, as
does split-KV over an FP8 cache."""
_TILE_FP32 = 16
_SPLIT_TARGET_PROGRAMS = 512
_SEGMENTS_MIN, _SEGMENTS_MAX = (4, 4) if _INTERPRET else (8, 64)
"""Split-KV segments per sequence: enough for about 512 programs (4 per SM of an H200), within these bounds. The
same sweep: B=1 (8 programs per segment) is fastest with 64 segments (35 us at ctx=16k against 97 with 16), B=8 and
B=16 with 8."""
_DEFAULT_BLOCK_M_PREFILL = 16 if _INTERPRET else 64
"""Query rows per 2D program when a bf16/fp16 batch has a prefill: 64 makes Hopper use wgmma (16 compiles to
mma.sync) without spilling at 4 warps (128 spills); the interpreter keeps 16 for speed. Decode-only batches use 16
(one query row per sequence and head of the group), as fp32 (IEEE, FMA matmuls: 16 rows and 16-key tiles)."""
_NUM_WARPS = 4
_NUM_STAGES = 3
_WIDE_HEAD = 512
_WIDE_GROUP = 16
"""From a padded head size of ``_WIDE_HEAD`` (DeepSeek's latent attention: 576 padded to 1024) a program takes at most
``_WIDE_GROUP`` query heads (a larger GQA group is split over launches), 16-token KV tiles, one stage and 8 warps:
with the usual tiles a 16-head prefill needs 393 KB of shared memory and a 128-head group far more, where an sm_90
block has 232 KB (compiled for sm_90: 16 heads then take 98 KB, and 8 warps hold the 1024-wide accumulator without
spilling)."""


# --------------------------------------------------------------------------------------------------------------------
# KV write


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale, v_scale,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kc0, stride_kc1, stride_kc2, stride_kc3,
    stride_vc0, stride_vc1, stride_vc2, stride_vc3,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_HD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_SCALE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs = tl.arange(0, BLOCK_HD)
    h = offs // HEAD_SIZE
    d = offs % HEAD_SIZE
    mask = offs < NUM_KV_HEADS * HEAD_SIZE
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + h * stride_kh + d * stride_kd, mask=mask, other=0.0)
    v = tl.load(value_ptr + t64 * stride_vt + h * stride_vh + d * stride_vd, mask=mask, other=0.0)
    if USE_SCALE:
        k = k.to(tl.float32) / k_scale
        v = v.to(tl.float32) / v_scale
    kc = k_cache_ptr + blk * stride_kc0 + off * stride_kc1 + h * stride_kc2 + d * stride_kc3
    vc = v_cache_ptr + blk * stride_vc0 + off * stride_vc1 + h * stride_vc2 + d * stride_vc3
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``slot_mapping`` ``[T]``; slot ``-1`` is skipped.

    With an FP8 cache the values are divided by the per-tensor scales before the cast (as the reference).
    """
    num_tokens, hkv, d = key.shape
    if num_tokens == 0:
        return
    use_scale = k_scale is not None or v_scale is not None
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        float(k_scale if k_scale is not None else 1.0), float(v_scale if v_scale is not None else 1.0),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=hkv, HEAD_SIZE=d, BLOCK_HD=triton.next_power_of_2(hkv * d), BLOCK_SIZE=k_cache.shape[1],
        USE_SCALE=use_scale, num_warps=4, num_stages=1,
    )


# --------------------------------------------------------------------------------------------------------------------
# Attention


@triton.jit
def _find_seq_idx(cu_seqlens_q_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose q-block range ``[cu[s] // BLOCK_Q + s, ...)`` holds q-block ``target`` (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _soft_capped(s, cap):
    """``cap * tanh(s / cap)``, with tanh as ``1 - 2 / (exp(2x) + 1)`` (exact at both ends: exp overflows to inf)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q,
    k_cache_ptr, v_cache_ptr, block_table_ptr, seq_idx, stride_bt,
    kv_head, query_pos, query_mask, context_len, prefix_len,
    tile_start, tile_end, softmax_scale, k_scale, v_scale, softcap,
    stride_kc0, stride_kc1, stride_kc2, stride_kc3,
    stride_vc0, stride_vc1, stride_vc2, stride_vc3,
    offs_d, dim_mask,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, CHUNK: tl.constexpr, MASKED: tl.constexpr,
):
    """Online-softmax accumulation of tiles ``[tile_start, tile_end)`` of one sequence's KV for one KV head; with
    ``WINDOW > 0`` a query at ``pos`` sees only keys ``pos - WINDOW < key_pos <= pos``, with ``CHUNK > 0`` only
    keys of its own chunk; with ``SOFTCAP`` the scores are soft-capped at ``softcap``. The running max ``m_i`` is in
    log2 units (scores times ``log2(e)``, so the exponentials are ``exp2``): callers convert it back once
    (:func:`_natural_max`). ``MASKED=False`` is for tiles every query of the block sees whole (before the causal
    diagonal, inside the sequence, no window or chunk): no key, causal or query masks."""
    offs_t = tl.arange(0, TILE)
    bt_row = block_table_ptr + seq_idx.to(tl.int64) * stride_bt
    if SOFTCAP:
        qk_scale = softmax_scale
    else:
        qk_scale = softmax_scale * 1.4426950408889634
    for j in range(tile_start, tile_end):
        kpos = j * TILE + offs_t
        kmask = kpos < prefix_len
        if MASKED:
            blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + kpos // BLOCK_SIZE).to(tl.int64)
        inblk = (kpos % BLOCK_SIZE).to(tl.int64)
        k_off = blk[None, :] * stride_kc0 + inblk[None, :] * stride_kc1 + kv_head * stride_kc2 + offs_d[:, None] * stride_kc3
        v_off = blk[:, None] * stride_vc0 + inblk[:, None] * stride_vc1 + kv_head * stride_vc2 + offs_d[None, :] * stride_vc3
        if MASKED:
            k_raw = tl.load(k_cache_ptr + k_off, mask=dim_mask[:, None] & kmask[None, :], other=0.0)
            v_raw = tl.load(v_cache_ptr + v_off, mask=kmask[:, None] & dim_mask[None, :], other=0.0)
        else:
            k_raw = tl.load(k_cache_ptr + k_off, mask=dim_mask[:, None], other=0.0)
            v_raw = tl.load(v_cache_ptr + v_off, mask=dim_mask[None, :], other=0.0)
        if k_raw.dtype.is_fp8():
            k = (k_raw.to(tl.float32) * k_scale).to(q.dtype)
            v = (v_raw.to(tl.float32) * v_scale).to(q.dtype)
        else:
            k = k_raw.to(q.dtype)
            v = v_raw.to(q.dtype)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        if SOFTCAP:
            s = _soft_capped(s, softcap) * 1.4426950408889634
        if MASKED:
            causal = kpos[None, :] < context_len + query_pos[:, None] + 1
            if WINDOW > 0:
                causal = causal & (kpos[None, :] > context_len + query_pos[:, None] - WINDOW)
            if CHUNK > 0:
                causal = causal & (kpos[None, :] >= (context_len + query_pos[:, None]) // CHUNK * CHUNK)
            s = tl.where(query_mask[:, None] & kmask[None, :] & causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _natural_max(m_i):
    """A running max from :func:`_attend_tiles` (log2 units) in the scores' own units (-inf stays -inf)."""
    return m_i * 0.6931471805599453


@triton.jit
def _unified_attention_2d(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr,
    num_seqs, softmax_scale, k_scale, v_scale, softcap,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kc0, stride_kc1, stride_kc2, stride_kc3,
    stride_vc0, stride_vc1, stride_vc2, stride_vc3,
    stride_bt,
    GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, SOFTCAP: tl.constexpr, CHUNK: tl.constexpr,
    WHOLE_TILES: tl.constexpr = False,
):
    """One program per (block of BLOCK_Q query positions x GROUP heads, KV head). ``WHOLE_TILES`` (prefill): the tiles
    every query of the block sees whole run without masks, in a loop of their own (about a third fewer instructions
    per tile for sm_90; a decode launch keeps the one masked loop, whose registers stay lower)."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_idx = _find_seq_idx(cu_seqlens_q_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
    query_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq_idx)
    if local_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    dim_mask = offs_d < HEAD_SIZE
    query_pos = local_block * BLOCK_Q + offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    query_mask = query_pos < query_len
    tok = (q_start + query_pos).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=query_mask[:, None] & dim_mask[None, :], other=0.0,
    )

    # keys up to the last query of this block (causal), never past the sequence
    prefix_len = tl.minimum(context_len + local_block * BLOCK_Q + (BLOCK_M - 1) // GROUP + 1, seq_len)
    num_tiles = tl.cdiv(prefix_len, TILE)
    first_tile = 0
    if WINDOW > 0:  # tiles wholly before the first query's window are skipped, not masked
        first_tile = tl.maximum(context_len + local_block * BLOCK_Q - WINDOW + 1, 0) // TILE
    if CHUNK > 0:  # and those before its chunk
        first_tile = tl.maximum(first_tile, (context_len + local_block * BLOCK_Q) // CHUNK * CHUNK // TILE)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    whole_end = first_tile  # tiles before the block's first query's own position are seen whole by every query
    if WHOLE_TILES and WINDOW == 0 and CHUNK == 0:
        whole_end = tl.minimum((context_len + local_block * BLOCK_Q + 1) // TILE, num_tiles)
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_idx, stride_bt,
            kv_head, query_pos, query_mask, context_len, prefix_len, first_tile, whole_end, softmax_scale, k_scale,
            v_scale, softcap,
            stride_kc0, stride_kc1, stride_kc2, stride_kc3, stride_vc0, stride_vc1, stride_vc2, stride_vc3,
            offs_d, dim_mask, BLOCK_SIZE, TILE, PRECISION, WINDOW, SOFTCAP, CHUNK, False,
        )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_idx, stride_bt,
        kv_head, query_pos, query_mask, context_len, prefix_len, whole_end, num_tiles, softmax_scale, k_scale,
        v_scale, softcap,
        stride_kc0, stride_kc1, stride_kc2, stride_kc3, stride_vc0, stride_vc1, stride_vc2, stride_vc3,
        offs_d, dim_mask, BLOCK_SIZE, TILE, PRECISION, WINDOW, SOFTCAP, CHUNK, True,
    )
    m_i = _natural_max(m_i)
    if HAS_SINKS:  # the sink's exp joins the denominator only
        sink = tl.load(sinks_ptr + q_head, mask=query_mask, other=0.0).to(tl.float32)
        l_i = l_i + tl.where(m_i > float("-inf"), tl.exp(sink - m_i), 0.0)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty), mask=query_mask[:, None] & dim_mask[None, :],
    )


@triton.jit
def _unified_attention_3d(
    q_ptr, k_cache_ptr, v_cache_ptr, segm_out_ptr, segm_max_ptr, segm_sum_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr,
    softmax_scale, k_scale, v_scale, softcap,
    stride_qt, stride_qh, stride_qd,
    stride_kc0, stride_kc1, stride_kc2, stride_kc3,
    stride_vc0, stride_vc1, stride_vc2, stride_vc3,
    stride_bt, num_q_heads,
    GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, CHUNK: tl.constexpr,
):
    """Decode only (every query_len <= 1): program (seq, kv_head, segment); partials go to ``segm_*[tok, head, seg]``."""
    seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
    query_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
    if query_len == 0:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    dim_mask = offs_d < HEAD_SIZE
    query_pos = offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    query_mask = (query_pos < query_len) & (offs_m < GROUP)
    tok = (q_start + query_pos).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=query_mask[:, None] & dim_mask[None, :], other=0.0,
    )
    prefix_len = tl.maximum(seq_len, 0)
    num_tiles = tl.cdiv(prefix_len, TILE)
    first_tile = 0
    if WINDOW > 0:  # the segments split only the tiles that overlap the window
        first_tile = tl.maximum(seq_len - WINDOW, 0) // TILE
    if CHUNK > 0:  # or the query's chunk
        first_tile = tl.maximum(first_tile, tl.maximum(seq_len - 1, 0) // CHUNK * CHUNK // TILE)
    tiles_per_segment = tl.cdiv(num_tiles - first_tile, NUM_SEGMENTS)
    tile_start = first_tile + segment * tiles_per_segment
    tile_end = tl.minimum(tile_start + tiles_per_segment, num_tiles)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    whole_end = tile_start  # tiles before the query's position are seen whole (decode: one query per sequence)
    if WINDOW == 0 and CHUNK == 0:
        whole_end = tl.maximum(tl.minimum(seq_len // TILE, tile_end), tile_start)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_idx, stride_bt,
        kv_head, query_pos, query_mask, context_len, prefix_len, tile_start, whole_end, softmax_scale,
        k_scale, v_scale, softcap,
        stride_kc0, stride_kc1, stride_kc2, stride_kc3, stride_vc0, stride_vc1, stride_vc2, stride_vc3,
        offs_d, dim_mask, BLOCK_SIZE, TILE, PRECISION, WINDOW, SOFTCAP, CHUNK, False,
    )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_idx, stride_bt,
        kv_head, query_pos, query_mask, context_len, prefix_len, whole_end, tile_end, softmax_scale,
        k_scale, v_scale, softcap,
        stride_kc0, stride_kc1, stride_kc2, stride_kc3, stride_vc0, stride_vc1, stride_vc2, stride_vc3,
        offs_d, dim_mask, BLOCK_SIZE, TILE, PRECISION, WINDOW, SOFTCAP, CHUNK, True,
    )
    # a segment with no visible key keeps m = -inf, l = 0 (the reduce weighs it out)
    m_i = tl.where(l_i > 0.0, _natural_max(m_i), float("-inf"))
    row = (tok * num_q_heads + q_head) * NUM_SEGMENTS + segment
    tl.store(segm_max_ptr + row, m_i, mask=query_mask)
    tl.store(segm_sum_ptr + row, l_i, mask=query_mask)
    tl.store(
        segm_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], acc,
        mask=query_mask[:, None] & dim_mask[None, :],
    )


@triton.jit
def _reduce_segments(
    out_ptr, segm_out_ptr, segm_max_ptr, segm_sum_ptr, cu_seqlens_q_ptr, sinks_ptr, num_q_heads,
    stride_ot, stride_oh, stride_od,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
    if tl.load(cu_seqlens_q_ptr + seq_idx + 1) == q_start:
        return
    tok = q_start.to(tl.int64)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_PAD)
    dim_mask = offs_d < HEAD_SIZE
    rows = (tok * num_q_heads + head) * NUM_SEGMENTS + offs_s
    seg_max = tl.load(segm_max_ptr + rows)
    seg_sum = tl.load(segm_sum_ptr + rows)
    top = tl.max(seg_max, axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)
    w = tl.where(seg_max > float("-inf"), tl.exp(seg_max - top), 0.0)
    total = tl.sum(seg_sum * w, axis=0)
    if HAS_SINKS:  # rescaled to the common max like the segments' sums
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        total = total + tl.where(tl.max(seg_max, axis=0) > float("-inf"), tl.exp(sink - top), 0.0)
    acc = tl.load(segm_out_ptr + rows[:, None] * HEAD_PAD + offs_d[None, :],
                  mask=(w > 0.0)[:, None] & dim_mask[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0)
    o = o / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


def default_segments(programs: int) -> int:
    """Split-KV segments for a decode batch of ``programs`` (sequences x KV heads): a power of two."""
    want = triton.next_power_of_2(max(1, -(-_SPLIT_TARGET_PROGRAMS // max(programs, 1))))
    return min(max(want, _SEGMENTS_MIN), _SEGMENTS_MAX)


def _block_m(group: int) -> int:
    return max(16, triton.next_power_of_2(group))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    k_scale: float | None = None,
    v_scale: float | None = None,
    *,
    split_kv: bool | None = None,
    num_segments: int | None = None,
    tile_size: int | None = None,
    block_m: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of ``q`` ``[T, Hq, D]`` over the paged cache into ``out`` ``[T, Hq, D]`` (see module doc).

    Same contract as ``reference.paged_attention``. ``split_kv`` forces (True) or forbids (False) the split-KV decode
    path, which needs ``max_seqlen_q <= 1``; ``None`` dispatches by batch shape. ``num_segments`` (a power of two),
    ``tile_size`` (KV tokens per inner step, a power of two >= 16) and ``block_m`` (query rows per 2D program, a power
    of two >= max(16, group)) override the defaults; ``max_seqlen_k`` is unused. ``sliding_window`` (None:
    unlimited), ``sinks`` ``[Hq]`` (None: none), ``softcap`` and ``chunk`` (None: none) as in the reference; KV tiles
    wholly outside the window or the chunk are skipped. ``num_warps`` / ``num_stages`` override the launch defaults
    (4 warps, 3 stages; a head padded to ``_WIDE_HEAD`` or more, without a ``block_m``, takes the small tiles and the
    group split documented there).
    """
    del max_seqlen_k
    num_tokens, hq, d = q.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    hkv = k_cache.shape[2]
    group = hq // hkv
    block_size = k_cache.shape[1]
    head_pad = max(16, triton.next_power_of_2(d))  # tl.dot needs K >= 16; the padded channels are masked
    wide = head_pad >= _WIDE_HEAD and block_m is None
    if wide and group > _WIDE_GROUP:
        for j in range(hkv):  # one KV head and up to _WIDE_GROUP of its query heads per launch
            for h0 in range(j * group, (j + 1) * group, _WIDE_GROUP):
                h1 = min(h0 + _WIDE_GROUP, (j + 1) * group)
                paged_attention(
                    q[:, h0:h1], k_cache[:, :, j:j + 1], v_cache[:, :, j:j + 1], out[:, h0:h1], cu_seqlens_q,
                    seq_lens, block_table, max_seqlen_q, 0, softmax_scale, k_scale, v_scale,
                    split_kv=split_kv, num_segments=num_segments, tile_size=tile_size, sliding_window=sliding_window,
                    sinks=None if sinks is None else sinks[h0:h1], softcap=softcap, chunk=chunk,
                    num_warps=num_warps, num_stages=num_stages)
        return out
    decode_only = max_seqlen_q <= 1
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 models get fp32 matmuls, not TF32
    small_m = decode_only or precision == "ieee"
    block_m = block_m or (_block_m(group) if small_m or wide else max(_DEFAULT_BLOCK_M_PREFILL, _block_m(group)))
    if block_m < group or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two >= the GQA group size {group}")
    ks = float(k_scale if k_scale is not None else 1.0)
    vs = float(v_scale if v_scale is not None else 1.0)
    warps = num_warps or (8 if wide else _NUM_WARPS)
    # fp32 decode (fp32 models, for parity): 2 stages; 3 spilled 8 bytes for sm_100 at GQA 8 (Triton 3.9)
    stages = num_stages or (1 if wide else 2 if precision == "ieee" and decode_only else _NUM_STAGES)
    if wide:
        tile_size = tile_size or 16
    if split_kv is None:
        split_kv = decode_only and num_seqs * hkv <= SPLIT_KV_MAX_PROGRAMS
    if split_kv and not decode_only:
        raise ValueError("split-KV attention needs a decode-only batch (max_seqlen_q <= 1)")
    window = int(sliding_window or 0)
    if window < 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    has_sinks = sinks is not None
    if has_sinks and tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must have one logit per query head ({hq}), got shape {tuple(sinks.shape)}")
    sinks_arg = sinks.contiguous() if has_sinks else q
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    cap = float(softcap or 0.0)
    chunk_size = int(chunk or 0)
    if chunk_size < 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    common_strides = (*k_cache.stride(), *v_cache.stride(), block_table.stride(0))

    fp32 = precision == "ieee"
    if split_kv:
        fp8 = k_cache.element_size() == 1  # 32-token split tiles spill in an sm_90 fp8 build (hd 64, group 1)
        tile = tile_size or (_TILE_FP32 if fp32 or fp8 else _DECODE_TILE_SPLIT)
        segs = num_segments or default_segments(num_seqs * hkv)
        segm_out = torch.empty(num_tokens, hq, segs, head_pad, dtype=torch.float32, device=q.device)
        segm_max = torch.empty(num_tokens, hq, segs, dtype=torch.float32, device=q.device)
        segm_sum = torch.empty(num_tokens, hq, segs, dtype=torch.float32, device=q.device)
        _unified_attention_3d[(num_seqs, hkv, segs)](
            q, k_cache, v_cache, segm_out, segm_max, segm_sum, cu_seqlens_q, seq_lens, block_table,
            float(softmax_scale), ks, vs, cap, *q.stride(), *common_strides, hq,
            GROUP=group, HEAD_SIZE=d, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, BLOCK_M=_block_m(group), TILE=tile,
            NUM_SEGMENTS=segs, PRECISION=precision, WINDOW=window, SOFTCAP=cap > 0, CHUNK=chunk_size,
            num_warps=warps, num_stages=stages,
        )
        _reduce_segments[(num_seqs, hq)](
            out, segm_out, segm_max, segm_sum, cu_seqlens_q, sinks_arg, hq, *out.stride(),
            HEAD_SIZE=d, HEAD_PAD=head_pad, NUM_SEGMENTS=segs, HAS_SINKS=has_sinks, num_warps=8 if wide else 4,
            num_stages=1,
        )
        return out

    tile = tile_size or (_TILE_FP32 if fp32 else _DECODE_TILE_2D if decode_only else _DEFAULT_TILE_PREFILL)
    block_q = block_m // group
    num_q_blocks = num_tokens // block_q + num_seqs
    _unified_attention_2d[(num_q_blocks, hkv)](
        q, k_cache, v_cache, out, sinks_arg, cu_seqlens_q, seq_lens, block_table,
        num_seqs, float(softmax_scale), ks, vs, cap, *q.stride(), *out.stride(), *common_strides,
        GROUP=group, HEAD_SIZE=d, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q,
        TILE=tile, PRECISION=precision, WINDOW=window, HAS_SINKS=has_sinks, SOFTCAP=cap > 0, CHUNK=chunk_size,
        WHOLE_TILES=not decode_only, num_warps=warps, num_stages=stages,
    )
    return out
