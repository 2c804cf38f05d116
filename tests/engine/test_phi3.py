"""A tiny random Phi-3 / Phi-4 (fused q/k/v and gate/up in the checkpoint, rotary on three quarters of each head):
Ember's logits and greedy tokens equal transformers', through chunked prefill and prefix hits, and two
tensor-parallel ranks (each taking its share of every fused part) decode what one process does. LongRoPE (Phi-3.5,
Phi-4-mini) equals transformers' short factors when the served context fits the pretrained length, its long ones
past it."""
from __future__ import annotations

import pytest
import torch

from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models import get_model_class
from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, assert_two_ranks_match_one, clear_margin,
                                ember_logits, hf_greedy, hf_logits, prompts, run_greedy, save_with_tokenizer)

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


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0],
            "original_max_position_embeddings": 32}


@pytest.fixture(scope="module")
def tiny_longrope_dir(tmp_path_factory, demo_model_dir):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(1)
    cfg = Phi3Config(**{**CONFIG, "rope_parameters": LONGROPE, "original_max_position_embeddings": 32})
    return save_with_tokenizer(Phi3ForCausalLM(cfg), tmp_path_factory.mktemp("tiny-phi3-longrope"), demo_model_dir)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_longrope_uses_the_factor_set_of_the_served_context(tiny_longrope_dir):
    """Served within the pretrained 32 positions: the short factors, as transformers uses for a short sequence;
    served longer: the long factors, as transformers uses once a sequence passes 32 (the attention factor
    sqrt(1 + ln 8 / ln 32) applies to both)."""
    from ember.engine import loader
    from ember.engine.engine import load_model

    path = tiny_longrope_dir
    cfg = loader.load_model_config(path)
    short_ctx = load_model(path, cfg, 32, torch.device("cpu"), torch.float32)
    long_ctx = load_model(path, cfg, 256, torch.device("cpu"), torch.float32)
    short, long = prompts(1, seed=3, min_len=30, max_len=30)[0], prompts(1, seed=4, min_len=45, max_len=45)[0]
    assert _rel(ember_logits(short_ctx, short), hf_logits(path, short)) < 1e-5
    assert _rel(ember_logits(long_ctx, long), hf_logits(path, long)) < 1e-5
    assert _rel(ember_logits(long_ctx, short), hf_logits(path, short)) > 1e-3  # the two sets differ


def test_longrope_greedy_equals_transformers_within_the_pretrained_context(tiny_longrope_dir):
    from ember.engine.engine import Engine

    ps = prompts(6, seed=6, min_len=8, max_len=22)
    ps, expected = clear_margin(ps, hf_greedy(tiny_longrope_dir, ps, new_tokens=8), need=4)
    engine = Engine.from_pretrained(tiny_longrope_dir, dtype=torch.float32, device="cpu", block_size=4,
                                    max_model_len=32, max_num_batched_tokens=16, num_kv_blocks=64)
    assert run_greedy(engine, ps, 8) == expected


def test_longrope_factors_must_fit_the_rotary_dimension():
    rope = {**LONGROPE, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    cfg = ModelConfig.from_dict({"architectures": ["Phi3ForCausalLM"], **CONFIG, "rope_parameters": rope})
    with pytest.raises(ConfigError, match="LongRoPE factors have 8 entries"):
        get_model_class(cfg.architecture)(cfg, 64).rope.build_cache(torch.device("cpu"), torch.float32)
