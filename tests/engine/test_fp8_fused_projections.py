"""FP8 Phi-3 (q/k/v and gate/up fused in the checkpoint): the fused ``qkv_proj`` and ``gate_up_proj`` stay FP8 like
every other decoder projection, each as one matrix with its own scales (block rows may straddle the q/k/v parts),
for a block checkpoint, a compressed-tensors per-tensor one and ``--quantization fp8``; logits and greedy tokens
equal transformers' on the dequantized weights."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ember.engine import loader
from ember.engine.engine import Engine, load_model
from ember.engine.fp8_loading import FP8Linear
from ember.kernels import fp8_block
from tests.engine.test_phi3 import CONFIG
from tests.moe.conftest import (clear_margin, compressed_tensors_fp8, ember_logits, hf_greedy, hf_logits, prompts,
                                run_greedy, save_with_tokenizer)

BLOCK = (48, 48)  # q/k/v rows 64 + 32 + 32: the second block row holds q's last rows and k's first
COMPRESSED_TENSORS_TENSOR = compressed_tensors_fp8("tensor")
LAYOUTS = {"block": BLOCK, "tensor": (fp8_block.CHANNEL, fp8_block.CHANNEL), "on-load": (1, fp8_block.CHANNEL)}


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, demo_model_dir) -> Path:
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(3)
    return save_with_tokenizer(Phi3ForCausalLM(Phi3Config(**CONFIG)), tmp_path_factory.mktemp("phi3"),
                               demo_model_dir)


def _write(src: Path, root: Path, layout: str) -> tuple[Path, Path]:
    """(the checkpoint Ember loads, its dequantized twin for transformers): every decoder projection of ``src``
    quantized by ``layout``'s blocks, the fused ones whole; ``on-load`` leaves ``src`` itself to be quantized."""
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    cfg = json.loads((src / "config.json").read_text())
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            q = fp8_block.quantize(t, LAYOUTS[layout])
            module = name[: -len(".weight")]
            if layout == "block":
                fp8[name], fp8[module + ".weight_scale_inv"] = q.weight, q.scale
            elif layout == "tensor":
                fp8[name], fp8[module + ".weight_scale"] = q.weight, q.scale.reshape(1)
                fp8[module + ".input_scale"] = torch.ones(1)
            ref[name] = q.dequantize()
        else:
            fp8[name] = ref[name] = t
    dirs = [(root / "ref", ref, cfg)]
    if layout != "on-load":
        qc = ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
              if layout == "block" else COMPRESSED_TENSORS_TENSOR)
        dirs.append((root / "fp8", fp8, cfg | {"quantization_config": qc}))
    for out, data, config in dirs:
        out.mkdir(parents=True, exist_ok=True)
        save_file(data, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / name, out / name)
    return (src if layout == "on-load" else root / "fp8"), root / "ref"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_projections_stay_fp8_and_match_the_dequantized_reference(phi3_dir, tmp_path, layout):
    path, ref = _write(phi3_dir, tmp_path, layout)
    quantization = "fp8" if layout == "on-load" else None
    model = load_model(path, loader.load_model_config(path), 256, torch.device("cpu"), torch.float32,
                       quantization=quantization)
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(lin, FP8Linear) and lin.weight.dtype == torch.float8_e4m3fn
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.shape == (128, 64) and qkv.scale.shape == ((3, 2) if layout == "block" else (128, 1))
    prompt = prompts(1, seed=4, min_len=24, max_len=24)[0]
    got, want = ember_logits(model, prompt), hf_logits(ref, prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    if layout == "block":
        ps = prompts(4, seed=6, max_len=20)
        ps, expected = clear_margin(ps, hf_greedy(ref, ps, 8), need=3)
        engine = Engine.from_pretrained(path, dtype=torch.float32, device="cpu", num_kv_blocks=32, max_num_seqs=4)
        assert run_greedy(engine, ps, 8) == expected
