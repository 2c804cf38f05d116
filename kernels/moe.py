"""Triton fused mixture of experts, and the dense NVFP4 linear through the same grouped GEMM.

Design (vLLM's ``fused_moe_kernel``, reimplemented):
1. routing (the model's): softmax fp32, top-k, optional renormalisation, one launch on the Triton path
   (:func:`ember.kernels.moe_routing.softmax_topk`; reference :func:`ember.kernels.moe_reference.topk_routing`);
2. :func:`moe_align_block_size` (one Triton launch, no host sync): the ``M*k`` (token, slot) pairs sorted by
   expert, each expert's group padded to a multiple of ``BLOCK_M`` with the sentinel ``M*k``; buffers sized to a
   static upper bound;
3. GEMM 1 (``w13``): rows gathered as ``pair // k``; gate and up tiles of the same columns are accumulated side by
   side and SiLU-and-mul is fused into the epilogue, writing ``[M*k, I]``;
4. GEMM 2 (``w2``): rows are the pairs themselves, scaled by their routing weight in the epilogue, written
   ``[M*k, H]`` (fp32) and summed over ``k`` into the activation dtype by one more launch (:func:`_combine`, the
   weighted combine).

Weights are bf16/fp16/fp32 stacks (``w13 [E, 2I, H]``, ``w2 [E, H, I]``), block-scaled FP8 stacks
(:class:`ember.kernels.fp8_block.FP8BlockTensor`: e4m3 bytes read as int32 words, decoded two per integer op into
fp16 bit patterns (:func:`_e4m3_words`) and scaled per block inside the kernel, W8A16) or NVFP4 stacks
(:class:`ember.kernels.nvfp4.NVFP4Tensor`) dequantized inside the kernel (W4A16): per K step the packed bytes, as
``[BLOCK_N, BLOCK_K/8]`` int32 words, and the ``[BLOCK_N, BLOCK_K/16]`` E4M3 block scales are loaded once, the
codes decoded two per integer op into 16-bit float bit patterns (integer ops, so no FP4/FP8 hardware support is
needed) and scaled, interleaved into the ``[BLOCK_K, BLOCK_N]`` tile in the activation dtype before ``tl.dot``; the
FP32 tensor scale is applied in the epilogue. bf16/fp16 activations decode in their own dtype, one packed multiply
per two elements (:func:`_e2m1_words_16`, the tile is the weights times ``2**-14`` until the epilogue); fp32
activations through float32 (:func:`_e2m1_words`). MXFP4 stacks
(:class:`ember.kernels.mxfp4.MXFP4Tensor`, gpt-oss) take the same path with ``SCALE_E8M0``: one E8M0 scale per 32
(the byte is the float32 exponent), no tensor scale. gpt-oss also adds per-expert biases in both epilogues and
replaces SiLU-and-mul by its clamped GLU (``CLAMPED_SWIGLU``). This uses only Triton features present in 3.6 and
supported by the interpreter.

On Blackwell (capability >= 10.0) :func:`fused_moe_nvfp4` can instead run W4A4: activations quantized per 16
(:func:`ember.kernels.nvfp4.quantize_activations`) and ``tl.dot_scaled(a, a_s, "e2m1", b, b_s, "e2m1")``. Triton's
interpreter (3.9) decodes E4M3 ``dot_scaled`` scales as E8M0, so that path is only checked where
:func:`dot_scaled_nvfp4_works` says the installed Triton computes it correctly.
"""
from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from typing import Iterator

import torch
import triton
import triton.language as tl

from ember.kernels import moe_align, mxfp4, nvfp4
from ember.kernels.fp8_block import FP8BlockTensor
from ember.kernels.moe_reference import silu_and_mul
from ember.kernels.mxfp4 import MXFP4Tensor
from ember.kernels.nvfp4 import NVFP4Tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of one grouped-GEMM launch."""

    block_m: int = 16
    block_n: int = 32
    block_k: int = 32
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 1
    """K split over this many programs per output tile, each writing a float32 partial: a dense linear's are summed
    by one more launch (:func:`_combine`); the MoE's gate/up partials by one more launch that also applies the GLU,
    its down partials by the combine it runs anyway. Small-M decode is latency-bound (a few tiles, each walking all
    of K)."""


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_config(
    num_tokens: int, num_experts: int, top_k: int, device: torch.device, *, nvfp4: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> GemmConfig:
    """Fixed configs (no autotune): small tiles in the interpreter, vLLM's H200 ``E=128,N=768`` shape table on GPU.

    Keyed by ``num_tokens``, the batch's token count M (as vLLM's tables), not by the ``M*k`` routed pairs.

    ``nvfp4`` (W4A16 weights dequantized in the kernel): the decoded tile lives in registers next to the
    accumulators, so at most 2 pipeline stages and 8 warps for the 64-row tile (the choices that compile without
    spills for sm_90 and sm_100: ``tests/moe/compile_check_moe.py``; the 32-row tile needed 1 stage before the
    decode went word-wide, and then spilled 8 bytes in 1 stage for sm_90 where 2 stages take 183 registers). At decode
    sizes (M <= 64, 16-row tiles) narrow 32 x 128 tiles in 3 stages: an H200 sweep (2026-12-04, E=128, H=2048,
    I=768, top-8, graph replays) measured them fastest of seven at M=1 (0.129 ms against 0.155 for the table's tile)
    and within 1% of the best at M=64 (0.578 against 0.723).

    fp32 activations (fp32 models) take IEEE products on FMA units and double every staged tile: tiles of at most
    32 x 64 x 64 in 2 stages stay inside Hopper's 227 KiB of shared memory (the 16-bit table needs up to 288 KiB in
    fp32) and spill nothing.

    Packed weights on a GPU with few routed pairs for the experts (``M*k*4 <= E``: most pairs have an expert to
    themselves) take one program per pair (``block_m`` 1, :func:`fused_moe`): a 16-row tile would hold one real row
    and fifteen of padding, and the routing sort that builds the tiles is a launch of its own."""
    if nvfp4 and num_tokens * top_k * 4 <= num_experts and device.type == "cuda" and not _interpreting():
        return GemmConfig(1, 32, 128, 1, 4, 3)
    cfg = _table_config(num_tokens, device)
    if dtype.itemsize >= 4:
        cfg = replace(cfg, block_m=min(cfg.block_m, 32), block_n=min(cfg.block_n, 64), block_k=min(cfg.block_k, 64),
                      num_stages=min(cfg.num_stages, 2))
    if not nvfp4:
        return cfg
    if cfg.block_m == 16 and device.type == "cuda" and not _interpreting():
        return replace(cfg, block_n=32, block_k=128, num_warps=4, num_stages=3)
    if cfg.block_m == 64:
        return replace(cfg, num_warps=8, num_stages=2)
    return replace(cfg, num_stages=min(cfg.num_stages, 2))


def block_fp8_config(cfg: GemmConfig) -> GemmConfig:
    """Block-FP8 weights: ``cfg`` (from :func:`default_config` with ``nvfp4=True``, the in-kernel-decode limits) with
    K steps of at most 64, which keep the fused gate/up GEMM free of spills for sm_100 with Triton 3.6 at 128-wide
    N tiles (``tests/moe/compile_check_moe.py``); 64 still divides the releases' 128-wide scale blocks."""
    return replace(cfg, block_k=min(cfg.block_k, 64))


def _table_config(m: int, device: torch.device) -> GemmConfig:
    if device.type != "cuda" or _interpreting():
        return GemmConfig(16, 64, 64)
    if m <= 2:
        return GemmConfig(16, 64, 64, 1, 4, 4)
    if m <= 16:
        return GemmConfig(16, 64, 128, 1, 4, 4)
    if m <= 64:
        return GemmConfig(16, 128, 128, 1, 8, 3)
    if m <= 256:
        return GemmConfig(32, 128, 128, 8, 8, 3)
    if m <= 512:
        return GemmConfig(64, 128, 64, 8, 4, 3)
    return GemmConfig(128, 128, 64, 8, 8, 3)


def linear_config(num_tokens: int, device: torch.device, n: int = 0, k: int = 0) -> GemmConfig:
    """Dense NVFP4 linear: one weight, so small-M decode needs narrow N tiles to occupy the SMs, and, given the
    weight's ``n`` x ``k``, K split (``split_k``) until about four programs per SM, each walking at least four K
    steps. (The H200 timed a 4096 x 4096 NVFP4 linear at M=1 at 0.052 ms, 128 programs of 32 K steps, where its
    bytes need 2 us: latency, not bandwidth or instructions.)"""
    if device.type != "cuda" or _interpreting() or num_tokens > 64:
        return default_config(num_tokens, 1, 1, device, nvfp4=True)
    cfg = GemmConfig(16, 32 if num_tokens <= 16 else 64, 128, 1, 4, 2)
    if num_tokens > 16 or not n or not k:
        return cfg
    return replace(cfg, split_k=_k_split(triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k), device))


def _k_split(tiles: int, steps: int, device: torch.device) -> int:
    """How many ways to split K for ``tiles`` output tiles of ``steps`` K steps: doubled while the programs stay
    within about four per SM and each keeps at least four K steps."""
    split = 1
    while tiles * split * 2 <= 4 * _num_sms(device) and steps // (split * 2) >= 4:
        split *= 2
    return split


def moe_splits(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, cfg: GemmConfig,
               device: torch.device) -> tuple[int, int]:
    """K splits of the fused MoE's gate/up and down GEMMs with packed weights at decode sizes on a GPU: one program
    row per routed pair (``block_m`` 1), or at most ``min(M*k, E)`` 16-row tiles holding pairs. At M=1 with top-8
    the gate/up GEMM of Qwen3-30B-A3B's layer has 192 programs of 16 K steps for 132 SMs, each a long chain of
    decodes and products. ``(1, 1)`` elsewhere."""
    if device.type != "cuda" or _interpreting() or cfg.block_m not in (1, 16):
        return 1, 1
    rows = num_tokens * top_k if cfg.block_m == 1 else min(num_tokens * top_k, num_experts)
    return (_k_split(rows * triton.cdiv(inter, cfg.block_n), triton.cdiv(hidden, cfg.block_k), device),
            _k_split(rows * triton.cdiv(hidden, cfg.block_n), triton.cdiv(inter, cfg.block_k), device))


@functools.lru_cache(maxsize=None)
def _sm_count(device_str: str) -> int:
    return torch.cuda.get_device_properties(torch.device(device_str)).multi_processor_count


def _num_sms(device: torch.device) -> int:
    """The device's SM count (asked once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(f"cuda:{index}")


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``M*k`` (token, slot) pairs by expert, padding each expert's group to a multiple of ``block_m``.

    Returns ``sorted_ids`` int32 ``[cap]`` (pair index ``token*k + slot``; padding is ``M*k``), ``expert_ids`` int32
    ``[cap // block_m]`` (the expert of each block of ``block_m`` rows) and ``num_tokens_post_padded`` int32 ``[1]``,
    with ``cap = roundup(M*k + E*(block_m-1), block_m)``, a static upper bound. Every shape depends only on
    ``(M, k, E, block_m)`` and nothing is read back to the host, so the call can be captured in a CUDA graph. One
    Triton launch where Triton runs (:func:`ember.kernels.moe_align.align_triton`), the torch formulation elsewhere.
    """
    if topk_ids.device.type == "cuda" or _interpreting():
        return moe_align.align_triton(topk_ids, block_m, num_experts)
    return moe_align.align_torch(topk_ids, block_m, num_experts)


@triton.jit
def _grouped_tile(pid, EM, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid``, GROUP_M row tiles walked together for L2 reuse of B tiles."""
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    return first_m + ((pid % in_group) % group_size), (pid % in_group) // group_size


@triton.jit
def _tile_rows(pid_m, sorted_ids_ptr, expert_ids_ptr, BLOCK_M: tl.constexpr, DENSE: tl.constexpr,
               PAIRS: tl.constexpr):
    """Row tile ``pid_m``'s rows (pair indices in sorted order; padding reads as ``M*k``) and its expert; ``DENSE``
    (a plain linear): rows ``pid_m * BLOCK_M ...`` in order and expert 0, no metadata read; ``PAIRS`` (one routed
    pair per program): pair ``pid_m`` and its expert, ``expert_ids`` being the flat top-k IDs."""
    if DENSE:
        return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), 0
    elif PAIRS:
        return pid_m + tl.arange(0, 1), tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    else:
        return (tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)),
                tl.load(expert_ids_ptr + pid_m).to(tl.int64))


@triton.jit
def _e4m3_to_f32(u):
    """E4M3FN bytes (as int32) -> float32, exactly: the byte's bits moved into an fp16 as :func:`_e4m3_words` does,
    times ``2**8`` (no NaN handling: scales are finite, and the NaN code reads as 480)."""
    bits = ((u << 7) & 0x3F80) | ((u << 8) & 0x8000)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _block_scale_to_f32(s, SCALE_E8M0: tl.constexpr):
    """Block-scale bytes (as int32) -> float32: the one place that knows the scale format (E4M3 per 16 for NVFP4;
    E8M0 per 32 for MXFP4: the byte is the float32 exponent field, ``2 ** (s - 127)``)."""
    if SCALE_E8M0:
        return (s << 23).to(tl.float32, bitcast=True)
    else:
        return _e4m3_to_f32(s)


@triton.jit
def _halves(bits, DTYPE: tl.constexpr):
    """The two 16-bit floats of type DTYPE (fp16 or bf16) a uint32 of bit pairs holds, low half first."""
    return ((bits & 0xFFFF).to(tl.uint16).to(DTYPE, bitcast=True),
            (bits >> 16).to(tl.uint16).to(DTYPE, bitcast=True))


@triton.jit
def _f16_pair(bits, scale, DTYPE: tl.constexpr, UNSCALE: tl.constexpr):
    """The two fp16 values a uint32 of fp16 bit pairs holds (low half first), in DTYPE, times float32 ``scale``
    (``UNSCALE``: times ``2**14`` first)."""
    lo, hi = _halves(bits, tl.float16)
    lo, hi = lo.to(tl.float32), hi.to(tl.float32)
    if UNSCALE:
        lo = lo * 16384.0
        hi = hi * 16384.0
    return (lo * scale).to(DTYPE), (hi * scale).to(DTYPE)


@triton.jit
def _e2m1_bits_16(w, BF16: tl.constexpr):
    """The four uint32s of 16-bit float bit pairs holding codes (0, 4), (1, 5), (2, 6) and (3, 7) of each word of
    packed E2M1 codes (byte ``j``: K elements ``2j`` (low nibble) and ``2j + 1``), one shift and one mask per half
    word: a code's magnitude bits become an fp16's two low exponent bits and top mantissa bit, its sign the sign
    (``BF16`` False: a normal code ``2**(e-1) * (1 + m/2)`` reads as ``2**(e-15) * (1 + m/2)`` and code 1 (0.5) as
    the subnormal ``2**-15``, so every value is the code's times ``2**-14``), or a bf16's (the code's times
    ``2**-126``)."""
    sign: tl.constexpr = 0x80008000
    if BF16:
        mag: tl.constexpr = 0x01C001C0
        return (((w << 6) & mag) | ((w << 12) & sign), ((w << 2) & mag) | ((w << 8) & sign),
                ((w >> 2) & mag) | ((w << 4) & sign), ((w >> 6) & mag) | (w & sign))
    else:
        mag16: tl.constexpr = 0x0E000E00
        return (((w << 9) & mag16) | ((w << 12) & sign), ((w << 5) & mag16) | ((w << 8) & sign),
                ((w << 1) & mag16) | ((w << 4) & sign), ((w >> 3) & mag16) | (w & sign))


@triton.jit
def _e2m1_words(w, scale, DTYPE: tl.constexpr, UNSCALE: tl.constexpr):
    """Decode uint32 words of packed E2M1 codes into the eight tensors of their elements 0..7 in DTYPE, each times
    ``scale * 2**-14`` (``UNSCALE``: ``scale``): the fp16 bit pairs of :func:`_e2m1_bits_16`, whose subnormal 0.5
    the conversion to float32 keeps, scaled in float32. Two shifts and two masks per pair of codes, against about
    ten integer ops per code for a lookup by compares."""
    p04, p15, p26, p37 = _e2m1_bits_16(w, False)
    e0, e4 = _f16_pair(p04, scale, DTYPE, UNSCALE)
    e1, e5 = _f16_pair(p15, scale, DTYPE, UNSCALE)
    e2, e6 = _f16_pair(p26, scale, DTYPE, UNSCALE)
    e3, e7 = _f16_pair(p37, scale, DTYPE, UNSCALE)
    return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def _half_pair(bits, scale16):
    """The two 16-bit floats (``scale16``'s dtype) a uint32 of bit pairs holds (low half first), times ``scale16``."""
    lo, hi = _halves(bits, scale16.dtype)
    return lo * scale16, hi * scale16


@triton.jit
def _e2m1_words_16(w, scale16):
    """:func:`_e2m1_words` for 16-bit activations, in their dtype with no float32 in between: the codes' bits
    (:func:`_e2m1_bits_16`) times ``scale16``, the block scale for fp16 or the block scale times ``2**112`` for
    bf16, so every value is exactly the code's times its block scale times ``2**-14``: products of at most six
    significant bits, at least ``2**-24``, below 2688, exact in either dtype. A bf16 code of 0.5 is the subnormal
    ``2**-127`` until the multiply (bf16 arithmetic keeps subnormals: PTX has no flush-to-zero form for it). One
    packed multiply per two elements where the float32 route took two conversions, two multiplies and a pack."""
    p04, p15, p26, p37 = _e2m1_bits_16(w, scale16.dtype == tl.bfloat16)
    e0, e4 = _half_pair(p04, scale16)
    e1, e5 = _half_pair(p15, scale16)
    e2, e6 = _half_pair(p26, scale16)
    e3, e7 = _half_pair(p37, scale16)
    return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def _e4m3_words(w, scale, DTYPE: tl.constexpr):
    """Decode uint32 words of four E4M3 bytes (K elements 0..3, byte 0 first) into the four tensors of their elements
    in DTYPE, each times ``scale * 2**-8``: a byte's seven magnitude bits become an fp16's four low exponent bits and
    top three mantissa bits (bias 15 against E4M3's 7; E4M3 subnormals land on fp16 subnormals), its sign the sign,
    two bytes per shift and mask as in :func:`_e2m1_words`. Scales are finite, so E4M3's NaN code reads as 480, as
    the integer decode it replaced read it."""
    mag: tl.constexpr = 0x3F803F80
    sign: tl.constexpr = 0x80008000
    e0, e2 = _f16_pair(((w << 7) & mag) | ((w << 8) & sign), scale, DTYPE, False)
    e1, e3 = _f16_pair(((w >> 1) & mag) | (w & sign), scale, DTYPE, False)
    return e0, e1, e2, e3


@triton.jit
def _load_b_tile(b_ptr, bs_ptr, rows, row_mask, k0, K,
                 stride_bn, stride_bk, stride_sn, stride_sk,
                 NVFP4: tl.constexpr, DTYPE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_GROUP: tl.constexpr,
                 SCALE_E8M0: tl.constexpr, FP8_BN: tl.constexpr, FP8_BK: tl.constexpr, HALF_DECODE: tl.constexpr):
    """K step ``k0`` of one expert as the ``[BLOCK_K, BLOCK_N]`` tile ``B[k, n] = W[rows[n], k]``, in DTYPE.

    NVFP4: the packed ``[BLOCK_N, BLOCK_K/8]`` int32 words (``b_ptr`` is the bytes viewed as int32) and the
    ``[BLOCK_N, BLOCK_K/SCALE_GROUP]`` scale bytes are each loaded once (coalesced along K); each word's eight codes
    are decoded and scaled (:func:`_e2m1_words`; with ``HALF_DECODE``, E4M3 scales and bf16/fp16 activations,
    :func:`_e2m1_words_16`), then interleaved back into K order (``tl.join`` + ``tl.reshape``) and transposed for
    ``tl.dot``. Exactly the dequantized weights in the activation dtype (``HALF_DECODE``: times ``2**-14``, which
    the caller's epilogue undoes with the tensor scale).
    Block FP8 (``FP8_BN > 0``): the ``[BLOCK_N, BLOCK_K/4]`` words of e4m3 bytes are decoded (:func:`_e4m3_words`)
    and multiplied by the float32 scale of the ``FP8_BN x FP8_BK`` block each word falls in (one scale per row when
    the tile lies in one K block), then interleaved and transposed as NVFP4's.
    """
    if NVFP4:
        kw = k0 * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        ks = k0 * (BLOCK_K // SCALE_GROUP) + tl.arange(0, BLOCK_K // SCALE_GROUP)
        words = tl.load(b_ptr + rows[:, None] * stride_bn + kw[None, :] * stride_bk,
                        mask=row_mask[:, None] & (kw < K // 8)[None, :], other=0).to(tl.uint32, bitcast=True)
        s = tl.load(bs_ptr + rows[:, None] * stride_sn + ks[None, :] * stride_sk,
                    mask=row_mask[:, None] & (ks < K // SCALE_GROUP)[None, :], other=0).to(tl.int32)
        scale = _block_scale_to_f32(s, SCALE_E8M0)
        if HALF_DECODE:
            if DTYPE == tl.bfloat16:
                scale = scale * (2.0 ** 112)
            scale = scale.to(DTYPE)
        elif not SCALE_E8M0:  # E4M3 scales are at most 448: the decode's 2**-14 is undone here, once per 16 elements
            scale = scale * 16384.0  # (E8M0 scales reach 2**127: the decoded values are scaled back instead)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // SCALE_GROUP, SCALE_GROUP // 8)),
                           (BLOCK_N, BLOCK_K // 8))
        if HALF_DECODE:
            e0, e1, e2, e3, e4, e5, e6, e7 = _e2m1_words_16(words, scale)
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = _e2m1_words(words, scale, DTYPE, SCALE_E8M0)
        # element 8i + j of the tile is e_j[i]: the outermost join picks j's low bit, the innermost its high bit
        b = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))
        return tl.trans(tl.reshape(b, (BLOCK_N, BLOCK_K)))
    elif FP8_BN > 0:
        kw = k0 * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)
        words = tl.load(b_ptr + rows[:, None] * stride_bn + kw[None, :] * stride_bk,
                        mask=row_mask[:, None] & (kw < tl.cdiv(K, 4))[None, :], other=0).to(tl.uint32, bitcast=True)
        if FP8_BK % BLOCK_K == 0:  # the tile lies in one K block: one scale per row (a gather of float32 scales per
            # element spills at BLOCK_M=32 on sm_90)
            scale = tl.load(bs_ptr + (rows // FP8_BN) * stride_sn + (k0 * BLOCK_K // FP8_BK) * stride_sk,
                            mask=row_mask, other=0.0)[:, None]
        else:  # one scale per word: FP8_BK is a multiple of 4 (checked by the wrapper)
            scale = tl.load(bs_ptr + (rows // FP8_BN)[:, None] * stride_sn + (kw * 4 // FP8_BK)[None, :] * stride_sk,
                            mask=row_mask[:, None] & (kw < tl.cdiv(K, 4))[None, :], other=0.0)
        e0, e1, e2, e3 = _e4m3_words(words, scale * 256.0, DTYPE)
        b = tl.join(tl.join(e0, e2), tl.join(e1, e3))  # element 4i + j is e_j[i]: the outer join picks j's low bit
        return tl.trans(tl.reshape(b, (BLOCK_N, BLOCK_K)))
    else:
        kk = k0 * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(b_ptr + rows[None, :] * stride_bn + kk[:, None] * stride_bk,
                    mask=(kk < K)[:, None] & row_mask[None, :], other=0.0)
        return w.to(DTYPE)


@triton.jit
def _load_b_mx_packed(b_ptr, bs_ptr, rows, row_mask, k0, K, stride_bn, stride_bk, stride_sn, stride_sk,
                      BLOCK_K: tl.constexpr):
    """K step ``k0`` of one MXFP4 expert as ``tl.dot_scaled`` operands: the packed ``[BLOCK_K/2, BLOCK_N]`` E2M1
    bytes (two K elements each, low nibble first) and the ``[BLOCK_N, BLOCK_K/32]`` E8M0 scales."""
    kp = k0 * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    ks = k0 * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    packed = tl.load(b_ptr + rows[None, :] * stride_bn + kp[:, None] * stride_bk,
                     mask=(kp < K // 2)[:, None] & row_mask[None, :], other=0)
    scale = tl.load(bs_ptr + rows[:, None] * stride_sn + ks[None, :] * stride_sk,
                    mask=row_mask[:, None] & (ks < K // 32)[None, :], other=0)
    return packed, scale


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, bs_ptr, bs2_ptr, c_ptr, topk_w_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
    N, K, EM, num_valid, up_off,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_se, stride_sn, stride_sk,
    stride_s2e, stride_s2p,
    stride_cm, stride_cn,
    bias_ptr, stride_bias_e, swiglu_limit, swiglu_alpha,
    A_ROW_DIV: tl.constexpr,
    NVFP4: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    FUSE_SILU: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr,
    DOT_SCALED: tl.constexpr, A_FORMAT: tl.constexpr, FP8_BN: tl.constexpr, FP8_BK: tl.constexpr,
    PRECISION: tl.constexpr = "tf32", HALF_DECODE: tl.constexpr = False, DENSE: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1, stride_cs=0, PAIRS: tl.constexpr = False,
):
    """C[pair, n] = act(A[pair // A_ROW_DIV] @ W[expert(pair)][n]^T + bias) (* routing weight), rows in sorted
    order. ``NVFP4`` packed weights have E4M3 scales per ``SCALE_GROUP`` and a tensor scale, or with ``SCALE_E8M0``
    (MXFP4) E8M0 scales per 32 and none; MXFP4 with ``DOT_SCALED`` (Blackwell) feeds the packed bytes and scales to
    ``tl.dot_scaled`` against the ``A_FORMAT`` (bf16/fp16) activations instead of dequantizing them. ``FP8_BN > 0``:
    e4m3 weights with a float32 scale per ``FP8_BN x FP8_BK`` block (W8A16). ``CLAMPED_SWIGLU`` is gpt-oss's GLU
    instead of SiLU-and-mul. ``PRECISION`` is ``tl.dot``'s input precision: ``"ieee"`` for fp32 activations, whose
    models get fp32 products as in the torch path, not TF32's 10-bit mantissas. ``DENSE``: one expert and the rows
    in order (a plain linear: ``EM`` is the row count, and no routing metadata is read). ``SPLIT_K``: program
    ``(tile, s)`` takes the ``s``-th of ``SPLIT_K`` runs of K steps and writes its float32 partial at
    ``C + s * stride_cs`` (scales, routing weight, and the bias in split 0 only; with ``FUSE_SILU`` the gate's and
    the up's partials side by side, the activation left to :func:`_glu_partials_kernel`). ``PAIRS`` (``BLOCK_M``
    1): one routed pair per program, its expert read from ``expert_ids`` (the flat top-k IDs; no routing sort), the
    products summed in float32 on FMA units (``tl.dot`` needs 16 rows; at decode sizes 15 of them were padding)."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if not (DENSE or PAIRS):
        if pid_m * BLOCK_M >= tl.load(num_post_ptr):
            return
    tok, expert = _tile_rows(pid_m, sorted_ids_ptr, expert_ids_ptr, BLOCK_M, DENSE, PAIRS)
    tok_mask = tok < num_valid
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    dtype = a_ptr.dtype.element_ty

    k_steps = tl.cdiv(K, BLOCK_K)
    k_first = 0
    k_end = k_steps
    if SPLIT_K > 1:
        per_split = tl.cdiv(k_steps, SPLIT_K)
        k_first = tl.program_id(1) * per_split
        k_end = tl.minimum(k_first + per_split, k_steps)
    a_ptrs = a_ptr + (tok // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + (
        k_first * BLOCK_K + offs_k)[None, :] * stride_ak
    b_base = b_ptr + expert * stride_be
    s_base = bs_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PAIRS:  # per-(k, n) float32 products, summed over k once after the loop
        acc_k = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        acc_k_up = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_first, k_end):
        kk = k0 * BLOCK_K + offs_k
        k_mask = kk < K
        a = tl.load(a_ptrs, mask=tok_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_SCALED:
            bp, bsc = _load_b_mx_packed(b_base, s_base, offs_n, n_mask, k0, K,
                                        stride_bn, stride_bk, stride_sn, stride_sk, BLOCK_K)
            acc = tl.dot_scaled(a, None, A_FORMAT, bp, bsc, "e2m1", acc)
            if FUSE_SILU:
                bp_up, bsc_up = _load_b_mx_packed(b_base, s_base, offs_n + up_off, n_mask, k0, K,
                                                  stride_bn, stride_bk, stride_sn, stride_sk, BLOCK_K)
                acc_up = tl.dot_scaled(a, None, A_FORMAT, bp_up, bsc_up, "e2m1", acc_up)
        else:
            b = _load_b_tile(b_base, s_base, offs_n, n_mask, k0, K,
                             stride_bn, stride_bk, stride_sn, stride_sk, NVFP4, dtype, BLOCK_N, BLOCK_K, SCALE_GROUP,
                             SCALE_E8M0, FP8_BN, FP8_BK, HALF_DECODE)
            if PAIRS:
                a_col = tl.sum(a.to(tl.float32), axis=0)[:, None]  # the pair's one row, as a [BLOCK_K, 1] column
                acc_k += a_col * b.to(tl.float32)
            else:
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if FUSE_SILU:
                b_up = _load_b_tile(b_base, s_base, offs_n + up_off, n_mask, k0, K,
                                    stride_bn, stride_bk, stride_sn, stride_sk, NVFP4, dtype, BLOCK_N, BLOCK_K,
                                    SCALE_GROUP, SCALE_E8M0, FP8_BN, FP8_BK, HALF_DECODE)
                if PAIRS:
                    acc_k_up += a_col * b_up.to(tl.float32)
                else:
                    acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
    if PAIRS:
        acc = tl.sum(acc_k, axis=0)[None, :]
        if FUSE_SILU:
            acc_up = tl.sum(acc_k_up, axis=0)[None, :]

    if NVFP4:
        if not SCALE_E8M0:
            unscale = 16384.0 if HALF_DECODE else 1.0  # the 16-bit decode's values are the weights times 2**-14
            acc = acc * (tl.load(bs2_ptr + expert * stride_s2e) * unscale)
            if FUSE_SILU:
                acc_up = acc_up * (tl.load(bs2_ptr + expert * stride_s2e + stride_s2p) * unscale)
    if HAS_BIAS:
        if SPLIT_K > 1:  # the first split's partial carries the bias
            keep = (tl.program_id(1) == 0).to(tl.float32)
        else:
            keep = 1.0
        bias_row = bias_ptr + expert * stride_bias_e
        acc = acc + tl.load(bias_row + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :] * keep
        if FUSE_SILU:
            acc_up = acc_up + tl.load(bias_row + offs_n + up_off, mask=n_mask, other=0.0).to(tl.float32)[None, :] * keep
    c_ptrs = c_ptr + tok.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = tok_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        c_ptrs += tl.program_id(1) * stride_cs
    if FUSE_SILU and SPLIT_K > 1:  # the activation waits for the partials' sum (:func:`_glu_partials_kernel`)
        tl.store(c_ptrs, acc, mask=c_mask)
        tl.store(c_ptrs + up_off * stride_cn, acc_up, mask=c_mask)
    else:
        if FUSE_SILU:
            acc = _glu(acc, acc_up, CLAMPED_SWIGLU, swiglu_limit, swiglu_alpha)
        if MUL_ROUTED_WEIGHT:
            w = tl.load(topk_w_ptr + tok, mask=tok_mask, other=0.0)
            acc = acc * w[:, None]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _glu(gate, up, CLAMPED_SWIGLU: tl.constexpr, swiglu_limit, swiglu_alpha):
    """``silu(gate) * up``, or gpt-oss's clamped GLU, in float32."""
    if CLAMPED_SWIGLU:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        return (up + 1.0) * (gate * tl.sigmoid(gate * swiglu_alpha))
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _glu_partials_kernel(p_ptr, out_ptr, n, swiglu_limit, swiglu_alpha, SPLIT_K: tl.constexpr,
                         BLOCK_N: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr):
    """``out[r] = glu(sum_s p[r, s, :n], sum_s p[r, s, n:])`` for float32 partials ``p [rows, SPLIT_K, 2n]``, summed
    in order, cast to ``out``'s dtype (``[rows, n]``)."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n
    row = p_ptr + r * SPLIT_K * 2 * n
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        gate += tl.load(row + s * 2 * n + offs, mask=mask, other=0.0)
        up += tl.load(row + s * 2 * n + n + offs, mask=mask, other=0.0)
    out = _glu(gate, up, CLAMPED_SWIGLU, swiglu_limit, swiglu_alpha)
    tl.store(out_ptr + r * n + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_gemm_w4a4_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, alpha_ptr, c_ptr, topk_w_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
    N, K, EM, num_valid, second_off,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_be, stride_bn, stride_bk,
    stride_se, stride_sn, stride_sk,
    stride_ae, stride_ap,
    stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DENSE: tl.constexpr = False,
):
    """W4A4 variant: A is packed E2M1 ``[rows, K/2]`` with E4M3 scales ``[rows, K/16]``; ``tl.dot_scaled``; the
    epilogue multiplies column ``n`` by ``alpha[e, n >= second_off]`` (``input_scale * weight_scale_2``; gate and up
    may differ). No fused SiLU: Triton 3.6 cannot compile two block-scaled accumulators for sm_100. Blackwell only.
    ``DENSE`` as in :func:`_moe_gemm_kernel`."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if not DENSE:
        if pid_m * BLOCK_M >= tl.load(num_post_ptr):
            return
    tok, expert = _tile_rows(pid_m, sorted_ids_ptr, expert_ids_ptr, BLOCK_M, DENSE, False)
    tok_mask = tok < num_valid
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_kp = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 16)
    rows = (tok // A_ROW_DIV).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_base = b_ptr + expert * stride_be
    s_base = bs_ptr + expert * stride_se
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        kp = k0 * (BLOCK_K // 2) + offs_kp
        ks = k0 * (BLOCK_K // 16) + offs_ks
        kp_mask = kp < K // 2
        ks_mask = ks < K // 16
        a = tl.load(a_ptr + rows[:, None] * stride_am + kp[None, :] * stride_ak,
                    mask=tok_mask[:, None] & kp_mask[None, :], other=0)
        a_s = tl.load(as_ptr + rows[:, None] * stride_asm + ks[None, :] * stride_ask,
                      mask=tok_mask[:, None] & ks_mask[None, :], other=0.0)
        b = tl.load(b_base + offs_n[None, :] * stride_bn + kp[:, None] * stride_bk,
                    mask=kp_mask[:, None] & n_mask[None, :], other=0)
        b_s = tl.load(s_base + offs_n[:, None] * stride_sn + ks[None, :] * stride_sk,
                      mask=n_mask[:, None] & ks_mask[None, :], other=0.0)
        acc = tl.dot_scaled(a, a_s, "e2m1", b, b_s, "e2m1", acc)

    alpha_lo = tl.load(alpha_ptr + expert * stride_ae)
    alpha_hi = tl.load(alpha_ptr + expert * stride_ae + stride_ap)
    acc = acc * tl.where(offs_n >= second_off, alpha_hi, alpha_lo)[None, :]
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_w_ptr + tok, mask=tok_mask, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + tok.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=tok_mask[:, None] & n_mask[None, :])


@triton.jit
def _combine_kernel(src_ptr, out_ptr, gate_ptr, shared_ptr, h, stride_gate, stride_shared,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SHARED: tl.constexpr):
    """``out[t] = sum_j src[t * TOP_K + j] (+ sigmoid(gate[t]) * shared[t])`` in float32, in order, cast to
    ``out``'s dtype."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < h
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(src_ptr + (t * TOP_K + j) * h + offs, mask=mask, other=0.0)
    if HAS_SHARED:
        g = tl.load(gate_ptr + t * stride_gate).to(tl.float32)
        acc += tl.load(shared_ptr + t * stride_shared + offs, mask=mask, other=0.0).to(tl.float32) / (1.0 + tl.exp(-g))
    tl.store(out_ptr + t * h + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _combine(pairs: torch.Tensor, m: int, top_k: int, dtype: torch.dtype,
             shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Each token's ``top_k`` consecutive float32 rows of ``pairs`` ``[M*k, H]`` summed into ``[M, H]`` of
    ``dtype``, one launch: the MoE's weighted combine (rows already multiplied by their routing weights; with split
    K, ``k`` times the splits) and a split-K linear's partials. ``shared = (gate [M, 1], value [M, H])``
    adds a shared expert's ``sigmoid(gate) * value`` (Qwen2-MoE, Qwen3-Next) in the same launch."""
    h = pairs.shape[1]
    out = torch.empty(m, h, dtype=dtype, device=pairs.device)
    if m:
        block = min(512, triton.next_power_of_2(h))
        gate, value = shared if shared is not None else (out, out)
        if value.stride(-1) != 1:
            value = value.contiguous()
        _combine_kernel[(m, triton.cdiv(h, block))](
            pairs, out, gate, value, h, gate.stride(0), value.stride(0),
            TOP_K=top_k, BLOCK_H=block, HAS_SHARED=shared is not None, num_warps=4, num_stages=1)
    return out


def _words(packed: torch.Tensor) -> torch.Tensor:
    """Weight bytes ``[..., B]`` (packed E2M1 or E4M3) as the int32 words the in-kernel decodes read: a view of the
    loaded weights (rows contiguous, 4-byte aligned, B a multiple of 4), or a copy of a view that is not, its rows
    padded with zero bytes to whole words."""
    if packed.stride(-1) == 1 and packed.shape[-1] % 4 == 0 and packed.storage_offset() % 4 == 0 and all(
            s % 4 == 0 for s in packed.stride()[:-1]):
        return packed.view(torch.int32)
    pad = -packed.shape[-1] % 4
    return torch.nn.functional.pad(packed, (0, pad)).contiguous().view(torch.int32)


def _grid(em: int, n: int, cfg: GemmConfig) -> tuple[int]:
    return (triton.cdiv(em, cfg.block_m) * triton.cdiv(n, cfg.block_n),)


def _invoke(
    a: torch.Tensor,
    w,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post: torch.Tensor,
    n: int,
    a_row_div: int,
    fuse_silu: bool,
    num_valid: int,
    cfg: GemmConfig,
    bias: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
    dot_scaled: bool = False,
    dense: bool = False,
    split_k: int = 1,
) -> None:
    """One grouped-GEMM launch over a dense (``[E, N', K]``), NVFP4, MXFP4 or block-FP8 weight stack; optional
    per-expert ``bias [E, N']`` and, with ``fuse_silu``, gpt-oss's clamped GLU ``swiglu = (limit, alpha)`` instead of
    SiLU. ``dense``: a one-expert stack over the ``num_valid`` rows of ``a`` in order (``sorted_ids``,
    ``expert_ids`` and ``num_post`` are not read). ``split_k > 1``: ``c`` is float32 ``[rows, split_k, N']``, one
    partial per split, the bias in the first; with ``fuse_silu``, ``[rows, split_k, 2N']``, the gate's and the up's
    partials before the activation (:func:`_glu_partials`). ``cfg.block_m`` 1: one program per routed pair,
    ``expert_ids`` the flat top-k IDs (``sorted_ids`` and ``num_post`` are not read)."""
    mx = isinstance(w, MXFP4Tensor)
    fp8 = w.block if isinstance(w, FP8BlockTensor) else (0, 0)
    if isinstance(w, FP8BlockTensor):
        if fp8[1] % 4:
            raise ValueError(f"block-FP8 weights need K blocks of a multiple of 4 elements, got {w.block}")
        b = _words(w.weight.view(torch.uint8))
        scale = w.scale.float()
        s2 = b  # unused: the block scales are the whole scale
        k = w.weight.shape[-1]
        s_strides = scale.stride()
        s2_strides = (0, 0)
    elif mx:
        b = w.weight if dot_scaled else _words(w.weight)
        scale = w.scale
        s2 = b  # unused: MXFP4 has no tensor scale
        k = w.weight.shape[-1] * 2
        s_strides = scale.stride()
        s2_strides = (0, 0)
    elif isinstance(w, NVFP4Tensor):
        b = _words(w.weight)
        scale = w.weight_scale.view(torch.uint8)
        s2 = w.weight_scale_2.float().reshape(b.shape[0], -1)
        k = w.weight.shape[-1] * 2
        s_strides = scale.stride()
        s2_strides = (s2.stride(0), s2.stride(1) if s2.shape[1] > 1 else 0)
    else:
        b = w
        scale = s2 = b  # unused
        k = b.shape[-1]
        s_strides = (0, 0, 0)
        s2_strides = (0, 0)
    pairs = cfg.block_m == 1 and not dense
    if pairs and dot_scaled:
        raise ValueError("one program per routed pair (block_m 1) cannot use dot_scaled")
    em = num_valid if dense or pairs else sorted_ids.numel()
    c_strides, split_stride = (c.stride(0), c.stride(1)), 0
    if split_k > 1:
        if c.dtype != torch.float32 or c.dim() != 3 or c.shape[1] != split_k or c.shape[2] != n * (1 + fuse_silu):
            raise ValueError("split-K writes float32 [rows, splits, N] partials ([rows, splits, 2N] gate/up ones)")
        c_strides, split_stride = (c.stride(0), c.stride(2)), c.stride(1)
    _moe_gemm_kernel[_grid(em, n, cfg) + (split_k,)](
        a, b, scale, s2, c, topk_weights if topk_weights is not None else c,
        sorted_ids, expert_ids, num_post,
        n, k, em, num_valid, n,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        *s_strides,
        *s2_strides,
        *c_strides,
        bias if bias is not None else c, bias.stride(0) if bias is not None else 0,
        float(swiglu[0]) if swiglu else 0.0, float(swiglu[1]) if swiglu else 0.0,
        A_ROW_DIV=a_row_div,
        NVFP4=isinstance(w, NVFP4Tensor) or mx,
        SCALE_GROUP=mxfp4.BLOCK if mx else nvfp4.BLOCK,
        FUSE_SILU=fuse_silu,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SCALE_E8M0=mx, HAS_BIAS=bias is not None, CLAMPED_SWIGLU=swiglu is not None,
        DOT_SCALED=dot_scaled, A_FORMAT="bf16" if a.dtype == torch.bfloat16 else "fp16",
        FP8_BN=fp8[0], FP8_BK=fp8[1], PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        HALF_DECODE=isinstance(w, NVFP4Tensor) and a.dtype in (torch.float16, torch.bfloat16), DENSE=dense,
        SPLIT_K=split_k, stride_cs=split_stride, PAIRS=pairs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def fused_moe(
    x: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: GemmConfig | None = None,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
    dot_scaled: bool | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[M, H]`` = sum over each token's ``k`` experts of ``w * down(silu(gate(x)) * up(x))``.

    ``w13``/``w2`` are dense stacks ``[E, 2I, H]`` / ``[E, H, I]`` or NVFP4 stacks of the same logical shapes
    (``w13.weight_scale_2`` ``[E, 2]``, ``w2.weight_scale_2`` ``[E]``) or MXFP4 or block-FP8 stacks (for FP8,
    ``w13``'s up half must start on a scale-block row: ``I`` a multiple of the block's rows). ``x`` is
    fp16/bf16/fp32; the output has its dtype. ``topk_ids`` int ``[M, k]``, ``topk_weights`` ``[M, k]``. gpt-oss:
    per-expert biases ``b13 [E, 2I]`` / ``b2 [E, H]`` and ``swiglu = (limit, alpha)`` for its clamped GLU
    (:func:`ember.kernels.moe_reference.clamped_swiglu`). MXFP4 stacks with bf16/fp16 activations use
    ``tl.dot_scaled`` where :func:`mxfp4_dot_scaled_available` says so (``dot_scaled`` forces it on or off).
    ``shared = (gate [M, 1], value [M, H])``: a shared expert's output, added as ``sigmoid(gate) * value`` by the
    combine.
    """
    m, h = x.shape
    top_k = topk_ids.shape[1]
    packed = isinstance(w13, (NVFP4Tensor, MXFP4Tensor, FP8BlockTensor))
    shape13 = tuple(w13.shape)
    e, n2 = shape13[0], shape13[1]
    inter_size = n2 // 2
    if isinstance(w13, FP8BlockTensor) and inter_size % w13.block[0]:
        raise ValueError(f"block-FP8 w13: the up half (row {inter_size}) must start a {w13.block[0]}-row scale block")
    cfg = config or default_config(m, e, top_k, x.device, nvfp4=packed, dtype=x.dtype)
    if config is None and isinstance(w13, FP8BlockTensor):
        cfg = block_fp8_config(cfg)
    if not isinstance(w13, MXFP4Tensor) or x.dtype not in (torch.bfloat16, torch.float16):
        dot_scaled = False
    elif dot_scaled is None:  # (one program per pair decodes on FMA units: tl.dot_scaled needs 16 rows)
        dot_scaled = cfg.block_m > 1 and mxfp4_dot_scaled_available(x.device)
    if dot_scaled and cfg.block_k % 32:
        raise ValueError(f"MXFP4 dot_scaled needs block_k to be a multiple of 32, got {cfg.block_k}")
    if config is not None:
        s13 = s2 = cfg.split_k
    else:
        s13, s2 = moe_splits(m, top_k, e, h, inter_size, cfg, x.device) if packed else (1, 1)
    x = x.contiguous()
    if cfg.block_m == 1:  # one program per routed pair: its expert straight from the top-k IDs, nothing to sort
        sorted_ids = expert_ids = num_post = topk_ids.reshape(-1).contiguous()
    else:
        sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, cfg.block_m, e)
    pairs = m * top_k
    if s13 > 1:
        gate_up = torch.empty(pairs, s13, n2, dtype=torch.float32, device=x.device)
        _invoke(x, w13, gate_up, None, sorted_ids, expert_ids, num_post, inter_size, top_k, True, pairs, cfg,
                bias=b13, dot_scaled=dot_scaled, split_k=s13)
        inter = _glu_partials(gate_up, x.dtype, swiglu)
    else:
        inter = torch.empty(pairs, inter_size, dtype=x.dtype, device=x.device)
        _invoke(x, w13, inter, None, sorted_ids, expert_ids, num_post, inter_size, top_k, True, pairs, cfg,
                bias=b13, swiglu=swiglu, dot_scaled=dot_scaled)
    out = torch.empty(pairs, s2, h, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _invoke(inter, w2, out if s2 > 1 else out.view(pairs, h), weights, sorted_ids, expert_ids, num_post, h, 1, False,
            pairs, cfg, bias=b2, dot_scaled=dot_scaled, split_k=s2)
    return _combine(out.view(pairs * s2, h), m, top_k * s2, x.dtype, shared=shared)


def _glu_partials(gate_up: torch.Tensor, dtype: torch.dtype, swiglu: tuple[float, float] | None) -> torch.Tensor:
    """The split gate/up GEMM's float32 partials ``[rows, splits, 2I]`` summed and through the GLU: ``[rows, I]``
    of ``dtype``, one launch."""
    rows, splits, n2 = gate_up.shape
    out = torch.empty(rows, n2 // 2, dtype=dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n2 // 2))
        _glu_partials_kernel[(rows, triton.cdiv(n2 // 2, block))](
            gate_up, out, n2 // 2, float(swiglu[0]) if swiglu else 0.0, float(swiglu[1]) if swiglu else 0.0,
            SPLIT_K=splits, BLOCK_N=block, CLAMPED_SWIGLU=swiglu is not None, num_warps=4, num_stages=1)
    return out


def nvfp4_linear(
    x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None = None, config: GemmConfig | None = None
) -> torch.Tensor:
    """``x @ dequant(w).T (+ bias)`` through the grouped GEMM with one expert and no gather (W4A16)."""
    stack = NVFP4Tensor(w.weight.unsqueeze(0), w.weight_scale.unsqueeze(0), w.weight_scale_2.reshape(1))
    return _one_expert_linear(x, stack, w.weight.shape[0], bias, config)


def block_fp8_linear(
    x: torch.Tensor, w: FP8BlockTensor, bias: torch.Tensor | None = None, config: GemmConfig | None = None
) -> torch.Tensor:
    """``x @ dequant(w).T (+ bias)`` for a 2-D block-FP8 weight, through the grouped GEMM with one expert (W8A16)."""
    stack = FP8BlockTensor(w.weight.unsqueeze(0), w.scale.unsqueeze(0), w.block)
    m = x.numel() // x.shape[-1]
    n, k = w.weight.shape
    return _one_expert_linear(x, stack, n, bias, config or block_fp8_config(linear_config(m, x.device, n, k)))


def _one_expert_linear(x: torch.Tensor, stack, n: int, bias: torch.Tensor | None,
                       config: GemmConfig | None) -> torch.Tensor:
    """One launch: the grouped GEMM in its dense mode (rows in order, no routing metadata), the bias added to the
    float32 accumulator; with ``split_k`` (:func:`linear_config`), float32 partials (the bias in the first) and one
    more launch to sum them (:func:`_combine`)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m = x2.shape[0]
    cfg = config or linear_config(m, x.device, n, x.shape[-1])
    bias2 = None if bias is None else bias.reshape(1, n)
    if m and cfg.split_k > 1:
        partials = torch.empty(m, cfg.split_k, n, dtype=torch.float32, device=x.device)
        _invoke(x2, stack, partials, None, partials, partials, partials, n, 1, False, m, cfg, dense=True,
                bias=bias2, split_k=cfg.split_k)
        out = _combine(partials.view(m * cfg.split_k, n), m, cfg.split_k, x.dtype)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m:
            _invoke(x2, stack, out, None, out, out, out, n, 1, False, m, cfg, dense=True, bias=bias2)
    return out.view(*lead, n)


# ---------------------------------------------------------------------------------------------------------------
# W4A4 (Blackwell)


def w4a4_available(device: torch.device) -> bool:
    """True on CUDA devices of capability >= 10.0 whose Triton has ``tl.dot_scaled`` and computes NVFP4 with it
    correctly (:func:`dot_scaled_nvfp4_works`, probed once per device; sm_120 is not assumed to)."""
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(tl, "dot_scaled"):
        return False
    if torch.cuda.get_device_capability(device) < (10, 0):
        return False
    return dot_scaled_nvfp4_works(str(device))


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to a scratch file for the block: a failing Triton compile prints its MLIR module and
    pass reproducer (tens of KB) from C++, which ``sys.stderr`` redirection alone cannot catch (Python-level writes
    are redirected too)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink, contextlib.redirect_stderr(io.StringIO()):
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def mxfp4_dot_scaled_available(device: torch.device) -> bool:
    """True on CUDA devices of capability >= 10.0 where :func:`dot_scaled_mxfp4_works` (probed once per device)."""
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(tl, "dot_scaled"):
        return False
    if torch.cuda.get_device_capability(device) < (10, 0):
        return False
    return dot_scaled_mxfp4_works(str(device))


def _fp4_dot_possible(dev: torch.device) -> bool:
    """Whether an FP4 ``tl.dot_scaled`` is worth probing: this Triton has it and, on CUDA, the device has FP4 MMA
    (capability >= 10.0; sm_90 has none, and Triton 3.6 fails to compile it there)."""
    return hasattr(tl, "dot_scaled") and not (dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (10, 0))


@functools.lru_cache(maxsize=None)
def dot_scaled_mxfp4_works(device_str: str = "cpu") -> bool:
    """Known-answer probe: does this Triton compute the MXFP4 fused MoE with ``tl.dot_scaled`` (bf16 x e2m1, E8M0
    scales) as the dequantizing W4A16 kernel does? On CUDA only devices of capability >= 10.0 are probed."""
    dev = torch.device(device_str)
    if not _fp4_dot_possible(dev):
        return False
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16  # the interpreter's bf16 dot is unusable
    x = torch.randn(8, 64, generator=g).to(device=dev, dtype=dtype)
    w13 = mxfp4.quantize(torch.randn(2, 64, 64, generator=g))
    w2 = mxfp4.quantize(torch.randn(2, 64, 32, generator=g))
    w13, w2 = (MXFP4Tensor(w.weight.to(dev), w.scale.to(dev)) for w in (w13, w2))
    ids = torch.randint(0, 2, (8, 1), generator=g, dtype=torch.int32).to(dev)
    ones = torch.ones(8, 1, device=dev)
    try:
        with _quiet_stderr():
            got = fused_moe(x, w13, w2, ones, ids, dot_scaled=True)
    except Exception as e:  # noqa: BLE001 - any compile/run failure means "not supported"
        log.info("MXFP4 dot_scaled probe on %s failed (%s); MXFP4 runs W4A16", device_str, type(e).__name__)
        return False
    want = fused_moe(x, w13, w2, ones, ids, dot_scaled=False)
    return bool(((got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()).item())


@functools.lru_cache(maxsize=None)
def dot_scaled_nvfp4_works(device_str: str = "cpu") -> bool:
    """One-tile known-answer probe: does this Triton (or its interpreter) compute e2m1 x e2m1 ``dot_scaled`` with
    E4M3 block-16 scales correctly? (Triton 3.9's interpreter reads the scales as E8M0.) On CUDA only devices of
    capability >= 10.0 are probed (sm_90 has no FP4 MMA; Triton 3.6 fails to compile it there); the probe's compile
    diagnostics are kept out of the log."""
    dev = torch.device(device_str)
    if not _fp4_dot_possible(dev):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g).to(dev)
    w = nvfp4.quantize(torch.randn(16, 64, generator=g).to(dev))
    w.weight_scale_2 = w.weight_scale_2.reshape(1)
    try:
        with _quiet_stderr():
            got = _w4a4_dense(x, w, torch.tensor(1.0, device=dev))
    except Exception as e:  # noqa: BLE001 - any compile/run failure means "not supported"
        log.info("NVFP4 dot_scaled probe on %s failed (%s); NVFP4 runs W4A16", device_str, type(e).__name__)
        return False
    xq, xs = nvfp4.quantize_activations(x, torch.tensor(1.0, device=dev))
    want = nvfp4.dequantize_activations(xq, xs, torch.tensor(1.0, device=dev)) @ w.dequantize().T
    return bool(((got.float() - want).abs().max() <= 1e-3 * want.abs().max()).item())


def _launch_w4a4(
    aq: torch.Tensor, a_s: torch.Tensor, w: NVFP4Tensor, alpha: torch.Tensor, c: torch.Tensor,
    topk_weights: torch.Tensor | None, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_post: torch.Tensor, a_row_div: int, num_valid: int, cfg: GemmConfig, dense: bool = False,
) -> None:
    """One W4A4 launch; ``alpha [E, P]``: with ``P == 2`` the second half of the output columns uses column 1;
    ``dense``: a one-expert stack over the ``num_valid`` rows in order (no routing metadata read)."""
    b, s = w.weight, w.weight_scale
    n = b.shape[1]
    alpha = alpha.reshape(b.shape[0], -1).contiguous()
    two = alpha.shape[1] > 1
    em = num_valid if dense else sorted_ids.numel()
    _moe_gemm_w4a4_kernel[_grid(em, n, cfg)](
        aq, a_s, b, s, alpha, c, topk_weights if topk_weights is not None else c,
        sorted_ids, expert_ids, num_post,
        n, b.shape[-1] * 2, em, num_valid, n // 2 if two else n,
        aq.stride(0), aq.stride(1), a_s.stride(0), a_s.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        s.stride(0), s.stride(1), s.stride(2),
        alpha.stride(0), alpha.stride(1) if two else 0,
        c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=topk_weights is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, DENSE=dense,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def w4a4_config(cfg: GemmConfig) -> GemmConfig:
    """Blackwell's block-scaled MMA wants 128-row tiles (Triton 3.6 rejects smaller ones for sm_100)."""
    return GemmConfig(128, max(cfg.block_n, 64), max(cfg.block_k, 64), cfg.group_m, 8 if cfg.block_n >= 128 else 4,
                      cfg.num_stages)


def _dynamic_scale(x: torch.Tensor) -> torch.Tensor:
    return nvfp4.tensor_scale(x.float().abs().amax().clamp(min=1e-12))


def _w4a4_dense(x: torch.Tensor, w: NVFP4Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    m = x.shape[0]
    cfg = w4a4_config(GemmConfig())
    aq, a_s = nvfp4.quantize_activations(x, input_scale)
    stack = NVFP4Tensor(w.weight.unsqueeze(0), w.weight_scale.unsqueeze(0), w.weight_scale_2.reshape(1))
    alpha = (input_scale.float() * w.weight_scale_2.float()).reshape(1)
    out = torch.empty(m, w.weight.shape[0], dtype=torch.float32, device=x.device)
    if m:
        _launch_w4a4(aq, a_s, stack, alpha, out, None, out, out, out, 1, m, cfg, dense=True)
    return out


def fused_moe_nvfp4_w4a4(
    x: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    a13_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """W4A4 fused MoE: activations quantized per 16 with the static ``input_scale`` of each GEMM, or, where the
    checkpoint has none (``ember quantize-nvfp4`` without data), a dynamic per-tensor ``amax/(6*448)``; ``shared``
    as in :func:`fused_moe`."""
    m, h = x.shape
    top_k = topk_ids.shape[1]
    e, n2 = w13.weight.shape[0], w13.weight.shape[1]
    inter_size = n2 // 2
    cfg = config or w4a4_config(default_config(m, e, top_k, x.device))
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, cfg.block_m, e)
    s13 = _dynamic_scale(x) if a13_scale is None else a13_scale.float().reshape(())
    xq, xs = nvfp4.quantize_activations(x, s13)
    alpha13 = s13 * w13.weight_scale_2.float().reshape(e, -1)
    gate_up = torch.empty(m * top_k, 2 * inter_size, dtype=torch.float32, device=x.device)
    _launch_w4a4(xq, xs, w13, alpha13, gate_up, None, sorted_ids, expert_ids, num_post, top_k, m * top_k, cfg)
    inter = silu_and_mul(gate_up).to(x.dtype)
    s2 = _dynamic_scale(inter) if a2_scale is None else a2_scale.float().reshape(())
    iq, is_ = nvfp4.quantize_activations(inter, s2)
    alpha2 = (s2 * w2.weight_scale_2.float()).reshape(e)
    out = torch.empty(m * top_k, h, dtype=torch.float32, device=x.device)
    _launch_w4a4(iq, is_, w2, alpha2, out, topk_weights.reshape(-1).float().contiguous(), sorted_ids,
                 expert_ids, num_post, 1, m * top_k, cfg)
    return _combine(out, m, top_k, x.dtype, shared=shared)


def fused_moe_nvfp4(
    x: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    a13_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    w4a4: bool | None = None,
    config: GemmConfig | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """NVFP4 fused MoE: W4A4 (``dot_scaled``) where :func:`w4a4_available` (or when forced with ``w4a4=True``),
    otherwise W4A16 with in-kernel dequantization; ``shared`` as in :func:`fused_moe`."""
    use_w4a4 = w4a4_available(x.device) if w4a4 is None else w4a4
    if use_w4a4:
        return fused_moe_nvfp4_w4a4(x, w13, w2, topk_weights, topk_ids, a13_scale, a2_scale, config, shared=shared)
    return fused_moe(x, w13, w2, topk_weights, topk_ids, config, shared=shared)
