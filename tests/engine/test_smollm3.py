"""A tiny random SmolLM3 (the Llama decoder with RoPE left out of every 4th layer): Ember's logits and greedy tokens
equal transformers', through chunked prefill and prefix hits."""
from __future__ import annotations

import pytest
import torch

from ember.engine import loader
from ember.engine.models import get_model_class
from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, save_with_tokenizer)


@pytest.fixture(scope="module")
def tiny_smollm3_dir(tmp_path_factory, demo_model_dir):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    torch.manual_seed(0)
    model = SmolLM3ForCausalLM(SmolLM3Config(
        vocab_size=1280, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    return save_with_tokenizer(model, tmp_path_factory.mktemp("tiny-smollm3"), demo_model_dir)


def test_every_fourth_layer_has_no_rope(tiny_smollm3_dir):
    model = get_model_class("SmolLM3ForCausalLM")(loader.load_model_config(tiny_smollm3_dir), 64)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [True, True, True, False]


def test_prefill_logits_match_transformers(tiny_smollm3_dir):
    assert_prefill_logits_match_transformers(tiny_smollm3_dir)


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_smollm3_dir):
    assert_greedy_matches_transformers_chunked_and_cached(tiny_smollm3_dir)
