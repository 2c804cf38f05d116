"""Softmax top-k routing of a mixture of experts in one Triton launch (reference:
`ember.kernels.moe_reference.topk_routing`).

The torch formulation is seven launches per MoE layer and step (the logits to float32, softmax, top-k, the
renormalising sum and division, the IDs to int32, and, for models that round the weights through the logits' dtype
as transformers does, two more casts), each a few microseconds of a decode graph's replay for a few hundred bytes
of work. One program per token: its router logits in float32, softmax, the ``k`` largest taken by repeated argmax
(of the logits, which order the experts as the probabilities do, ties to the lower index), optionally renormalised
(or, as gpt-oss routes, a softmax over the chosen logits alone) and rounded through the logits' dtype. Nothing
depends on device values, so the call can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_kernel(
    logits_ptr, w_ptr, ids_ptr, stride_l, num_experts,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr, CHOSEN_ONLY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    p = e / tl.sum(e, axis=0)
    slots = tl.arange(0, BLOCK_K)
    w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    xs = tl.full((BLOCK_K,), float("-inf"), dtype=tl.float32)
    left = x
    for j in tl.static_range(TOP_K):
        best = tl.argmax(left, axis=0, tie_break_left=True)
        w = tl.where(slots == j, tl.sum(tl.where(offs == best, p, 0.0), axis=0), w)
        xs = tl.where(slots == j, tl.max(left, axis=0), xs)
        ids = tl.where(slots == j, best, ids)
        left = tl.where(offs == best, float("-inf"), left)
    if CHOSEN_ONLY:  # the softmax over the k chosen logits alone (the first is their largest)
        chosen = tl.where(slots < TOP_K, tl.exp(xs - tl.max(xs, axis=0)), 0.0)
        w = chosen / tl.sum(chosen, axis=0)
    elif RENORMALIZE:
        w = w / tl.sum(w, axis=0)
    if ROUND:
        w = w.to(logits_ptr.dtype.element_ty).to(tl.float32)
    tl.store(w_ptr + row * TOP_K + slots, w, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 round_through_dtype: bool = False, *, softmax_of_chosen: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights float32 [M, k], topk_ids int32 [M, k])``: the softmax of each row of ``router_logits`` over
    all experts, in float32, at its ``k`` largest logits (descending); ``renormalize``: divided by their sum;
    ``softmax_of_chosen``: instead the softmax over the ``k`` chosen logits alone (gpt-oss; the same weights as
    renormalising, by another rounding: `ember.kernels.moe_reference.topk_softmax_routing`'s);
    ``round_through_dtype``: rounded to the logits' dtype and back (transformers' Qwen3-MoE and gpt-oss cast the
    weights to the hidden states' dtype)."""
    m, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be between 1 and the {e} experts, got {top_k}")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    w = torch.empty(m, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(m, top_k, dtype=torch.int32, device=logits.device)
    if m:
        _softmax_topk_kernel[(m,)](
            logits, w, ids, logits.stride(0), e,
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(e),
            RENORMALIZE=renormalize, ROUND=round_through_dtype, CHOSEN_ONLY=softmax_of_chosen,
            num_warps=1 if e <= 256 else 4, num_stages=1,
        )
    return w, ids
