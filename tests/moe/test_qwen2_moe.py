"""A tiny random Qwen2-MoE (q/k/v biases, a dense first layer by ``mlp_only_layers``, softmax top-2 experts plus a
sigmoid-gated shared expert): Ember's logits and greedy tokens equal transformers', through chunked prefill and prefix
hits, and two tensor-parallel ranks decode what one process does."""
from __future__ import annotations

import pytest
import torch

from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, assert_two_ranks_match_one, ember_model,
                                prompts, save_with_tokenizer)


@pytest.fixture(scope="module")
def tiny_qwen2_moe_dir(tmp_path_factory, demo_model_dir):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=1280, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], max_position_embeddings=256,
        initializer_range=0.1, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():  # spread the routers, the shared gates and the q/k/v biases
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(layer.self_attn, name).bias.normal_(0.0, 0.5)
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
                layer.mlp.shared_expert_gate.weight.normal_(0.0, 0.5)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("tiny-qwen2-moe"), demo_model_dir)


def test_layers_follow_mlp_only_layers(tiny_qwen2_moe_dir):
    kinds = [type(layer.mlp).__name__ for layer in ember_model(tiny_qwen2_moe_dir).model.layers]
    assert kinds == ["GatedMLP", "SharedExpertMoeBlock", "SharedExpertMoeBlock"]


def test_prefill_logits_match_transformers(tiny_qwen2_moe_dir):
    assert_prefill_logits_match_transformers(tiny_qwen2_moe_dir)


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_qwen2_moe_dir):
    assert_greedy_matches_transformers_chunked_and_cached(tiny_qwen2_moe_dir)


def test_two_ranks_match_one(tiny_qwen2_moe_dir):
    assert_two_ranks_match_one(tiny_qwen2_moe_dir, prompts(4, seed=12, min_len=5, max_len=40), 6)
