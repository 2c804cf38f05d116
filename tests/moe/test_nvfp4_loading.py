"""NVFP4 is decided per module from the tensors and cross-checked against the config; every disagreement fails
loudly, naming the file and the tensor."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from ember.engine import nvfp4_loading
from ember.engine.nvfp4_loading import QuantizationError
from ember.kernels import nvfp4

LEGACY = {"producer": {"name": "modelopt"},
          "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                           "exclude_modules": ["lm_head", "*mlp.gate"]}}


def _module(prefix: str, n: int = 32, k: int = 64) -> dict[str, torch.Tensor]:
    q = nvfp4.quantize(torch.randn(n, k))
    return {f"{prefix}.weight": q.weight, f"{prefix}.weight_scale": q.weight_scale,
            f"{prefix}.weight_scale_2": q.weight_scale_2.reshape(())}


def _write(path, tensors, legacy=LEGACY, quant_config=None):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    raw = {"architectures": ["X"]}
    if quant_config is not None:
        raw["quantization_config"] = quant_config
    (path / "config.json").write_text(json.dumps(raw))
    if legacy is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(legacy))
    return path, raw


def _good():
    t = _module("model.layers.0.self_attn.q_proj")
    t.update(_module("model.layers.0.mlp.experts.0.down_proj", 64, 32))
    t["model.layers.0.mlp.gate.weight"] = torch.randn(8, 64)
    t["lm_head.weight"] = torch.randn(10, 64)
    return t


def test_modules_are_decided_from_their_tensors(tmp_path):
    plan = nvfp4_loading.plan(*_write(tmp_path, _good()))
    assert set(plan.modules) == {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts.0.down_proj"}
    spec = plan.modules["model.layers.0.mlp.experts.0.down_proj"]
    assert (spec.out_features, spec.in_features) == (64, 32) and spec.file.endswith("model.safetensors")
    assert plan.config.is_excluded("model.layers.3.mlp.gate") and not plan.config.is_excluded(
        "model.layers.3.mlp.gate_proj")


def test_unquantized_checkpoint_has_no_plan(tmp_path):
    assert nvfp4_loading.plan(*_write(tmp_path, {"lm_head.weight": torch.randn(4, 16)}, legacy=None)) is None


def test_the_two_config_forms_are_both_read(tmp_path):
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head", "*mlp.gate"],
          "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
    plan = nvfp4_loading.plan(*_write(tmp_path, _good(), legacy=None, quant_config=qc))
    assert plan.config.source.endswith("config.json:quantization_config")


def _fails(tmp_path, tensors, match, **kw):
    with pytest.raises(QuantizationError, match=match) as e:
        nvfp4_loading.plan(*_write(tmp_path, tensors, **kw))
    return str(e.value)


def test_missing_tensor_scale_names_file_and_tensor(tmp_path):
    t = _good()
    del t["model.layers.0.self_attn.q_proj.weight_scale_2"]
    msg = _fails(tmp_path, t, r"model\.layers\.0\.self_attn\.q_proj\.weight_scale_2")
    assert "model.safetensors" in msg


def test_block_scale_of_the_wrong_dtype_or_shape(tmp_path):
    t = _good()
    t["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(32, 4)
    _fails(tmp_path / "a", t, r"q_proj\.weight_scale is F32 \[32, 4\], expected F8_E4M3 \[32, 4\]")
    t = _good()
    t["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(32, 2).to(torch.float8_e4m3fn)
    _fails(tmp_path / "b", t, r"q_proj\.weight_scale is F8_E4M3 \[32, 2\]")


def test_scale_without_packed_weight(tmp_path):
    t = _good()
    t["model.layers.0.self_attn.q_proj.weight"] = torch.randn(32, 64)
    _fails(tmp_path, t, r"q_proj\.weight is F32 \[32, 64\], expected U8")


def test_excluded_module_with_nvfp4_tensors(tmp_path):
    t = _good()
    t.update(_module("model.layers.0.mlp.gate", 8, 64))  # the router, quantized although excluded
    _fails(tmp_path, t, r"model\.layers\.0\.mlp\.gate\.weight is NVFP4 but .*hf_quant_config\.json excludes")


def test_nvfp4_tensors_without_any_quant_config(tmp_path):
    _fails(tmp_path, _good(), r"no hf_quant_config\.json and no config\.json quantization_config", legacy=None)


def test_config_declares_another_algorithm_or_group(tmp_path):
    awq = json.loads(json.dumps(LEGACY))
    awq["quantization"]["quant_algo"] = "W4A8_AWQ"  # (FP8 is read by fp8_loading)
    _fails(tmp_path / "a", _good(), r"hf_quant_config\.json: quant_algo 'W4A8_AWQ' is not supported", legacy=awq)
    g32 = json.loads(json.dumps(LEGACY))
    g32["quantization"]["group_size"] = 32
    _fails(tmp_path / "b", _good(), r"group_size must be 16, got 32", legacy=g32)


def test_config_declares_nvfp4_but_no_tensor_is(tmp_path):
    _fails(tmp_path, {"lm_head.weight": torch.randn(4, 16)}, r"declares NVFP4 but no tensor")


def test_the_two_config_files_disagree(tmp_path):
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"], "group_size": 16}
    _fails(tmp_path, _good(), r"exclude different modules", quant_config=qc)


def test_engine_load_names_the_bad_tensor(tiny_moe_nvfp4_dir, tmp_path):
    """Through the real loader: a checkpoint whose expert lost a block scale does not load."""
    from safetensors import safe_open

    from tests.moe.conftest import ember_model

    bad = tmp_path / "bad"
    shutil.copytree(tiny_moe_nvfp4_dir, bad)
    with safe_open(str(bad / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    del t["model.layers.2.mlp.experts.5.up_proj.weight_scale"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(QuantizationError, match=r"model\.safetensors: .*experts\.5\.up_proj\.weight_scale"):
        ember_model(bad)


def test_quantized_lm_head_is_refused(tiny_moe_nvfp4_dir, tmp_path):
    from safetensors import safe_open

    from tests.moe.conftest import ember_model

    bad = tmp_path / "bad"
    shutil.copytree(tiny_moe_nvfp4_dir, bad)
    with safe_open(str(bad / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    q = nvfp4.quantize(t.pop("lm_head.weight"))
    t.update({"lm_head.weight": q.weight, "lm_head.weight_scale": q.weight_scale,
              "lm_head.weight_scale_2": q.weight_scale_2.reshape(())})
    save_file(t, str(bad / "model.safetensors"))
    for name in ("hf_quant_config.json",):
        cfg = json.loads((bad / name).read_text())
        cfg["quantization"]["exclude_modules"].remove("lm_head")
        (bad / name).write_text(json.dumps(cfg))
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["ignore"].remove("lm_head")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationError, match=r"lm_head\.weight is NVFP4; Ember runs only the decoder"):
        ember_model(bad)
