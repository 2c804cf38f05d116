"""Triton kernel for one decode token of the gated delta rule per sequence, updating each sequence's state in its
slot of the state cache (reference: `ember.kernels.gated_delta_rule.decode_step`).

One program per (token, value head, block of value channels): it loads that block of the state once, reads it with
the L2-normalised q and k, and writes the updated block back in place, so a step moves each state byte twice (the
torch path also gathers and scatters the slots). No index depends on device values the host would read, so the step
can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, keep_ptr, slot_ptr, state_ptr, o_ptr,
    stride_q, stride_k, stride_v, stride_g, stride_beta, stride_o, stride_ss, stride_sh, stride_sk,
    dk, dv, scale, a_log_ptr, dt_bias_ptr,
    REP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, RAW_GATES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kh = h // REP
    offs_k = tl.arange(0, BLOCK_K)
    mk = offs_k < dk
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = offs_v < dv
    q = tl.load(q_ptr + row * stride_q + kh * dk + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_k + kh * dk + offs_k, mask=mk, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    if RAW_GATES:  # g = -exp(A_log) * softplus(a + dt_bias) in float32; beta = sigmoid(b) in b's dtype
        x = tl.load(g_ptr + row * stride_g + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
        g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        b = tl.load(beta_ptr + row * stride_beta + h).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b))).to(beta_ptr.dtype.element_ty).to(tl.float32)
    else:
        g = tl.load(g_ptr + row * stride_g + h).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_beta + h).to(tl.float32)
    decay = tl.exp(g) * tl.load(keep_ptr + row).to(tl.float32)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    mask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptrs, mask=mask, other=0.0)
    v = tl.load(v_ptr + row * stride_v + h * dv + offs_v, mask=mv, other=0.0).to(tl.float32)
    ks = tl.sum(k[:, None] * s, axis=0) * decay
    qs = tl.sum(q[:, None] * s, axis=0) * decay
    u = beta * (v - ks)
    o = qs + tl.sum(q * k, axis=0) * u
    tl.store(s_ptrs, s * decay + k[:, None] * u[None, :], mask=mask)
    tl.store(o_ptr + row * stride_o + h * dv + offs_v, o, mask=mv)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[D, n]`` rows with a contiguous last dimension (a view where possible)."""
    x2 = x.reshape(x.shape[0], -1)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       keep: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                       block_v: int = 32, *, gates: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One token for each of ``D`` sequences: ``q, k [D, hk, dk]``, ``v [D, hv, dv]``, ``g, beta [D, hv]``,
    ``keep [D]`` (0 starts that row from a zero state), ``state [S, hv, dk, dv]`` fp32 contiguous, ``slots [D]``
    int64 (distinct, except rows that only pad). Updates ``state[slots]`` in place; returns fp32 ``o [D, hv, dv]``.

    ``gates = (A_log, dt_bias)`` (``[hv]`` each): ``g`` and ``beta`` are Qwen3-Next's raw ``a`` and ``b``, and the
    kernel forms ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32) and ``beta = sigmoid(b)`` (rounded to
    ``b``'s dtype) itself, as `ember.engine.models.qwen3_next.GatedDeltaNet` does in torch: nine launches fewer.
    """
    d, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    assert state.dtype == torch.float32 and state.is_contiguous() and state.shape[1:] == (hv, dk, dv)
    out = torch.empty(d, hv, dv, dtype=torch.float32, device=v.device)
    if d == 0:
        return out
    q2, k2, v2, g2, b2 = (_rows(x) for x in (q, k, v, g, beta))
    block_v = min(block_v, triton.next_power_of_2(dv))
    grid = (d, hv, triton.cdiv(dv, block_v))
    _decode_kernel[grid](
        q2, k2, v2, g2, b2, keep, slots, state, out,
        q2.stride(0), k2.stride(0), v2.stride(0), g2.stride(0), b2.stride(0), hv * dv,
        state.stride(0), state.stride(1), state.stride(2), dk, dv, dk ** -0.5,
        *(gates if gates is not None else (g2, g2)),
        REP=hv // hk, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, RAW_GATES=gates is not None,
        num_warps=4, num_stages=1,
    )
    return out
