"""MXFP4 (gpt-oss expert format): the torch reference against transformers' own dequantizer, the quantizer's
round trip, and a tiny gpt-oss whose experts stay MXFP4 in Ember generating what transformers generates from the
dequantized checkpoint."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ember.kernels import mxfp4
from ember.kernels.mxfp4 import MXFP4Tensor
from tests.moe.conftest import (assert_two_ranks_match_one, clear_margin, ember_model, hf_greedy, prompts,
                                run_greedy)
from tests.moe.test_gpt_oss import save_tiny_gpt_oss


def _random_packed(e: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(112, 135, (e, n, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_matches_transformers_convert_moe_packed_tensors():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_packed(3, 10, 96, seed=0)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    ours = mxfp4.dequantize(blocks.reshape(3, 10, -1), scales)  # [E, N, K]
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_e8m0_scales_are_powers_of_two_with_bias_127():
    assert mxfp4.e8m0_to_float(torch.tensor([127, 128, 120, 0], dtype=torch.uint8)).tolist() == \
        [1.0, 2.0, 2.0 ** -7, 2.0 ** -127]


def test_quantize_round_trips_and_stays_close():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 16, 128, generator=g) * torch.logspace(-3, 1, 128)  # blocks of very different magnitude
    q = mxfp4.quantize(w)
    deq = q.dequantize()
    assert ((deq - w).norm() / w.norm()).item() < 0.2  # E2M1 steps plus the spec's clipping above 6 * scale
    again = mxfp4.quantize(deq)  # a dequantized tensor is exactly representable: same bytes
    assert torch.equal(again.weight, q.weight) and torch.equal(again.scale, q.scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.randn(4, 48))


def write_mxfp4_checkpoint(src, dst):
    """``src``'s experts quantized as OpenAI's checkpoints hold them (``*_blocks``/``*_scales``, rows = outputs,
    gate/up interleaved), everything else unchanged; config.json declares ``quant_method: mxfp4``."""
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for name, v in t.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            q = mxfp4.quantize(v.transpose(1, 2))  # [E, H, 2I] -> rows 2I; [E, I, H] -> rows H
            e, n = q.weight.shape[:2]
            out[f"{name}_blocks"] = q.weight.reshape(e, n, -1, 16).contiguous()
            out[f"{name}_scales"] = q.scale.contiguous()
        else:
            out[name] = v
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def write_dequantized(qdir, dst):
    """The reference for an MXFP4 checkpoint, dequantized by transformers' own converter and saved in the bf16
    checkpoints' layout (``gate_up_proj [E, H, 2I]``), so transformers runs it unquantized."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    with safe_open(str(qdir / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for name, v in t.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            out[base] = convert_moe_packed_tensors(v, t[f"{base}_scales"], dtype=torch.float32)
        else:
            out[name] = v
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((qdir / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qdir / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def mxfp4_dirs(tmp_path_factory, demo_model_dir):
    src = save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss-bf16"), demo_model_dir, seed=3)
    q = write_mxfp4_checkpoint(src, tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    return q, write_dequantized(q, tmp_path_factory.mktemp("gpt-oss-mxfp4-dequantized"))


def test_mxfp4_experts_stay_packed(mxfp4_dirs):
    model = ember_model(mxfp4_dirs[0])
    ex = model.model.layers[0].mlp.experts
    w13, w2 = ex.stacks()
    assert isinstance(w13, MXFP4Tensor) and isinstance(w2, MXFP4Tensor)
    assert w13.weight.dtype == torch.uint8 and w13.shape == (8, 64, 64) and w2.shape == (8, 64, 32)
    assert ex.w13 is None and ex.w2 is None


def test_mxfp4_greedy_equals_transformers_on_the_dequantized_checkpoint(mxfp4_dirs):
    from ember.engine.engine import Engine

    qdir, ref = mxfp4_dirs
    ps = prompts(6, seed=4, min_len=10, max_len=30)
    ps, expected = clear_margin(ps, hf_greedy(ref, ps), need=4)
    engine = Engine.from_pretrained(qdir, dtype=torch.float32, device="cpu", num_kv_blocks=64, max_num_seqs=8)
    assert run_greedy(engine, ps, 8) == expected


# ---- the fused-MoE kernel (W4A16 family) with MXFP4 stacks, biases and the clamped GLU, under the interpreter ----

def _gpt_oss_moe_inputs(m: int, e: int, h: int, i: int, k: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    w13 = mxfp4.quantize(torch.randn(e, 2 * i, h, generator=g) * 0.3)
    w2 = mxfp4.quantize(torch.randn(e, h, i, generator=g) * 0.3)
    b13 = torch.randn(e, 2 * i, generator=g).to(dtype)
    b2 = torch.randn(e, h, generator=g).to(dtype) * 0.1
    x = torch.randn(m, h, generator=g).to(dtype)
    from ember.kernels import moe_reference

    tw, ti = moe_reference.topk_softmax_routing(torch.randn(m, e, generator=g), k)
    return x, w13, w2, b13, b2, tw, ti


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_fused_moe_kernel_mxfp4_with_biases_and_clamped_glu_matches_reference(m, dtype):
    from functools import partial

    from ember.kernels import moe, moe_reference

    x, w13, w2, b13, b2, tw, ti = _gpt_oss_moe_inputs(m, 8, 64, 96, 2, seed=m, dtype=dtype)
    want = moe_reference.fused_moe(x.float(), w13, w2, tw, ti, b13=b13.float(), b2=b2.float(),
                                   activation=partial(moe_reference.clamped_swiglu, limit=7.0, alpha=1.702))
    got = moe.fused_moe(x, w13, w2, tw, ti, b13=b13, b2=b2, swiglu=(7.0, 1.702))
    assert ((got.float() - want).norm() / want.norm()).item() < (1e-5 if dtype == torch.float32 else 3e-3)
    gate_up = torch.nn.functional.linear(x.float(), w13.dequantize()[int(ti[0, 0])], b13[int(ti[0, 0])].float())
    assert gate_up.abs().max() > 7.0  # the clamp is exercised


def test_fused_moe_kernel_dense_stacks_with_biases_and_clamped_glu_match_reference():
    from functools import partial

    from ember.kernels import moe, moe_reference

    x, w13, w2, b13, b2, tw, ti = _gpt_oss_moe_inputs(9, 4, 64, 32, 2, seed=1, dtype=torch.float32)
    d13, d2 = w13.dequantize(), w2.dequantize()
    want = moe_reference.fused_moe(x, d13, d2, tw, ti, b13=b13, b2=b2,
                                   activation=partial(moe_reference.clamped_swiglu, limit=5.0, alpha=1.5))
    got = moe.fused_moe(x, d13, d2, tw, ti, b13=b13, b2=b2, swiglu=(5.0, 1.5))
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    plain = moe.fused_moe(x, d13, d2, tw, ti)  # neither bias nor clamp: a different result
    assert ((plain - want).norm() / want.norm()).item() > 0.05


@pytest.mark.parametrize("which", ["mxfp4", "bf16-layout"])
def test_triton_fused_moe_in_the_model_matches_the_torch_path(mxfp4_dirs, which, monkeypatch):
    """The same fp32 gpt-oss with its MoE layers on the Triton kernels (interpreter on CPU)."""
    from tests.moe.conftest import ember_logits

    model = ember_model(mxfp4_dirs[0] if which == "mxfp4" else mxfp4_dirs[1])
    prompt = prompts(1, seed=9, min_len=13, max_len=13)[0]
    want = ember_logits(model, prompt)
    monkeypatch.setenv("EMBER_MOE", "triton")
    got = ember_logits(model, prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    assert not torch.equal(got, want)  # a different summation order: the kernels really ran


def test_two_tensor_parallel_ranks_split_mxfp4_experts_by_scale_blocks(tmp_path_factory, demo_model_dir):
    """intermediate_size 64 = two 32-blocks: each of 2 ranks reads one block of down_proj_blocks / _scales."""
    src = save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss-i64"), demo_model_dir, seed=5, intermediate_size=64)
    qdir = write_mxfp4_checkpoint(src, tmp_path_factory.mktemp("gpt-oss-i64-mxfp4"))

    def check(engine):
        w13, w2 = engine.runner.model.model.layers[0].mlp.experts.stacks()
        assert isinstance(w2, MXFP4Tensor) and w2.scale.shape == (8, 64, 1) and w13.shape == (8, 64, 64)

    assert_two_ranks_match_one(qdir, prompts(3, seed=6, min_len=5, max_len=20), 5, check)


def test_loader_names_missing_and_mismatched_expert_tensors(mxfp4_dirs):
    from ember.engine import loader
    from ember.engine.config import ConfigError
    from ember.engine.models import get_model_class

    qdir, ref = mxfp4_dirs
    cfg = loader.load_model_config(qdir)
    tensors = list(loader.iter_weights(qdir))
    model = get_model_class(cfg.architecture)(cfg, 64)
    with pytest.raises(ConfigError, match="model.layers.1.mlp.experts.down_proj_scales"):
        model.load_weights([(n, t) for n, t in tensors if n != "model.layers.1.mlp.experts.down_proj_scales"])
    dense = dict(loader.iter_weights(ref))
    model = get_model_class(cfg.architecture)(cfg, 64)
    with pytest.raises(ConfigError, match="unquantized but config.json"):
        model.load_weights(list(dense.items()))


@pytest.mark.parametrize("m", [3, 37])
def test_fused_moe_kernel_mxfp4_through_dot_scaled_matches_reference(m):
    """The Blackwell variant (packed E2M1 + E8M0 straight into ``tl.dot_scaled``), run by the interpreter in fp16."""
    from functools import partial

    from ember.kernels import moe, moe_reference

    x, w13, w2, b13, b2, tw, ti = _gpt_oss_moe_inputs(m, 8, 64, 96, 2, seed=m + 100, dtype=torch.float16)
    want = moe_reference.fused_moe(x.float(), w13, w2, tw, ti, b13=b13.float(), b2=b2.float(),
                                   activation=partial(moe_reference.clamped_swiglu, limit=7.0, alpha=1.702))
    got = moe.fused_moe(x, w13, w2, tw, ti, b13=b13, b2=b2, swiglu=(7.0, 1.702), dot_scaled=True)
    assert ((got.float() - want).norm() / want.norm()).item() < 3e-3
    assert moe.dot_scaled_mxfp4_works("cpu")
    assert not moe.mxfp4_dot_scaled_available(torch.device("cpu"))  # CPU and Hopper dequantize (W4A16)
