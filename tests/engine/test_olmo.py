"""Tiny random OLMo 2 and OLMo 3 (post-norm layers, q/k norms over the whole projections; OLMo 3 with sliding-window
layers and their own RoPE around a global one with YaRN): Ember's logits and greedy tokens equal transformers' for
prompts past the window, through chunked prefill and prefix hits; two tensor-parallel ranks (each with its heads'
share of the whole-projection q/k norms) decode what one process does."""
from __future__ import annotations

import pytest
import torch

from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, assert_two_ranks_match_one, prompts,
                                save_with_tokenizer)

COMMON = dict(vocab_size=1280, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)


def _randomized(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    return model


@pytest.fixture(scope="module")
def olmo_dirs(tmp_path_factory, demo_model_dir):
    from transformers import Olmo2Config, Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM

    torch.manual_seed(0)
    olmo2 = _randomized(Olmo2ForCausalLM(Olmo2Config(num_hidden_layers=2, **COMMON)))
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}}
    olmo3 = _randomized(Olmo3ForCausalLM(Olmo3Config(num_hidden_layers=4, sliding_window=8, rope_parameters=rope,
                                                     **COMMON)))
    return {name: save_with_tokenizer(m, tmp_path_factory.mktemp(f"tiny-{name}"), demo_model_dir)
            for name, m in (("olmo2", olmo2), ("olmo3", olmo3))}


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_prefill_logits_match_transformers(olmo_dirs, name):
    assert_prefill_logits_match_transformers(olmo_dirs[name])  # 30 tokens: past OLMo 3's window of 8


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(olmo_dirs, name):
    assert_greedy_matches_transformers_chunked_and_cached(olmo_dirs[name])


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_two_ranks_match_one(olmo_dirs, name):
    assert_two_ranks_match_one(olmo_dirs[name], prompts(4, seed=12, min_len=5, max_len=40), 6)
