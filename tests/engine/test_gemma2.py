"""A tiny random Gemma 2 (sliding-window layers alternating with global ones, one RoPE, no q/k norms, soft-capped
attention scores and final logits, caps small enough to reshape every softmax): Ember's logits and greedy tokens
equal transformers' past the window, through chunked prefill and prefix hits, from a transformers-4 config.json too;
two tensor-parallel ranks decode what one does."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from ember.engine import loader
from ember.engine.models import get_model_class
from tests.engine.test_gemma3 import _randomize_norms
from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, assert_two_ranks_match_one, ember_logits,
                                ember_model, hf_logits, prompts, save_with_tokenizer)

CONFIG = dict(vocab_size=1280, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
              max_position_embeddings=256, initializer_range=0.1, attn_logit_softcapping=1.5,
              final_logit_softcapping=4.0)


@pytest.fixture(scope="module")
def tiny_gemma2_dir(tmp_path_factory, demo_model_dir):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(3)
    model = Gemma2ForCausalLM(Gemma2Config(**CONFIG))
    _randomize_norms(model)
    with torch.no_grad():  # larger q/k projections: scores well past the cap
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("tiny-gemma2"), demo_model_dir)


def test_layers_alternate_and_share_one_rope(tiny_gemma2_dir):
    model = get_model_class("Gemma2ForCausalLM")(loader.load_model_config(tiny_gemma2_dir), 64)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [8, None, 8, None]
    assert all(layer.self_attn.softcap == 1.5 and layer.self_attn.q_norm is None for layer in model.model.layers)
    assert model.rope is model.rope_local and model.softcap == 4.0


def test_prefill_logits_match_transformers_and_need_the_attention_cap(tiny_gemma2_dir):
    assert_prefill_logits_match_transformers(tiny_gemma2_dir)  # 30 tokens: past the window of 8
    prompt = prompts(1, seed=5, min_len=30, max_len=30)[0]
    model = ember_model(tiny_gemma2_dir)
    for layer in model.model.layers:
        layer.self_attn.softcap = None
    want = hf_logits(tiny_gemma2_dir, prompt)
    assert ((ember_logits(model, prompt) - want).norm() / want.norm()).item() > 1e-2


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_gemma2_dir):
    assert_greedy_matches_transformers_chunked_and_cached(tiny_gemma2_dir)


def test_a_transformers_4_config_json_alternates_from_the_first_layer(tiny_gemma2_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_gemma2_dir, old)
    cfg = json.loads((old / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg.pop("layer_types")
    cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    (old / "config.json").write_text(json.dumps(cfg))
    model = get_model_class("Gemma2ForCausalLM")(loader.load_model_config(old), 64)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [8, None, 8, None]
    assert_prefill_logits_match_transformers(old)


def test_two_ranks_match_one(tiny_gemma2_dir):
    assert_two_ranks_match_one(tiny_gemma2_dir, prompts(4, seed=12, min_len=5, max_len=40), 6)
