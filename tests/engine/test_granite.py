"""A tiny random IBM Granite 3 (the Llama decoder with embedding, attention, residual and logit multipliers): Ember's
logits and greedy tokens equal transformers', through chunked prefill and prefix hits."""
from __future__ import annotations

import pytest
import torch

from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, save_with_tokenizer)


@pytest.fixture(scope="module")
def tiny_granite_dir(tmp_path_factory, demo_model_dir):
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    model = GraniteForCausalLM(GraniteConfig(
        vocab_size=1280, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
        embedding_multiplier=6.0, attention_multiplier=0.05, residual_multiplier=0.3, logits_scaling=4.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    return save_with_tokenizer(model, tmp_path_factory.mktemp("tiny-granite"), demo_model_dir)


def test_prefill_logits_match_transformers(tiny_granite_dir):
    assert_prefill_logits_match_transformers(tiny_granite_dir)


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_granite_dir):
    assert_greedy_matches_transformers_chunked_and_cached(tiny_granite_dir)
