"""Triton kernel for the sequential part of the chunked gated delta rule: carrying the state across blocks.

`ember.kernels.gated_delta_rule.chunked` computes each block's intra-block terms with batched torch ops, then walks
the blocks in order: ``u = V' - K' S``, ``o = Q' S + A u``, ``S = d S + Kᵀ u``. In torch that walk is three to five
small launches per block; here it is one launch for all blocks of a group. One program per (sequence x head, block of
value channels) keeps its ``[dk, BLOCK_V]`` slice of the state in registers (the columns of ``S`` evolve
independently), so the state is read and written once per call. Reference: the torch loop in ``chunked``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PRECISION = "tf32"
"""The dots' input precision. Exact fp32 (``ieee``) and ``tf32x3`` spill 300-3000 B per thread on sm_90 at these
tiles; tf32 (10 mantissa bits, far finer than the bf16 activations around it) does not. The interpreter computes in
fp32 whatever this says."""
MAX_CHUNK = 32
"""The largest block the kernel takes: 64-token blocks spill (``tests/kernels/compile_check.py``)."""


@triton.jit
def _scan_kernel(
    sv_ptr, sk_ptr, qd_ptr, qk_ptr, kt_ptr, bd_ptr, state_ptr, out_ptr,
    num_blocks, dk, dv,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = offs_k < dk, offs_v < dv
    s_ptrs = state_ptr + n * dk * dv + offs_k[:, None] * dv + offs_v[None, :]
    s = tl.load(s_ptrs, mask=mk[:, None] & mv[None, :], other=0.0)
    for i in range(num_blocks):
        blk = n * num_blocks + i
        rows_k = blk * CHUNK * dk + offs_c[:, None] * dk + offs_k[None, :]
        rows_v = blk * CHUNK * dv + offs_c[:, None] * dv + offs_v[None, :]
        kmask = mk[None, :]
        vmask = mv[None, :]
        solved_k = tl.load(sk_ptr + rows_k, mask=kmask, other=0.0)
        u = tl.load(sv_ptr + rows_v, mask=vmask, other=0.0) - tl.dot(solved_k, s, input_precision=PRECISION)
        q_decayed = tl.load(qd_ptr + rows_k, mask=kmask, other=0.0)
        qk = tl.load(qk_ptr + blk * CHUNK * CHUNK + offs_c[:, None] * CHUNK + offs_c[None, :])
        o = tl.dot(q_decayed, s, input_precision=PRECISION) + tl.dot(qk, u, input_precision=PRECISION)
        tl.store(out_ptr + rows_v, o, mask=vmask)
        k_to_end = tl.load(kt_ptr + rows_k, mask=kmask, other=0.0)
        s = s * tl.load(bd_ptr + blk) + tl.dot(tl.trans(k_to_end), u, input_precision=PRECISION)
    tl.store(s_ptrs, s, mask=mk[:, None] & mv[None, :])


def scan(solved_v: torch.Tensor, solved_k: torch.Tensor, q_decayed: torch.Tensor, qk: torch.Tensor,
         k_to_end: torch.Tensor, block_decay: torch.Tensor, state: torch.Tensor,
         block_v: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The block walk of ``chunked`` for ``[..., G, C, *]`` fp32 inputs (``...`` = sequence x head, G blocks of C
    tokens: ``solved_v [.., G, C, dv]``, ``solved_k``/``q_decayed``/``k_to_end [.., G, C, dk]``, ``qk [.., G, C, C]``,
    ``block_decay [.., G]``) from ``state [.., dk, dv]``. Returns ``(o [.., G, C, dv], new state)``; fp32
    products in the interpreter, tf32 dots on a GPU (`PRECISION`). ``C`` must be 16 or 32 (`MAX_CHUNK`)."""
    lead = solved_v.shape[:-3]
    nb, chunk, dv = solved_v.shape[-3:]
    dk = solved_k.shape[-1]
    assert chunk in (16, MAX_CHUNK), f"the scan takes blocks of 16 or {MAX_CHUNK} tokens, got {chunk}"
    flat = [x.reshape(-1, *x.shape[len(lead):]).contiguous().float()
            for x in (solved_v, solved_k, q_decayed, qk, k_to_end, block_decay)]
    s = state.reshape(-1, dk, dv).float().contiguous().clone()
    out = torch.empty_like(flat[0])
    n = s.shape[0]
    if n and nb:
        block_v = min(block_v, triton.next_power_of_2(dv))
        _scan_kernel[(n, triton.cdiv(dv, block_v))](
            *flat, s, out, nb, dk, dv, CHUNK=chunk, BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=block_v,
            PRECISION=PRECISION, num_warps=4, num_stages=1,
        )
    return out.reshape(*lead, nb, chunk, dv), s.reshape(*lead, dk, dv)
