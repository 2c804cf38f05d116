"""A ModelOpt NVFP4 Phi-3 / Phi-4 checkpoint (every decoder projection NVFP4, the fused ``qkv_proj`` and
``gate_up_proj`` each with its one ``weight_scale_2``, as ModelOpt exports them) loads with those projections kept
NVFP4, and runs what transformers runs from the dequantized checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ember.engine.nvfp4_loading import NVFP4Linear
from tests.conftest import save_with_tokenizer
from tests.engine.test_phi3 import CONFIG
from tests.moe.conftest import (clear_margin, ember_greedy, ember_logits, ember_model, hf_greedy, hf_logits, prompts,
                                write_dequantized)

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _quantize_projections(src: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ember.kernels import nvfp4

    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for name, t in tensors.items():
        module = name[: -len(".weight")]
        if ".layers." in name and module.endswith(PROJECTIONS):
            q = nvfp4.quantize(t)
            out.update({name: q.weight, f"{module}.weight_scale": q.weight_scale,
                        f"{module}.weight_scale_2": q.weight_scale_2.reshape(()),
                        f"{module}.input_scale": torch.tensor(0.01)})
        else:
            out[name] = t
    save_file(out, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                  "exclude_modules": ["lm_head"]}
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def phi3_nvfp4_dirs(tmp_path_factory, demo_model_dir):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    q = save_with_tokenizer(Phi3ForCausalLM(Phi3Config(**CONFIG)), tmp_path_factory.mktemp("tiny-phi3-nvfp4"),
                            demo_model_dir)
    _quantize_projections(q)
    return q, write_dequantized(q, tmp_path_factory.mktemp("tiny-phi3-nvfp4-dequantized"))


def test_fused_projections_stay_nvfp4_and_match_the_dequantized_reference(phi3_nvfp4_dirs):
    q, ref = phi3_nvfp4_dirs
    model = ember_model(q)
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(lin, NVFP4Linear) and lin.weight.dtype == torch.uint8
    assert model.model.layers[0].self_attn.qkv_proj.part_sizes == [128]
    prompt = prompts(1, seed=5, min_len=30, max_len=30)[0]
    want = hf_logits(ref, prompt)
    got = ember_logits(model, prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_greedy_equals_the_dequantized_reference(phi3_nvfp4_dirs):
    q, ref = phi3_nvfp4_dirs
    ps = prompts(4, seed=4)
    ps, expected = clear_margin(ps, hf_greedy(ref, ps), need=3)
    assert ember_greedy(q, ps) == expected
