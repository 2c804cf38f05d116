"""A tiny random DeepSeek-V3 (MLA with q LoRA and interleaved RoPE, YaRN with mscale, grouped sigmoid routing with a
correction bias, shared experts, a first dense layer): Ember's greedy output equals transformers', through chunked
prefill, prefix-cache hits and the Triton attention, and two tensor-parallel ranks decode what one process does."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from ember.engine import loader
from ember.engine.models import get_model_class
from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, assert_two_ranks_match_one, ember_model,
                                prompts, save_with_tokenizer)

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
    return save_with_tokenizer(model, path, tokenizer_dir)


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


def test_a_non_yarn_scaled_rope_scales_the_softmax_by_mscale_all_dim_too(tmp_path, demo_model_dir):
    """transformers (and vLLM) scale the attention softmax by ``mscale_all_dim``'s mscale for any scaled RoPE, not
    only YaRN: a linear-scaled DeepSeek-V3 read otherwise scored wrong logits, silently."""
    path = save_tiny_deepseek_v3(tmp_path / "linear", demo_model_dir, rope_parameters={
        "rope_type": "linear", "factor": 4.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})
    assert_prefill_logits_match_transformers(path)


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


def test_two_ranks_split_the_heads_over_one_replicated_latent_cache(tiny_dsv3_dir):
    """TP=2: each rank runs 2 of the 4 heads (``q_b_proj`` / ``kv_b_proj`` rows, ``o_proj`` columns) over the whole
    latent cache, and the shared experts' partial output is reduced once, with the routed experts'."""
    def check(engine):
        attn = engine.runner.model.model.layers[0].self_attn
        assert (attn.h, attn.kv_b_proj.out_features, attn.kv_a_proj_with_mqa.out_features) == (2, 2 * 28, LORA + ROPE)
        assert engine.runner.kv_caches[0][0].shape[2:] == (1, LORA + ROPE)

    assert_two_ranks_match_one(tiny_dsv3_dir, prompts(4, seed=12, min_len=5, max_len=40), 6, check)


@pytest.fixture(scope="module")
def dsv3_nvfp4_dirs(tmp_path_factory, demo_model_dir):
    """An NVFP4 tiny DeepSeek-V3 (MLA projections kept in their dtype, as ModelOpt's DeepSeek exports keep
    ``self_attn``) whose checkpoint also holds a multi-token-prediction layer past ``num_hidden_layers``, as the real
    ones do; and its dequantized twin without that layer, for transformers."""
    from safetensors.torch import load_file, save_file

    from ember.engine import quantize
    from tests.moe.conftest import write_dequantized

    root = tmp_path_factory.mktemp("dsv3-nvfp4")
    src = save_tiny_deepseek_v3(root / "src", demo_model_dir, v_head_dim=16)  # o_proj: 64 inputs, 4 scale blocks
    tensors = load_file(src / "model.safetensors")
    mtp = {k.replace(".layers.2.", ".layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    save_file(tensors | mtp, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert quantize.main([str(src), str(root / "nvfp4")]) == 0
    deq = write_dequantized(root / "nvfp4", root / "dequantized")
    save_file({k: v for k, v in load_file(deq / "model.safetensors").items() if ".layers.3." not in k},
              str(deq / "model.safetensors"), metadata={"format": "pt"})
    return root / "nvfp4", deq


def test_an_nvfp4_checkpoint_with_a_prediction_layer_matches_transformers_on_its_dequantized_weights(
        dsv3_nvfp4_dirs):
    from ember.engine.nvfp4_loading import NVFP4Linear
    from tests.moe.conftest import ember_logits, hf_logits

    qdir, deq = dsv3_nvfp4_dirs
    model = ember_model(qdir)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, NVFP4Linear)  # the first, dense layer
    assert model.model.layers[1].mlp.experts.quant13 is not None
    assert isinstance(model.model.layers[1].mlp.shared_experts.down_proj, NVFP4Linear)
    prompt = prompts(1, seed=13, min_len=19, max_len=19)[0]
    want = hf_logits(deq, prompt)
    got = ember_logits(model, prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_an_nvfp4_checkpoint_splits_over_two_ranks(dsv3_nvfp4_dirs):
    assert_two_ranks_match_one(dsv3_nvfp4_dirs[0], prompts(4, seed=14, min_len=5, max_len=40), 6)


def test_a_quantized_latent_up_projection_is_refused_naming_it(dsv3_nvfp4_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    from ember.engine.config import ConfigError
    from ember.kernels import nvfp4

    qdir = dsv3_nvfp4_dirs[0]
    shutil.copytree(qdir, tmp_path / "bad")
    tensors = load_file(tmp_path / "bad" / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj"
    q = nvfp4.quantize(tensors.pop(name + ".weight").float())
    tensors |= {name + ".weight": q.weight, name + ".weight_scale": q.weight_scale,
                name + ".weight_scale_2": q.weight_scale_2.reshape(())}
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"), metadata={"format": "pt"})
    for cfg_name, key, excluded in (("hf_quant_config.json", "quantization", "exclude_modules"),
                                    ("config.json", "quantization_config", "ignore")):  # no longer excluded
        path = tmp_path / "bad" / cfg_name
        cfg = json.loads(path.read_text())
        cfg[key][excluded].remove(name)
        path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.kv_b_proj\.weight is NVFP4; .*unquantized"):
        ember_model(tmp_path / "bad")


def test_a_block_fp8_checkpoint_keeps_its_projections_packed_but_the_latent_up_projection(tiny_dsv3_dir,
                                                                                          tmp_path):
    """DeepSeek's FP8 release layout: the projections MLA calls and the experts stay e4m3; ``kv_b_proj``, whose
    weights the absorbed attention reads, is dequantized. Greedy tokens equal transformers' on the dequantized
    weights."""
    from ember.engine.fp8_loading import FP8Linear
    from tests.moe.conftest import clear_margin, ember_greedy, hf_greedy
    from tests.moe.test_fp8_checkpoint import _write

    _write(tiny_dsv3_dir, tmp_path / "fp8", tmp_path / "ref", (16, 16))
    attn = ember_model(tmp_path / "fp8").model.layers[1].self_attn
    assert all(isinstance(m, FP8Linear) for m in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj))
    assert type(attn.kv_b_proj) is torch.nn.Linear and attn.kv_b_proj.weight.dtype == torch.float32
    ps = prompts(6, seed=15, min_len=3, max_len=30)
    ps, expected = clear_margin(ps, hf_greedy(tmp_path / "ref", ps), need=4)
    assert ember_greedy(tmp_path / "fp8", ps) == expected
