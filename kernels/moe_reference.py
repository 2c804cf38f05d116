"""Plain torch references for the MoE and NVFP4 GEMM kernels in ``ember.kernels.moe``; also the CPU path.

Weight layouts (stacked per layer, as the kernels take them):
- ``w13 [E, 2I, H]``: each expert's gate rows then up rows (transformers 5's fused ``gate_up_proj``);
- ``w2 [E, H, I]``: each expert's down projection.
NVFP4 stacks are :class:`ember.kernels.nvfp4.NVFP4Tensor` with ``weight_scale_2`` of shape ``[E]`` (``w2``) or
``[E, 2]`` (``w13``: gate's and up's tensor scales, usually equal).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ember.kernels import fp8_block, mxfp4, nvfp4
from ember.kernels.fp8_block import FP8BlockTensor
from ember.kernels.mxfp4 import MXFP4Tensor
from ember.kernels.nvfp4 import NVFP4Tensor


def topk_routing(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, top-k, optional renormalisation (Qwen3-MoE's ``norm_topk_prob``).

    Returns ``topk_weights`` float32 ``[M, k]`` and ``topk_ids`` int32 ``[M, k]``.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


def topk_softmax_routing(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: top-k of the logits, then a softmax over those k only (in fp32, rounded through the logits'
    dtype as transformers computes it there). Returns ``topk_weights`` float32 ``[M, k]``, ``topk_ids`` int32."""
    v, ids = torch.topk(router_logits, top_k, dim=-1)
    w = torch.softmax(v.float(), dim=-1).to(router_logits.dtype).float()
    return w, ids.to(torch.int32)


def grouped_topk_routing(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_groups: int,
                         topk_groups: int, renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (``noaux_tc``): sigmoid scores; experts are chosen on ``score + correction_bias``, first
    keeping the ``topk_groups`` groups whose two best experts sum highest, then the top-k experts in them; the weights
    are the chosen experts' plain scores, renormalised when asked, times ``scale`` (``routed_scaling_factor``).
    Returns ``topk_weights`` float32 ``[M, k]`` and ``topk_ids`` int32."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    m, e = choice.shape
    grouped = choice.view(m, num_groups, e // num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
    choice = choice.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).reshape(m, e), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, ids.to(torch.int32)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(x: torch.Tensor, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """gpt-oss's GLU over ``[gate | up]`` halves: ``gate`` clamped above at ``limit``, ``up`` to ``[-limit, limit]``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_weight(w: torch.Tensor | NVFP4Tensor | MXFP4Tensor | FP8BlockTensor, e: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s ``[N, K]`` weight in ``dtype``; an NVFP4 stack is dequantized, each of its equal row
    partitions (``weight_scale_2[e]`` of shape ``[P]``) with its own tensor scale; an MXFP4 stack likewise (E8M0
    scales per 32, no tensor scale), and a block-FP8 stack by its block scales."""
    if isinstance(w, MXFP4Tensor):
        return mxfp4.dequantize(w.weight[e], w.scale[e], dtype)
    if isinstance(w, FP8BlockTensor):
        return fp8_block.dequantize(w.weight[e], w.scale[e], w.block, dtype)
    if not isinstance(w, NVFP4Tensor):
        return w[e].to(dtype)
    s2 = w.weight_scale_2.float()[e].reshape(-1)
    rows = w.weight.shape[1] // s2.numel()
    parts = [
        nvfp4.dequantize(w.weight[e, i * rows:(i + 1) * rows], w.weight_scale[e, i * rows:(i + 1) * rows], s2[i],
                         dtype)
        for i in range(s2.numel())
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor | NVFP4Tensor,
    w2: torch.Tensor | NVFP4Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))`` over each token's experts, looping over hit experts.

    Weights are dense stacks or NVFP4 stacks (dequantized one hit expert at a time). Computes in ``x``'s dtype (as
    transformers does) and returns ``[M, H]`` in that dtype. Optional per-expert biases ``b13 [E, 2I]`` and
    ``b2 [E, H]`` and another GLU over the ``[gate | up]`` halves (gpt-oss: :func:`clamped_swiglu`).
    """
    m, h = x.shape
    out = torch.zeros(m, h, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1)
    k = topk_ids.shape[1]
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        tok = pairs // k
        bias13 = None if b13 is None else b13[e].to(x.dtype)
        bias2 = None if b2 is None else b2[e].to(x.dtype)
        hidden = activation(F.linear(x[tok], expert_weight(w13, e, x.dtype), bias13))
        y = F.linear(hidden, expert_weight(w2, e, x.dtype), bias2)
        out.index_add_(0, tok, (y * flat_w[pairs].unsqueeze(1).to(y.dtype)).float())
    return out.to(x.dtype)


def dequantize_w13(w13: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[E, 2I, H]`` from an NVFP4 stack whose ``weight_scale_2`` is ``[E, 2]`` (gate, up)."""
    return torch.stack([expert_weight(w13, e, dtype) for e in range(w13.weight.shape[0])])


def fused_moe_nvfp4(
    x: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """W4A16 reference: :func:`fused_moe` with each hit expert dequantized in ``x``'s dtype."""
    return fused_moe(x, w13, w2, topk_weights, topk_ids)


def nvfp4_linear(x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dense NVFP4 linear: dequantize, then ``F.linear`` in ``x``'s dtype."""
    return F.linear(x, w.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))


def fake_quant_activations(x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    """Quantize-dequantize ``x`` per 16 as the W4A4 path sees it; ``input_scale=None`` uses the dynamic per-tensor
    rule ``amax(|x|) / (6 * 448)``."""
    if input_scale is None:
        input_scale = nvfp4.tensor_scale(x.float().abs().amax().clamp(min=1e-12))
    q, s = nvfp4.quantize_activations(x, input_scale)
    return nvfp4.dequantize_activations(q, s, input_scale).to(x.dtype)


def fused_moe_nvfp4_w4a4(
    x: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    a13_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A4 reference: activations fake-quantized per 16 before each GEMM, then the W4A16 reference."""
    m, h = x.shape
    xq = fake_quant_activations(x, a13_scale).float()
    wg = dequantize_w13(w13)
    wd = torch.stack([expert_weight(w2, e, torch.float32) for e in range(w2.weight.shape[0])])
    out = torch.zeros(m, h, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    k = topk_ids.shape[1]
    inter = torch.empty(m * k, wd.shape[-1], dtype=torch.float32, device=x.device)
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        inter[pairs] = silu_and_mul(F.linear(xq[pairs // k], wg[e]))
    inter = fake_quant_activations(inter.to(x.dtype), a2_scale).float()
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        out.index_add_(0, pairs // k, F.linear(inter[pairs], wd[e]) * flat_w[pairs].unsqueeze(1))
    return out.to(x.dtype)
