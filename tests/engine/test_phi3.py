"""A tiny random Phi-3 / Phi-4 (fused q/k/v and gate/up in the checkpoint, rotary on three quarters of each head):
Ember's logits and greedy tokens equal transformers', through chunked prefill and prefix hits, and two
tensor-parallel ranks (each taking its share of every fused part) decode what one process does; LongRoPE is refused
by name."""
from __future__ import annotations

import pytest
import torch

from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models import get_model_class
from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, assert_two_ranks_match_one, prompts,
                                save_with_tokenizer)

CONFIG = dict(vocab_size=1280, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})


@pytest.fixture(scope="module")
def tiny_phi3_dir(tmp_path_factory, demo_model_dir):
    from safetensors import safe_open
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    path = save_with_tokenizer(Phi3ForCausalLM(Phi3Config(**CONFIG)), tmp_path_factory.mktemp("tiny-phi3"),
                               demo_model_dir)
    with safe_open(path / "model.safetensors", "pt") as f:
        assert "model.layers.0.self_attn.qkv_proj.weight" in f.keys()  # the fused form real checkpoints have
    return path


def test_prefill_logits_match_transformers(tiny_phi3_dir):
    assert_prefill_logits_match_transformers(tiny_phi3_dir)


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_phi3_dir):
    assert_greedy_matches_transformers_chunked_and_cached(tiny_phi3_dir)


def test_two_ranks_match_one(tiny_phi3_dir):
    assert_two_ranks_match_one(tiny_phi3_dir, prompts(4, seed=12, min_len=5, max_len=40), 6)


def test_longrope_is_refused_naming_it():
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64}
    cfg = ModelConfig.from_dict({"architectures": ["Phi3ForCausalLM"], **CONFIG, "rope_parameters": rope})
    with pytest.raises(ConfigError, match="longrope"):
        get_model_class(cfg.architecture)(cfg, 64)
