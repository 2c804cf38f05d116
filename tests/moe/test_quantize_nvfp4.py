"""`ember quantize-nvfp4` writes a ModelOpt-format checkpoint, and Ember's NVFP4 path runs it like a torch reference
that dequantizes the checkpoint and runs the model in transformers, alone or split over two tensor-parallel ranks."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
from safetensors import safe_open

from ember.engine import quantize
from ember.engine.nvfp4_loading import NVFP4Linear
from ember.kernels import nvfp4
from tests.conftest import tensor_parallel_workers
from tests.moe.conftest import assert_two_ranks_match_one, clear_margin, ember_greedy, ember_logits, ember_model, \
    hf_greedy, hf_logits, prompts, save_fused_experts, write_dequantized
from tests.server.processes import ember_cmd


@pytest.fixture(scope="module")
def dequantized_dir(tiny_moe_nvfp4_dir, tmp_path_factory):
    return write_dequantized(tiny_moe_nvfp4_dir, tmp_path_factory.mktemp("tiny-moe-dequantized"))


def test_checkpoint_has_modelopt_tensors_and_configs(tiny_moe_dir, tiny_moe_nvfp4_dir):
    with safe_open(str(tiny_moe_nvfp4_dir / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(str(tiny_moe_dir / "model.safetensors"), framework="pt") as f:
        src = {k: f.get_tensor(k) for k in f.keys()}
    e = "model.layers.0.mlp.experts.3.gate_proj"
    assert t[f"{e}.weight"].dtype == torch.uint8 and t[f"{e}.weight"].shape == (32, 32)
    assert t[f"{e}.weight_scale"].dtype == torch.float8_e4m3fn and t[f"{e}.weight_scale"].shape == (32, 4)
    assert t[f"{e}.weight_scale_2"].dtype == torch.float32 and t[f"{e}.weight_scale_2"].shape == ()
    # fused partners share one tensor scale, as in ModelOpt's export
    a = "model.layers.1.self_attn"
    assert t[f"{a}.q_proj.weight_scale_2"] == t[f"{a}.k_proj.weight_scale_2"] == t[f"{a}.v_proj.weight_scale_2"]
    assert t[f"{e}.weight_scale_2"] == t["model.layers.0.mlp.experts.3.up_proj.weight_scale_2"]
    assert "model.layers.1.mlp.down_proj.weight_scale" in t  # the dense MLP layer too
    # kept as they were: embeddings, lm_head, norms, routers
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(t[name], src[name])
    assert not any(k.endswith("input_scale") for k in t)  # no calibration data, no static activation scales
    d = nvfp4.dequantize(t[f"{e}.weight"], t[f"{e}.weight_scale"], t[f"{e}.weight_scale_2"])
    w = src[f"{e}.weight"]
    assert ((d - w).norm() / w.norm()).item() < 0.15
    legacy = json.loads((tiny_moe_nvfp4_dir / "hf_quant_config.json").read_text())["quantization"]
    qc = json.loads((tiny_moe_nvfp4_dir / "config.json").read_text())["quantization_config"]
    assert legacy["quant_algo"] == qc["quant_algo"] == "NVFP4" and legacy["group_size"] == 16
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 16
    assert {"lm_head", "model.layers.0.mlp.gate", "model.layers.2.mlp.gate"} <= set(legacy["exclude_modules"])
    assert legacy["exclude_modules"] == qc["ignore"]
    assert (tiny_moe_nvfp4_dir / "tokenizer.json").exists()


def test_refuses_an_already_quantized_checkpoint(tiny_moe_nvfp4_dir, tmp_path, capsys):
    assert quantize.main([str(tiny_moe_nvfp4_dir), str(tmp_path / "again")]) == 1
    assert "already quantized" in capsys.readouterr().err


def test_ember_keeps_the_weights_packed(tiny_moe_nvfp4_dir):
    model = ember_model(tiny_moe_nvfp4_dir)
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    assert isinstance(layer0.self_attn.qkv_proj, NVFP4Linear) and layer0.self_attn.qkv_proj.weight.dtype == torch.uint8
    assert isinstance(layer1.mlp.gate_up_proj, NVFP4Linear)
    ex = layer0.mlp.experts
    assert ex.quant13.weight.shape == (8, 64, 32) and ex.quant2.weight.shape == (8, 64, 16)
    assert ex.quant13.weight_scale_2.shape == (8, 2) and bool((ex.quant13.weight_scale_2 > 0).all())
    assert layer0.mlp.gate.weight.dtype == torch.float32


def test_greedy_equals_dequantized_torch_reference(tiny_moe_nvfp4_dir, dequantized_dir):
    ps = prompts(6, seed=3)
    ps, expected = clear_margin(ps, hf_greedy(dequantized_dir, ps), need=4)
    assert ember_greedy(tiny_moe_nvfp4_dir, ps) == expected


def test_triton_nvfp4_path_logits_match_dequantized_reference(tiny_moe_nvfp4_dir, dequantized_dir, monkeypatch):
    """The Triton kernels (interpreter on CPU) dequantize inside the GEMMs: fused MoE and dense NVFP4 linears."""
    from ember.kernels import moe

    monkeypatch.setenv("EMBER_MOE", "triton")
    calls = {"linear": 0, "moe": 0}
    for fn, key in (("nvfp4_linear", "linear"), ("fused_moe", "moe")):
        real = getattr(moe, fn)

        def spy(*a, _real=real, _key=key, **k):
            calls[_key] += 1
            return _real(*a, **k)

        monkeypatch.setattr(moe, fn, spy)
    prompt = prompts(1, seed=5, min_len=20, max_len=20)[0]
    model = ember_model(tiny_moe_nvfp4_dir)
    got = ember_logits(model, prompt)
    want = hf_logits(dequantized_dir, prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3
    assert clear.sum() >= 15
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    assert calls == {"linear": 3 * 2 + 2, "moe": 2}  # qkv + o per layer, the dense MLP's two, two MoE layers


def test_sharded_source_gives_the_same_tensors_in_shards(tiny_moe_dir, tiny_moe_nvfp4_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_moe_dir).save_pretrained(src, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((tiny_moe_dir / name).read_bytes())
    assert len(list(src.glob("*.safetensors"))) > 2
    dst = tmp_path / "sharded-nvfp4"
    assert quantize.main([str(src), str(dst)]) == 0
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    got = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(dst / shard), framework="pt") as f:
            got.update({k: f.get_tensor(k) for k in f.keys()})
    with safe_open(str(tiny_moe_nvfp4_dir / "model.safetensors"), framework="pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}
    assert set(got) == set(want) == set(index)
    assert all(torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)) for k in want)
    assert isinstance(ember_model(dst).model.layers[0].self_attn.qkv_proj, NVFP4Linear)



def test_fused_expert_stacks_in_either_layout_give_the_per_expert_checkpoint(tiny_moe_dir, tiny_moe_nvfp4_dir,
                                                                              tmp_path):
    """Experts stored fused, as transformers 5 holds them or transposed as Qwen3-VL-MoE releases them, are split per
    expert by their layout: the same tensors and configs as from per-expert keys."""
    with safe_open(str(tiny_moe_nvfp4_dir / "model.safetensors"), framework="pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}
    for layout, transposed in (("transformers", False), ("released", True)):
        dst = tmp_path / f"{layout}-nvfp4"
        assert quantize.main([str(save_fused_experts(tiny_moe_dir, tmp_path / layout, transposed)), str(dst)]) == 0
        with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
        assert set(got) == set(want)
        assert all(torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8))
                   for k in want), layout
        assert (dst / "hf_quant_config.json").read_text() == (tiny_moe_nvfp4_dir / "hf_quant_config.json").read_text()

def test_two_ranks_keep_their_share_of_every_packed_weight_and_decode_what_one_process_does(tiny_moe_nvfp4_dir):
    """TP=2 on an NVFP4 checkpoint: column-parallel projections keep half the rows of the packed bytes and block
    scales, row-parallel ones half the columns (whole 16-element scale blocks); the tensor scales are shared."""
    def check(engine):
        layer0, layer1 = engine.runner.model.model.layers[0], engine.runner.model.model.layers[1]
        qkv, o = layer0.self_attn.qkv_proj, layer0.self_attn.o_proj
        assert isinstance(qkv, NVFP4Linear) and isinstance(o, NVFP4Linear)
        assert qkv.weight.shape == (32 + 16 + 16, 32) and qkv.weight_scale.shape == (64, 4)
        assert o.weight.shape == (64, 16) and o.weight_scale.shape == (64, 2)
        assert layer1.mlp.down_proj.weight.shape == (64, 24)  # the dense MLP: 48 of its 96 channels
        ex = layer0.mlp.experts
        assert ex.quant13.weight.shape == (8, 32, 32) and ex.quant2.weight.shape == (8, 64, 8)

    assert_two_ranks_match_one(tiny_moe_nvfp4_dir, prompts(4, seed=8, min_len=4, max_len=30), 6, check)


def test_a_split_that_cuts_a_scale_block_is_refused_naming_the_tensor(tmp_path, demo_model_dir):
    """48 expert channels are 3 scale blocks: two ranks would each need half a block."""
    from ember.engine.config import ConfigError
    from ember.engine.engine import Engine
    from tests.moe.conftest import save_tiny_moe

    src, dst = save_tiny_moe(tmp_path / "src", demo_model_dir, moe_intermediate_size=48), tmp_path / "nvfp4"
    assert quantize.main([str(src), str(dst)]) == 0
    with pytest.raises(ConfigError, match=r"does not divide dimension 1 \(3\) of tensor "
                                          r"'model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight_scale'"):
        Engine.from_pretrained(dst, dtype=torch.float32, device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    assert not tensor_parallel_workers()


def test_a_truncated_weight_file_is_one_line_naming_it(tmp_path, demo_model_dir):
    src = tmp_path / "truncated"
    shutil.copytree(demo_model_dir, src)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    r = subprocess.run([*ember_cmd(), "quantize-nvfp4", str(src), str(tmp_path / "q")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.startswith(f"ember quantize-nvfp4: error: {weights}: not a readable safetensors file ("), r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "q").exists()


def _refused(capsys, src, dst, culprit, message: str) -> None:
    """``quantize-nvfp4 SRC DST`` exits 1 with one line naming ``culprit``, and writes nothing at DST."""
    assert quantize.main([str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ember quantize-nvfp4: error: {culprit}: {message}"), err
    assert err.count("\n") == 1, err
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}.*"))


def test_a_checkpoint_quantized_without_quantization_config_is_refused(tiny_moe_nvfp4_dir, tmp_path, capsys):
    """Already NVFP4 by its legacy ``hf_quant_config.json`` alone, or by its packed weights alone: refused as one
    whose config.json says so."""
    src = tmp_path / "legacy-config-only"
    shutil.copytree(tiny_moe_nvfp4_dir, src)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    _refused(capsys, src, tmp_path / "q", src / "hf_quant_config.json", "the checkpoint is already quantized")
    (src / "hf_quant_config.json").unlink()
    _refused(capsys, src, tmp_path / "q", src / "model.safetensors", "the checkpoint is already quantized (tensor ")


def test_what_it_cannot_quantize_is_refused_naming_why(demo_model_dir, tmp_path, capsys):
    """gpt-oss (fused interleaved experts), an architecture Ember does not serve, and a model whose projections are
    all too narrow for a 16-wide scale block: one line, nothing written."""
    from safetensors.torch import save_file

    for arch, message in (("GptOssForCausalLM", "architecture 'GptOssForCausalLM' is not supported by quantize-nvfp4"),
                          ("GPT2LMHeadModel", "architecture 'GPT2LMHeadModel' is not supported")):
        src = tmp_path / arch
        shutil.copytree(demo_model_dir, src)
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
        _refused(capsys, src, tmp_path / "q", src / "config.json", message)
    src = tmp_path / "narrow"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 40}))
    save_file({"model.embed_tokens.weight": torch.ones(64, 40),
               **{f"model.layers.0.self_attn.{p}.weight": torch.ones(40, 40) for p in ("q_proj", "k_proj", "o_proj")},
               "model.layers.0.mlp.down_proj.weight": torch.ones(40, 24)}, str(src / "model.safetensors"))
    _refused(capsys, src, tmp_path / "q", src, "nothing to quantize: the input size of every projection (24, 40) is "
                                               "not a multiple of 16")


def test_a_write_failure_is_one_line_and_leaves_no_checkpoint(tiny_moe_dir, tmp_path, capsys, monkeypatch):
    """A full disk (safetensors raises its own error): one line naming the file; DST absent before stays absent, an
    empty DST stays empty."""
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("No space left on device (os error 28)")

    from ember.engine import checkpoint_writer

    monkeypatch.setattr(checkpoint_writer, "save_file", full)
    _refused(capsys, tiny_moe_dir, tmp_path / "q", tmp_path / "q" / "model.safetensors",
             "cannot be written (No space left on device")
    (tmp_path / "q").mkdir()
    assert quantize.main([str(tiny_moe_dir), str(tmp_path / "q")]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"] and not any((tmp_path / "q").iterdir())


def test_phi3_fused_projections_are_quantized_each_with_its_own_tensor_scale(tmp_path, demo_model_dir):
    """Phi-3's ``qkv_proj`` and ``gate_up_proj`` are NVFP4 with one ``weight_scale_2`` each, as ModelOpt exports
    them, and Ember keeps them packed and runs them like transformers on the dequantized weights."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from tests.conftest import save_with_tokenizer
    from tests.engine.test_phi3 import CONFIG

    torch.manual_seed(0)
    src = save_with_tokenizer(Phi3ForCausalLM(Phi3Config(**CONFIG)), tmp_path / "phi3", demo_model_dir)
    dst = tmp_path / "phi3-nvfp4"
    assert quantize.main([str(src), str(dst)]) == 0
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    for m, rows in (("self_attn.qkv_proj", 128), ("mlp.gate_up_proj", 192)):
        m = f"model.layers.1.{m}"
        assert t[f"{m}.weight"].dtype == torch.uint8 and t[f"{m}.weight"].shape == (rows, 32)
        assert t[f"{m}.weight_scale_2"].shape == ()
    model = ember_model(dst)
    for layer in model.model.layers:
        assert isinstance(layer.self_attn.qkv_proj, NVFP4Linear) and isinstance(layer.mlp.gate_up_proj, NVFP4Linear)
    prompt = prompts(1, seed=5, min_len=20, max_len=20)[0]
    want = hf_logits(write_dequantized(dst, tmp_path / "dequantized"), prompt)
    assert ((ember_logits(model, prompt) - want).norm() / want.norm()).item() < 1e-5
