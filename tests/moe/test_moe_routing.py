"""The one-launch softmax top-k router against the torch routing it replaces (interpreter on a CPU)."""
from __future__ import annotations

import pytest
import torch

from ember.kernels import moe_reference as ref
from ember.kernels.moe_routing import softmax_topk


@pytest.mark.parametrize("m,e,k", [(1, 8, 2), (7, 128, 8), (5, 60, 4), (3, 512, 10)],
                         ids=["tiny", "qwen3-30b", "qwen2-moe-60", "qwen3-next-512"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
def test_router_matches_the_torch_routing(m, e, k, renormalize):
    g = torch.Generator().manual_seed(m * e + k)
    logits = torch.randn(m, e, generator=g) * 2
    w, ids = softmax_topk(logits, k, renormalize)
    want_w, want_ids = ref.topk_routing(logits, k, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (m, k)
    assert torch.equal(ids, want_ids)  # descending, as torch.topk
    torch.testing.assert_close(w, want_w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
def test_router_rounds_the_weights_through_the_logits_dtype(dtype):
    """Qwen3-MoE's weights as transformers computes them: float32 softmax, renormalised, then cast to the hidden
    states' dtype; the kernel reads 16-bit logits directly. (The interpreter truncates float32 to bf16 where the GPU
    rounds to nearest: gpu_check's section 1 checks bf16 on the device.)"""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, 64, generator=g) * 2).to(dtype)
    w, ids = softmax_topk(logits, 4, True, round_through_dtype=True)
    want_w, want_ids = ref.topk_routing(logits, 4, True)
    assert torch.equal(ids, want_ids)
    assert torch.equal(w, want_w.to(dtype).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_router_takes_gpt_oss_softmax_over_the_chosen_logits(dtype):
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(5, 32, generator=g) * 3).to(dtype)
    w, ids = softmax_topk(logits, 4, False, round_through_dtype=True, softmax_of_chosen=True)
    want_w, want_ids = ref.topk_softmax_routing(logits, 4)
    assert torch.equal(ids, want_ids)
    exact = dtype == torch.float16  # float32 weights may differ in the last bits; rounded to fp16, not at all
    torch.testing.assert_close(w, want_w, rtol=0 if exact else 2e-6, atol=0 if exact else 1e-7)


def test_router_breaks_ties_toward_the_lower_expert_and_never_repeats_one():
    logits = torch.zeros(2, 16)
    logits[1, 3] = logits[1, 9] = 5.0
    w, ids = softmax_topk(logits, 4, False)
    assert ids.tolist() == [[0, 1, 2, 3], [3, 9, 0, 1]]
    torch.testing.assert_close(w[0], torch.full((4,), 1 / 16))


def test_router_rejects_more_experts_than_exist():
    with pytest.raises(ValueError, match="top_k must be between 1 and the 8 experts"):
        softmax_topk(torch.zeros(1, 8), 9, True)
