"""A tiny random Gemma 3 (7 layers: local sliding-window layers with their own RoPE around a global one with linear
RoPE scaling; sandwich norms, q/k norms, scaled embeddings, GELU-tanh MLP): Ember's logits and greedy tokens equal
transformers' for prompts longer than the window, through chunked prefill and prefix hits (an
``attn_logit_softcapping`` in config.json is ignored, as transformers' Gemma 3 ignores it); the same from the
multimodal checkpoint layout and from a transformers-4 config.json; two tensor-parallel ranks decode what one does."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from ember.engine import loader
from ember.engine.models import get_model_class
from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, assert_two_ranks_match_one, prompts,
                                save_with_tokenizer)

TEXT = dict(vocab_size=1280, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, max_position_embeddings=256,
            initializer_range=0.1, attn_logit_softcapping=1.0, rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})


def _randomize_norms(model) -> None:
    """Zero-centred norm weights start at 0 (a factor of 1); draw them so that a missing ``1 +`` shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)


def save_tiny_gemma3(path, tokenizer_dir, seed: int = 0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**TEXT))
    _randomize_norms(model)
    return save_with_tokenizer(model, path, tokenizer_dir)


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory, demo_model_dir):
    return save_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), demo_model_dir)


def test_layers_follow_layer_types(tiny_gemma3_dir):
    cfg = loader.load_model_config(tiny_gemma3_dir)
    model = get_model_class(cfg.architecture)(cfg, 64)
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert windows == [8, 8, 8, 8, 8, None, 8]
    assert (model.rope.theta, model.rope.scaling["factor"], model.rope_local.theta) == (1e6, 4.0, 1e4)


def test_prefill_logits_match_transformers(tiny_gemma3_dir):
    assert_prefill_logits_match_transformers(tiny_gemma3_dir)  # 30 tokens: past the window of 8


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_gemma3_dir):
    assert_greedy_matches_transformers_chunked_and_cached(tiny_gemma3_dir)


def test_a_transformers_4_config_json_reads_the_same(tiny_gemma3_dir, tmp_path):
    """Hub checkpoints carry ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` and a
    ``sliding_window_pattern`` instead of ``layer_types`` and per-type ``rope_parameters``."""
    old = tmp_path / "old"
    shutil.copytree(tiny_gemma3_dir, old)
    cfg = json.loads((old / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        cfg.pop(key, None)
    cfg |= {"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    (old / "config.json").write_text(json.dumps(cfg))
    model = get_model_class("Gemma3ForCausalLM")(loader.load_model_config(old), 64)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [8, 8, 8, 8, 8, None, 8]
    assert (model.rope.theta, model.rope.scaling["factor"], model.rope_local.theta) == (1e6, 4.0, 1e4)
    assert_prefill_logits_match_transformers(old)


def test_the_multimodal_checkpoint_serves_its_language_model(tmp_path, demo_model_dir):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(1)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=TEXT, vision_config=vision, mm_tokens_per_image=4))
    _randomize_norms(model)
    save_with_tokenizer(model, tmp_path / "mm", demo_model_dir)
    assert loader.load_model_config(tmp_path / "mm").architecture == "Gemma3ForConditionalGeneration"
    assert_prefill_logits_match_transformers(tmp_path / "mm")


def test_two_ranks_match_one(tiny_gemma3_dir):
    assert_two_ranks_match_one(tiny_gemma3_dir, prompts(4, seed=12, min_len=5, max_len=40), 6)
