"""A tiny random DeepSeek-V3 (MLA with q LoRA and interleaved RoPE, YaRN with mscale, grouped sigmoid routing with a
correction bias, shared experts, a first dense layer): Ember's greedy output equals transformers', through chunked
prefill, prefix-cache hits and the Triton attention."""
from __future__ import annotations

import shutil

import pytest
import torch

from ember.engine import loader
from ember.engine.engine import Engine
from ember.engine.models import get_model_class
from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, ember_model, prompts)

LORA, ROPE = 32, 8


def save_tiny_deepseek_v3(path, tokenizer_dir, seed: int = 0, **over):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = dict(vocab_size=1280, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
               topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
               q_lora_rank=48, kv_lora_rank=LORA, qk_nope_head_dim=16, qk_rope_head_dim=ROPE, v_head_dim=12,
               max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "rope_theta": 10000.0})
    cfg.update(over)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg))
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiny_dsv3_dir(tmp_path_factory, demo_model_dir):
    return save_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny-dsv3"), demo_model_dir)


def test_the_kv_cache_holds_one_latent_head(tiny_dsv3_dir):
    cfg = loader.load_model_config(tiny_dsv3_dir)
    assert (cfg.num_key_value_heads, cfg.head_dim) == (1, LORA + ROPE)
    model = get_model_class(cfg.architecture)(cfg, 64)
    assert model.sparse == [False, True, True]


def test_prefill_logits_match_transformers(tiny_dsv3_dir):
    assert_prefill_logits_match_transformers(tiny_dsv3_dir)


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_dsv3_dir):
    assert_greedy_matches_transformers_chunked_and_cached(tiny_dsv3_dir)


def test_triton_attention_and_moe_in_the_model_match_the_torch_path(tiny_dsv3_dir, monkeypatch):
    from ember.engine.attention import AttentionMetadata
    from ember.kernels import attention, reference

    model = ember_model(tiny_dsv3_dir)
    prompt = prompts(1, seed=11, min_len=21, max_len=21)[0]
    t, bs = len(prompt), 16
    nb = (t + bs - 1) // bs
    outs = []
    for backend in (reference, attention):
        if backend is attention:
            monkeypatch.setenv("EMBER_MOE", "triton")
        caches = [(torch.zeros(nb, bs, 1, LORA + ROPE), torch.zeros(nb, bs, 1, LORA + ROPE)) for _ in range(3)]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, t], dtype=torch.int32), seq_lens=torch.tensor([t], dtype=torch.int32),
            block_table=torch.arange(nb, dtype=torch.int32).unsqueeze(0), slot_mapping=torch.arange(t),
            positions=torch.arange(t), logits_indices=torch.arange(t), max_seqlen_q=t, max_seqlen_k=t)
        with torch.inference_mode():
            outs.append(model.compute_logits(model(torch.tensor(prompt), meta, caches, backend)).float())
    want, got = outs
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_tensor_parallelism_is_refused_up_front(tiny_dsv3_dir):
    from ember.engine.config import ConfigError

    with pytest.raises(ConfigError, match="latent attention"):
        Engine.from_pretrained(tiny_dsv3_dir, tensor_parallel_size=2, device="cpu", num_kv_blocks=16)
