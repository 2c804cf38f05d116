"""A tiny random MiniMax-M2 (RMSNorms over the whole q and k projections, rotary on half of each head, a sigmoid-routed
MoE with a correction bias in every layer, experts named w1/w3/w2 under ``block_sparse_moe``): Ember's logits and
greedy tokens equal transformers', through chunked prefill and prefix hits, from a block-FP8 export too; two
tensor-parallel ranks (each with its heads' share of the q/k norms, their mean square summed) decode what one does."""
from __future__ import annotations

import pytest
import torch

from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, assert_two_ranks_match_one, clear_margin,
                                ember_greedy, ember_model, hf_greedy, prompts, save_with_tokenizer)

CONFIG = dict(vocab_size=1280, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
              max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny_minimax_dir(tmp_path_factory, demo_model_dir):
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    torch.manual_seed(0)
    model = MiniMaxM2ForCausalLM(MiniMaxM2Config(**CONFIG))
    with torch.no_grad():  # spread the router and its bias, and move the whole-projection norms off 1
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
            layer.mlp.e_score_correction_bias.normal_(0.0, 0.3)
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("tiny-minimax-m2"), demo_model_dir)


def test_the_release_layout_loads_under_ember_names(tiny_minimax_dir):
    from safetensors import safe_open

    with safe_open(str(tiny_minimax_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys
    assert "model.layers.0.block_sparse_moe.e_score_correction_bias" in keys
    model = ember_model(tiny_minimax_dir)
    attn = model.model.layers[0].self_attn
    assert attn.whole_qk_norm and attn.q_norm.weight.shape == (64,) and model.rope.head_dim == 8
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0


def test_prefill_logits_match_transformers(tiny_minimax_dir):
    assert_prefill_logits_match_transformers(tiny_minimax_dir)


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_minimax_dir):
    assert_greedy_matches_transformers_chunked_and_cached(tiny_minimax_dir)


def test_two_ranks_match_one(tiny_minimax_dir):
    assert_two_ranks_match_one(tiny_minimax_dir, prompts(4, seed=12, min_len=5, max_len=40), 6)


def test_a_block_fp8_export_keeps_its_experts_packed(tiny_minimax_dir, tmp_path):
    """MiniMax-M2 is released in block FP8: the experts stay e4m3 and decode what transformers does on the
    dequantized weights."""
    from tests.moe.test_fp8_checkpoint import _write

    _write(tiny_minimax_dir, tmp_path / "fp8", tmp_path / "ref", (16, 16))
    assert ember_model(tmp_path / "fp8").model.layers[1].mlp.experts.quant13 is not None
    ps = prompts(6, seed=15, min_len=3, max_len=30)
    ps, expected = clear_margin(ps, hf_greedy(tmp_path / "ref", ps), need=4)
    assert ember_greedy(tmp_path / "fp8", ps) == expected
