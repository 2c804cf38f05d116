"""A tiny random Qwen3-MoE: Ember's greedy output equals transformers', from either expert key form."""
from __future__ import annotations

import json
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ember.engine.models import get_model_class
from ember.engine.models.layers import GatedMLP
from ember.engine.models.qwen3_moe import SparseMoeBlock
from tests.moe.conftest import clear_margin, ember_greedy, ember_logits, ember_model, hf_greedy, prompts, \
    tiny_moe_config


def test_save_pretrained_writes_per_expert_keys(tiny_moe_dir):
    with safe_open(str(tiny_moe_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        router = f.get_tensor("model.layers.0.mlp.gate.weight")
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys
    assert "model.layers.2.mlp.experts.0.down_proj.weight" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    assert "model.layers.1.mlp.gate_proj.weight" in keys  # mlp_only_layers=[1]: dense
    assert router.std() > 0.3  # not the zero init: top-k is not a tie


def test_greedy_equals_transformers(tiny_moe_dir):
    assert get_model_class("Qwen3MoeForCausalLM").__name__ == "Qwen3MoeForCausalLM"
    ps = prompts(8, seed=1)
    ps, expected = clear_margin(ps, hf_greedy(tiny_moe_dir, ps), need=6)
    assert ember_greedy(tiny_moe_dir, ps) == expected


def test_fused_expert_keys_load_the_same_model(tiny_moe_dir, tmp_path):
    with safe_open(str(tiny_moe_dir / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    fused = {k: v for k, v in t.items() if ".mlp.experts." not in k}
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat((t[f"{p}.{e}.gate_proj.weight"], t[f"{p}.{e}.up_proj.weight"])) for e in range(8)])
        fused[f"{p}.down_proj"] = torch.stack([t[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_moe_dir / name, tmp_path / name)
    save_file(fused, str(tmp_path / "model.safetensors"))
    prompt = prompts(1, seed=7, min_len=12, max_len=12)[0]
    want = ember_logits(ember_model(tiny_moe_dir), prompt)
    got = ember_logits(ember_model(tmp_path), prompt)
    assert torch.equal(got, want)


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers(tmp_path):
    from transformers import Qwen3MoeForCausalLM as HF

    over = dict(num_hidden_layers=5, decoder_sparse_step=2, mlp_only_layers=[3], hidden_size=32,
                num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    hf = HF(tiny_moe_config(**over))
    raw = tiny_moe_config(**over).to_dict()
    raw["architectures"] = ["Qwen3MoeForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from ember.engine import loader

    cfg = loader.load_model_config(tmp_path)
    ours = get_model_class(cfg.architecture)(cfg, 64)
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert kinds == [hasattr(layer.mlp, "experts") for layer in hf.model.layers] == [False, True, False, False, False]
    assert all(isinstance(layer.mlp, GatedMLP) for layer, k in zip(ours.model.layers, kinds) if not k)


def test_triton_fused_moe_in_the_model_matches_the_torch_path(tiny_moe_dir, monkeypatch):
    """The same fp32 model with its MoE layers on the Triton kernels (interpreter on CPU)."""
    prompt = prompts(1, seed=9, min_len=24, max_len=24)[0]
    model = ember_model(tiny_moe_dir)
    want = ember_logits(model, prompt)
    monkeypatch.setenv("EMBER_MOE", "triton")
    got = ember_logits(model, prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    assert not torch.equal(got, want)  # a different summation order: the kernels really ran
