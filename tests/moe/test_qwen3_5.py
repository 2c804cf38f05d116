"""Tiny random Qwen3.5 checkpoints as released (multimodal: ``text_config``, ``model.language_model.`` keys, a vision
tower), dense and MoE: Ember serves the language model with transformers' greedy tokens, alone and at TP=2, and the
NVFP4 MoE checkpoint as transformers runs its dequantized weights, alone and at TP=2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.moe.conftest import VOCAB, clear_margin, ember_greedy, ember_logits, ember_model, hf_greedy, hf_logits, \
    prompts, save_hybrid

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256,
            initializer_range=0.1, layer_types=["linear_attention", "full_attention"] * 2)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)


def _save(path: Path, tokenizer_dir: Path, moe: bool, **moe_over) -> Path:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig, \
        Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(1)
    if moe:
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=dict(TEXT, **MOE | moe_over),
                                                                    vision_config=VISION))
    else:
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT, vision_config=VISION))
    return save_hybrid(model, path, tokenizer_dir)


@pytest.fixture(scope="module", params=["dense", "moe"])
def qwen3_5_dir(request, tmp_path_factory, demo_model_dir) -> Path:
    return _save(tmp_path_factory.mktemp(f"tiny-qwen3.5-{request.param}"), demo_model_dir, request.param == "moe")


def test_the_language_model_of_the_multimodal_checkpoint_is_read(qwen3_5_dir):
    from ember.engine import loader

    raw = json.loads((qwen3_5_dir / "config.json").read_text())
    assert "text_config" in raw and raw["architectures"][0].endswith("ForConditionalGeneration")
    cfg = loader.load_model_config(qwen3_5_dir)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.linear_attention_layers) == (64, 4, [0, 2])
    model = ember_model(qwen3_5_dir)
    moe = "num_experts" in raw["text_config"]
    kinds = {type(layer.mlp).__name__ for layer in model.model.layers}
    assert kinds == ({"SharedExpertMoeBlock"} if moe else {"GatedMLP"})


def test_prefill_logits_match_transformers(qwen3_5_dir):
    prompt = prompts(1, seed=5, min_len=70, max_len=70)[0]
    want = hf_logits(qwen3_5_dir, prompt)
    got = ember_logits(ember_model(qwen3_5_dir), prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_greedy_equals_transformers(qwen3_5_dir):
    ps = prompts(8, seed=1, min_len=1, max_len=30)
    ps, expected = clear_margin(ps, hf_greedy(qwen3_5_dir, ps), need=6)
    assert ember_greedy(qwen3_5_dir, ps) == expected


def test_two_ranks_generate_transformers_tokens(qwen3_5_dir):
    """TP=2: ``in_proj_qkv``'s rows split as q, k and v parts (like the conv), ``in_proj_z``/``b``/``a`` by value
    heads."""
    from ember.engine.engine import Engine
    from tests.engine.test_tensor_parallel import _assert_workers_exited
    from tests.moe.conftest import run_greedy

    ps = prompts(5, seed=10, min_len=2, max_len=24)
    ps, expected = clear_margin(ps, hf_greedy(qwen3_5_dir, ps, new_tokens=6), need=3)
    engine = Engine.from_pretrained(qwen3_5_dir, dtype=torch.float32, device="cpu", num_kv_blocks=32, max_num_seqs=4,
                                    tensor_parallel_size=2)
    workers = list(engine.runner.workers)
    try:
        assert engine.runner.model.model.layers[0].linear_attn.in_proj_qkv.out_features == 16 + 16 + 16
        assert run_greedy(engine, ps, 6) == expected
    finally:
        engine.shutdown()
    _assert_workers_exited(workers)


@pytest.fixture(scope="module")
def qwen3_5_nvfp4_dirs(tmp_path_factory, demo_model_dir) -> tuple[Path, Path]:
    """The MoE checkpoint quantized by ``ember quantize-nvfp4`` (its language model's projections and experts, under
    ``model.language_model.``), and its dequantized twin for transformers. The shared expert is 64 wide (4 scale
    blocks) so that two ranks can split its down projection."""
    from ember.engine import quantize
    from tests.moe.conftest import write_dequantized

    root = tmp_path_factory.mktemp("qwen3.5-nvfp4")
    src = _save(root / "src", demo_model_dir, moe=True, shared_expert_intermediate_size=64)
    assert quantize.main([str(src), str(root / "nvfp4")]) == 0
    return root / "nvfp4", write_dequantized(root / "nvfp4", root / "dequantized")


def test_an_nvfp4_multimodal_checkpoint_matches_transformers_on_its_dequantized_weights(qwen3_5_nvfp4_dirs):
    from ember.engine.nvfp4_loading import NVFP4Linear

    qdir, deq = qwen3_5_nvfp4_dirs
    model = ember_model(qdir)
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, NVFP4Linear)
    assert model.model.layers[0].mlp.experts.quant13 is not None
    prompt = prompts(1, seed=3, min_len=17, max_len=17)[0]
    got, want = ember_logits(model, prompt), hf_logits(deq, prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_an_nvfp4_multimodal_checkpoint_splits_over_two_ranks(qwen3_5_nvfp4_dirs):
    from tests.moe.conftest import assert_two_ranks_match_one

    assert_two_ranks_match_one(qwen3_5_nvfp4_dirs[0], prompts(3, seed=5, min_len=4, max_len=20), 5)
