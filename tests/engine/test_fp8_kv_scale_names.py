"""FP8 KV scales under every name vLLM reads: AutoFP8 ``-FP8-KV`` exports' ``self_attn.{k,v}_proj.output_scale``
and the deprecated ``self_attn.kv_scale`` (one scale for K and V) load, and with an FP8 KV cache they become the
attention's k/v scales; query and softmax-probability scales (``q_proj.output_scale``, ``q_scale``,
``prob_scale``) load and are ignored (Ember keeps queries and probabilities in the model dtype)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from ember.kernels import fp8_block
from tests.conftest import save_tiny_qwen3

AUTOFP8 = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"],
           "kv_cache_scheme": "static"}
CHECKPOINTS = {
    "autofp8-kv": ({"model.layers.0.self_attn.k_proj.output_scale": 0.5,
                    "model.layers.0.self_attn.v_proj.output_scale": 0.25,
                    "model.layers.0.self_attn.q_proj.output_scale": 3.0,
                    "model.layers.1.self_attn.k_proj.output_scale": 2.0,
                    "model.layers.1.self_attn.v_proj.output_scale": 0.125,
                    "model.layers.1.self_attn.prob_output_scale": 5.0},
                   [(0.5, 0.25), (2.0, 0.125)]),
    "legacy-kv-scale": ({"model.layers.0.self_attn.kv_scale": 0.5,
                         "model.layers.1.self_attn.kv_scale": 2.0,
                         "model.layers.1.self_attn.q_scale": 3.0,
                         "model.layers.1.self_attn.prob_scale": 5.0},
                        [(0.5, 0.5), (2.0, 2.0)]),
}


def _save(path, demo_model_dir, scales: dict[str, float], autofp8: bool) -> None:
    """A tiny Qwen3 with ``scales``; ``autofp8``: its projections per-tensor FP8 as AutoFP8 writes them."""
    save_tiny_qwen3(path, demo_model_dir, seed=5)
    tensors = load_file(path / "model.safetensors")
    if autofp8:
        for name in [n for n in tensors if ".layers." in n and n.endswith("proj.weight")]:
            q = fp8_block.quantize(tensors[name], (fp8_block.CHANNEL, fp8_block.CHANNEL))
            module = name[: -len(".weight")]
            tensors[name], tensors[module + ".weight_scale"] = q.weight, q.scale.reshape(())
            tensors[module + ".input_scale"] = torch.ones(())
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(cfg | {"quantization_config": AUTOFP8}))
    tensors.update({k: torch.tensor(v, dtype=torch.float32) for k, v in scales.items()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_kv_scales_under_vllm_names_reach_the_fp8_cache(kind, tmp_path, demo_model_dir, monkeypatch):
    monkeypatch.setenv("EMBER_ATTENTION", "torch")
    scales, want = CHECKPOINTS[kind]
    _save(tmp_path, demo_model_dir, scales, autofp8=kind == "autofp8-kv")
    eng = Engine.from_pretrained(tmp_path, max_num_seqs=2, max_model_len=64, num_kv_blocks=16, dtype="float32",
                                 device="cpu", kv_cache_dtype="fp8")
    assert [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in eng.runner.model.model.layers] == want
    assert eng.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    eng.add_request([3, 1, 4, 1, 5], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    out = []
    while eng.has_unfinished():
        out += [t for o in eng.step() for t in o.new_token_ids]
    assert len(out) == 2
