"""Triton kernel for one decode token of a depthwise causal conv with SiLU over per-sequence windows (Qwen3-Next's
linear-attention conv), updating each sequence's window in its slot in place.

The torch step gathers the windows, scales them by ``keep``, concatenates the new token, scatters the shifted
windows back and reduces: about ten launches per layer and step. One program per (decode token, block of
channels) reads the ``K - 1`` previous inputs of its channels (zeros where the token starts its sequence), forms
``silu(sum_j window_j * w_j)`` in float32 and shifts the new token into the window. Nothing depends on device values,
so the step can be captured in a CUDA graph (reference: `ember.engine.models.qwen3_next.GatedDeltaNet._conv`'s
torch decode branch).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_decode_kernel(x_ptr, out_ptr, tok_ptr, slot_ptr, keep_ptr, state_ptr, w_ptr,
                        stride_x, stride_o, stride_ss, stride_sc, stride_wc, channels,
                        KERNEL: tl.constexpr, BLOCK_C: tl.constexpr):
    d = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < channels
    tok = tl.load(tok_ptr + d).to(tl.int64)
    slot = tl.load(slot_ptr + d).to(tl.int64)
    keep = tl.load(keep_ptr + d)
    dt = state_ptr.dtype.element_ty
    s_ptrs = state_ptr + slot * stride_ss + offs * stride_sc
    x = tl.load(x_ptr + tok * stride_x + offs, mask=mask, other=0.0)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    cur = (tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32) * keep).to(dt)
    for j in tl.static_range(KERNEL - 1):  # window j = previous input j (oldest first); it then holds input j + 1
        acc += cur.to(tl.float32) * tl.load(w_ptr + offs * stride_wc + j, mask=mask, other=0.0).to(tl.float32)
        if j + 1 < KERNEL - 1:
            cur = (tl.load(s_ptrs + j + 1, mask=mask, other=0.0).to(tl.float32) * keep).to(dt)
            tl.store(s_ptrs + j, cur, mask=mask)
        else:
            tl.store(s_ptrs + j, x.to(dt), mask=mask)
    acc += x.to(tl.float32) * tl.load(w_ptr + offs * stride_wc + KERNEL - 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * stride_o + offs, (acc / (1.0 + tl.exp(-acc))).to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv_decode(x: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor,
                       keep: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> None:
    """For each decode token ``tokens[i]`` (a row of ``x [T, C]``) of the sequence in ``slots[i]``: ``out[tokens[i]]
    = silu(sum_j window_j * weight[:, j])`` over the window of its ``K - 1`` previous inputs (``state [slots, C,
    K-1]``, times ``keep[i]``: 0 where the token starts its sequence) and itself, in float32, cast to ``out``'s
    dtype; the window in ``state`` then moves on by the token. ``weight [C, K]``."""
    d = tokens.shape[0]
    channels, k = weight.shape
    if state.stride(-1) != 1 or x.stride(-1) != 1 or out.stride(-1) != 1 or k < 2:
        raise ValueError("causal_conv_decode needs contiguous channels and windows and a kernel of at least 2")
    if d:
        block = min(1024, triton.next_power_of_2(channels))
        _conv_decode_kernel[(d, triton.cdiv(channels, block))](
            x, out, tokens, slots, keep.float(), state, weight,
            x.stride(0), out.stride(0), state.stride(0), state.stride(1), weight.stride(0), channels,
            KERNEL=k, BLOCK_C=block, num_warps=4, num_stages=1,
        )
