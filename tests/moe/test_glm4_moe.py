"""A tiny random GLM-4.5 (``Glm4MoeForCausalLM``: q/k/v biases, rotary on half of each head, a first dense layer,
DeepSeek-V3's grouped sigmoid routing with a correction bias and a shared expert, a multi-token-prediction layer in
the checkpoint): Ember's logits and greedy tokens equal transformers', through chunked prefill and prefix-cache hits,
from NVFP4 and block-FP8 exports too, and two tensor-parallel ranks decode what one process does. Served, the model
family's own parser (``glm45``) is picked from its ``model_type``."""
from __future__ import annotations


import pytest
import torch

from ember.engine import loader
from ember.engine.models import get_model_class
from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, assert_two_ranks_match_one, prompts,
                                save_with_tokenizer)


def save_tiny_glm4_moe(path, tokenizer_dir, seed: int = 0, **over):
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = dict(vocab_size=1280, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
               n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
               attention_bias=True, use_qk_norm=False, max_position_embeddings=256, initializer_range=0.1,
               tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    cfg.update(over)
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**cfg))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.normal_(0.0, 0.5)
            layer.self_attn.k_proj.bias.normal_(0.0, 0.5)
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    save_with_tokenizer(model, path, tokenizer_dir)
    tensors = load_file(path / "model.safetensors")  # GLM checkpoints carry a multi-token-prediction layer
    n = cfg["num_hidden_layers"]
    mtp = {k.replace(f".layers.{n - 1}.", f".layers.{n}."): v.clone() for k, v in tensors.items()
           if f".layers.{n - 1}." in k}
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    save_file(tensors | mtp, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tiny_glm_dir(tmp_path_factory, demo_model_dir):
    return save_tiny_glm4_moe(tmp_path_factory.mktemp("tiny-glm4-moe"), demo_model_dir)


def test_the_layers_and_rotary_follow_config_json(tiny_glm_dir):
    cfg = loader.load_model_config(tiny_glm_dir)
    model = get_model_class(cfg.architecture)(cfg, 64)
    assert model.sparse == [False, True, True] and model.rope.head_dim == 8
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None and attn.q_norm is None


def test_prefill_logits_match_transformers(tiny_glm_dir):
    assert_prefill_logits_match_transformers(tiny_glm_dir)


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_glm_dir):
    assert_greedy_matches_transformers_chunked_and_cached(tiny_glm_dir)


def test_qk_norm_variant_matches_transformers(tmp_path, demo_model_dir):
    """``use_qk_norm`` (GLM-4.5's config has the switch; some releases turn it on)."""
    path = save_tiny_glm4_moe(tmp_path / "qk", demo_model_dir, seed=3, use_qk_norm=True)
    assert_prefill_logits_match_transformers(path)


def test_two_ranks_match_one(tiny_glm_dir):
    def check(engine):
        attn = engine.runner.model.model.layers[0].self_attn
        assert (attn.hq, attn.hkv) == (2, 1)

    assert_two_ranks_match_one(tiny_glm_dir, prompts(4, seed=12, min_len=5, max_len=40), 6, check)


def test_served_with_the_glm45_parser(tiny_glm_dir):
    from ember.parsers.profiles import detect_profile

    cfg = loader.load_model_config(tiny_glm_dir)
    assert detect_profile(None, cfg.model_type) == "glm45"


def test_an_nvfp4_export_matches_transformers_on_its_dequantized_weights(tiny_glm_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from ember.engine import quantize
    from ember.engine.nvfp4_loading import NVFP4Linear
    from tests.moe.conftest import ember_logits, ember_model, hf_logits, write_dequantized

    assert quantize.main([str(tiny_glm_dir), str(tmp_path / "nvfp4")]) == 0
    deq = write_dequantized(tmp_path / "nvfp4", tmp_path / "dequantized")
    save_file({k: v for k, v in load_file(deq / "model.safetensors").items() if ".layers.3." not in k},
              str(deq / "model.safetensors"), metadata={"format": "pt"})  # transformers has no MTP layer
    model = ember_model(tmp_path / "nvfp4")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, NVFP4Linear)
    assert model.model.layers[1].mlp.experts.quant13 is not None
    prompt = prompts(1, seed=13, min_len=19, max_len=19)[0]
    want = hf_logits(deq, prompt)
    got = ember_logits(model, prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_a_block_fp8_export_keeps_its_weights_packed(tiny_glm_dir, tmp_path):
    from ember.engine.fp8_loading import FP8Linear
    from tests.moe.conftest import clear_margin, ember_greedy, ember_model, hf_greedy
    from tests.moe.test_fp8_checkpoint import _write

    _write(tiny_glm_dir, tmp_path / "fp8", tmp_path / "ref", (16, 16))
    layer = ember_model(tmp_path / "fp8").model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj, FP8Linear) and layer.mlp.experts.quant13 is not None
    ps = prompts(6, seed=15, min_len=3, max_len=30)
    ps, expected = clear_margin(ps, hf_greedy(tmp_path / "ref", ps), need=4)
    assert ember_greedy(tmp_path / "fp8", ps) == expected
