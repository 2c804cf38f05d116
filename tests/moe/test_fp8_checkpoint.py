"""Block-quantized FP8 checkpoints (DeepSeek / Qwen ``-FP8`` layout: e4m3 weights with ``weight_scale_inv`` per
block, ``quant_method: fp8``): Ember dequantizes on load and decodes what transformers decodes from the same
dequantized weights, alone or over two tensor-parallel ranks (each dequantizing its slice); the mistakes a broken
checkpoint can hold are named."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ember.engine import fp8_loading
from ember.engine.nvfp4_loading import QuantizationError
from tests.moe.conftest import assert_two_ranks_match_one, clear_margin, ember_greedy, hf_greedy, prompts

BLOCK = (32, 48)  # 64 and 96 wide projections: the last row / column of blocks is partial
FP8_MAX = 448.0


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight and fp32 ``weight_scale_inv`` (block amax / 448), as the FP8 releases store them."""
    n, k = w.shape
    bn, bk = BLOCK
    scale = torch.zeros(-(-n // bn), -(-k // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max().clamp(min=1e-12) / FP8_MAX
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _write(src: Path, fp8_dir: Path, ref_dir: Path) -> None:
    """The FP8 checkpoint of ``src`` (every decoder projection, experts included) and its dequantized twin."""
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if ".layers." in name and name.endswith("proj.weight") and t.dim() == 2:
            q, s = _quantize(t.float())
            fp8[name], fp8[name + "_scale_inv"] = q, s
            fp8[name[: -len(".weight")] + ".input_scale"] = torch.ones(())  # static activation scale: dropped
            ref[name] = fp8_loading.dequantize(q, s, BLOCK)
        else:
            fp8[name] = ref[name] = t
    for out, data in ((fp8_dir, fp8), (ref_dir, ref)):
        out.mkdir(parents=True, exist_ok=True)
        save_file(data, str(out / "model.safetensors"), metadata={"format": "pt"})
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / name, out / name)
    cfg = json.loads((src / "config.json").read_text())
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (fp8_dir / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def fp8_dirs(tiny_moe_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8")
    _write(tiny_moe_dir, root / "fp8", root / "ref")
    return root / "fp8", root / "ref"


def test_dequantize_scales_each_block_including_partial_ones():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 100, generator=g)
    q, s = _quantize(w)
    got = fp8_loading.dequantize(q, s, BLOCK)
    assert got[64:, 96:].abs().max() > 0  # the partial corner block is scaled, not dropped
    for i, j in ((0, 0), (2, 2), (1, 0)):
        rows, cols = slice(i * 32, (i + 1) * 32), slice(j * 48, (j + 1) * 48)
        assert torch.equal(got[rows, cols], q[rows, cols].float() * s[i, j])
    assert ((got - w).norm() / w.norm()).item() < 0.05  # e4m3's rounding, no more


def test_greedy_equals_transformers_on_the_dequantized_weights(fp8_dirs):
    fp8_dir, ref_dir = fp8_dirs
    ps = prompts(8, seed=2)
    ps, expected = clear_margin(ps, hf_greedy(ref_dir, ps), need=6)
    assert ember_greedy(fp8_dir, ps) == expected


def test_each_rank_dequantizes_its_slice_by_the_blocks_it_cuts(fp8_dirs):
    """TP=2 cuts 96-wide blocks (o_proj's 64 columns, 32 each) and 32-row blocks (experts' 32 rows, 16 each): every
    tensor a rank receives is exactly its slice of what one process dequantizes, and no scale tensor is left over."""
    from ember.engine import loader
    from ember.engine.distributed import TensorParallel, _split_rule, iter_shard_weights

    fp8_dir = fp8_dirs[0]
    whole = dict(fp8_loading.dequantized(loader.iter_weights(fp8_dir), BLOCK))
    for rank in range(2):
        shard = iter_shard_weights(fp8_dir, TensorParallel(rank, 2), fp8_block=BLOCK)
        got = dict(fp8_loading.dequantized(shard, BLOCK))  # as the engine's load_model reads a stream
        assert got.keys() == whole.keys()
        for name, t in got.items():
            kind, dim = _split_rule(name)[:2]
            want = whole[name] if kind == "replicate" else whole[name].chunk(2, dim=dim)[rank]
            assert torch.equal(t.to(want.dtype), want), name


def test_two_ranks_decode_what_one_process_does(fp8_dirs):
    assert_two_ranks_match_one(fp8_dirs[0], prompts(4, seed=4, min_len=4, max_len=30), 6)


@pytest.mark.parametrize("case", ["no scale", "scale shape", "no block size"])
def test_a_broken_checkpoint_names_the_tensor(fp8_dirs, tmp_path, case):
    from ember.engine.engine import Engine

    fp8_dir = fp8_dirs[0]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fp8_dir / name, tmp_path / name)
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    cfg = json.loads((fp8_dir / "config.json").read_text())
    bad = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    if case == "no scale":
        del tensors[bad]
        match = "o_proj.weight is FP8 but the checkpoint has no .*o_proj.weight_scale_inv"
    elif case == "scale shape":
        tensors[bad] = tensors[bad][:1]
        match = r"o_proj.weight_scale_inv has shape \(1, 2\), expected \(2, 2\)"
    else:
        del cfg["quantization_config"]["weight_block_size"]
        match = "without weight_block_size"
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationError, match=match):
        Engine.from_pretrained(tmp_path, device="cpu", dtype="float32", num_kv_blocks=8)
