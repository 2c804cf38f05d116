"""A tiny random Seed-OSS (q/k/v and o biases): Ember's logits and greedy tokens equal transformers', through chunked
prefill and prefix hits, and two tensor-parallel ranks (the o bias added once) decode what one process does."""
from __future__ import annotations

import pytest
import torch

from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, assert_two_ranks_match_one, prompts,
                                save_with_tokenizer)


@pytest.fixture(scope="module")
def tiny_seed_dir(tmp_path_factory, demo_model_dir):
    from transformers import SeedOssConfig, SeedOssForCausalLM

    torch.manual_seed(0)
    model = SeedOssForCausalLM(SeedOssConfig(
        vocab_size=1280, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
        attention_bias=True, attention_out_bias=True, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2))
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, name).bias.normal_(0.0, 0.5)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("tiny-seed-oss"), demo_model_dir)


def test_prefill_logits_match_transformers(tiny_seed_dir):
    assert_prefill_logits_match_transformers(tiny_seed_dir)


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_seed_dir):
    assert_greedy_matches_transformers_chunked_and_cached(tiny_seed_dir)


def test_two_ranks_match_one(tiny_seed_dir):
    assert_two_ranks_match_one(tiny_seed_dir, prompts(4, seed=12, min_len=5, max_len=40), 6)
