"""A tiny random gpt-oss (sinks, sliding window 8 on alternate layers, YaRN RoPE, biased MoE with the clamped GLU):
Ember's greedy output equals transformers', through chunked prefill and prefix-cache hits."""
from __future__ import annotations


import pytest
import torch

from ember.engine import loader
from ember.engine.models import get_model_class
from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, assert_two_ranks_match_one, ember_model,
                                prompts, save_with_tokenizer)

WINDOW = 8


def tiny_gpt_oss_config(**over):
    from transformers import GptOssConfig

    cfg = dict(vocab_size=1280, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
               sliding_window=WINDOW, max_position_embeddings=256, initializer_range=0.1,
               tie_word_embeddings=False,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 10000.0})
    cfg.update(over)
    return GptOssConfig(**cfg)


def save_tiny_gpt_oss(path, tokenizer_dir, seed: int = 0, **over):
    """Random weights with every bias and sink drawn (transformers zero-initialises the expert biases) and routers
    wide enough that top-k has no near-ties; gate/up large enough that the GLU's clamp at 7 is reached."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(tiny_gpt_oss_config(**over))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.router.weight.normal_(0.0, 0.5)
            layer.mlp.router.bias.normal_(0.0, 0.5)
            ex = layer.mlp.experts
            ex.gate_up_proj.normal_(0.0, 0.6)
            ex.gate_up_proj_bias.normal_(0.0, 0.5)
            ex.down_proj_bias.normal_(0.0, 0.1)
    return save_with_tokenizer(model, path, tokenizer_dir)


@pytest.fixture(scope="module")
def tiny_gpt_oss_dir(tmp_path_factory, demo_model_dir):
    return save_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss"), demo_model_dir)


def test_layers_follow_layer_types_with_sinks_and_biases(tiny_gpt_oss_dir):
    cfg = loader.load_model_config(tiny_gpt_oss_dir)
    model = get_model_class(cfg.architecture)(cfg, 64)
    attn = [layer.self_attn for layer in model.model.layers]
    assert [a.sliding_window for a in attn] == [WINDOW, None]
    assert all(a.sinks is not None and a.qkv_proj.bias is not None and a.o_proj.bias is not None for a in attn)
    assert cfg.rope_scaling["rope_type"] == "yarn"


def test_quantization_fp8_is_refused_naming_the_experts(tiny_gpt_oss_dir):
    """An unquantized gpt-oss under `--quantization fp8` is refused at load, naming what cannot be quantized (before,
    the start crashed with an AttributeError)."""
    from ember.engine.config import ConfigError

    with pytest.raises(ConfigError, match="--quantization fp8 cannot quantize gpt-oss's experts"):
        ember_model(tiny_gpt_oss_dir, quantization="fp8")


@pytest.mark.parametrize("method", ["gptq", "bitsandbytes", None])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_quantization_ember_cannot_read_is_refused_naming_it_whatever_the_model(tiny_gpt_oss_dir, tmp_path,
                                                                                  method, quantization):
    """gpt-oss (and encoders) never reached the method check the dense models' loader makes: a GPTQ or
    bitsandbytes config loaded as float weights (int8 cast unscaled) or failed on a tensor's shape; with
    --quantization the refusal sent the user to a flag value that does not exist."""
    import json
    import shutil

    from ember.engine.nvfp4_loading import QuantizationError

    path = tmp_path / "quantized"
    shutil.copytree(tiny_gpt_oss_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"bits": 4} | ({"quant_method": method} if method else {})
    (path / "config.json").write_text(json.dumps(cfg))
    says = f"quant_method '{method}' is not supported" if method else "names no quant_method"
    with pytest.raises(QuantizationError, match=f"config.json:quantization_config: {says}; Ember reads"):
        ember_model(path, quantization=quantization)


def test_prefill_logits_match_transformers(tiny_gpt_oss_dir):
    assert_prefill_logits_match_transformers(tiny_gpt_oss_dir)


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_gpt_oss_dir):
    assert_greedy_matches_transformers_chunked_and_cached(tiny_gpt_oss_dir)


def test_triton_attention_in_the_model_matches_the_torch_path(tiny_gpt_oss_dir):
    """The same model with the Triton paged attention (interpreter on CPU): windowed + sink layers, one prefill."""
    from ember.engine.attention import AttentionMetadata
    from ember.kernels import attention, reference

    model = ember_model(tiny_gpt_oss_dir)
    prompt = prompts(1, seed=11, min_len=21, max_len=21)[0]
    t, bs = len(prompt), 16
    nb = (t + bs - 1) // bs
    outs = []
    for backend in (reference, attention):
        cfg = model.config
        caches = [(torch.zeros(nb, bs, cfg.num_key_value_heads, cfg.head_dim),
                   torch.zeros(nb, bs, cfg.num_key_value_heads, cfg.head_dim)) for _ in range(cfg.num_hidden_layers)]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, t], dtype=torch.int32), seq_lens=torch.tensor([t], dtype=torch.int32),
            block_table=torch.arange(nb, dtype=torch.int32).unsqueeze(0), slot_mapping=torch.arange(t),
            positions=torch.arange(t), logits_indices=torch.arange(t), max_seqlen_q=t, max_seqlen_k=t)
        with torch.inference_mode():
            outs.append(model.compute_logits(model(torch.tensor(prompt), meta, caches, backend)).float())
    want, got = outs
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_two_tensor_parallel_ranks_generate_the_same_greedy_tokens(tiny_gpt_oss_dir):
    """Heads, sinks and the interleaved expert stacks split over 2 CPU ranks (gloo); down_proj_bias added once."""

    def check(engine):
        assert engine.runner.model.model.layers[0].self_attn.sinks.shape == (2,)

    assert_two_ranks_match_one(tiny_gpt_oss_dir, prompts(4, seed=3, min_len=6, max_len=30), 6, check)
