"""Block-quantized FP8 checkpoints (DeepSeek / Qwen ``-FP8`` layout: e4m3 weights with ``weight_scale_inv`` per
block, ``quant_method: fp8``): experts and decoder projections stay e4m3 (W8A16 in the grouped GEMM), and Ember
decodes what transformers decodes from the same dequantized weights, alone or over two tensor-parallel ranks (each
keeping whole scale blocks, or dequantizing a slice that cuts them); a broken checkpoint's mistakes are named."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ember.engine import fp8_loading
from ember.kernels import fp8_block
from ember.kernels.fp8_block import FP8BlockTensor
from ember.engine.nvfp4_loading import QuantizationError
from tests.moe.conftest import (assert_two_ranks_match_one, clear_margin, compressed_tensors_fp8, ember_greedy,
                                ember_logits, ember_model, hf_greedy, prompts, run_greedy, save_fused_experts,
                                save_with_tokenizer)

BLOCK = (32, 48)  # 64 and 96 wide projections: the last row / column of blocks is partial
SMALL_BLOCK = (16, 16)  # two ranks' 16 expert channels each are whole blocks: experts stay FP8 under TP=2


COMPRESSED_TENSORS_CHANNEL = compressed_tensors_fp8("channel")


def _write(src: Path, fp8_dir: Path, ref_dir: Path, block: tuple[int, int] = BLOCK, layout: str = "block") -> None:
    """The FP8 checkpoint of ``src`` (every decoder projection, experts included) and its dequantized twin.
    ``layout``: ``block`` (DeepSeek/Qwen releases: ``weight_scale_inv`` per ``block``), ``channel``
    (compressed-tensors: ``weight_scale [N, 1]``), ``tensor`` (ModelOpt: a scalar ``weight_scale``, declared in
    ``hf_quant_config.json``) or ``mixed`` (compressed-tensors config groups: attention per channel, the rest per
    tensor)."""
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    grid = {"block": block, "channel": (1, fp8_block.CHANNEL), "tensor": (fp8_block.CHANNEL, fp8_block.CHANNEL)}
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if ".layers." in name and name.endswith(("proj.weight", "proj_with_mqa.weight", ".w1.weight", ".w2.weight",
                                                 ".w3.weight")) and t.dim() == 2:
            own = ("channel" if ".self_attn." in name else "tensor") if layout == "mixed" else layout
            q = fp8_block.quantize(t, grid[own])
            scale_name = name + "_scale_inv" if layout == "block" else name[: -len(".weight")] + ".weight_scale"
            fp8[name], fp8[scale_name] = q.weight, q.scale.reshape(()) if own == "tensor" else q.scale
            fp8[name[: -len(".weight")] + ".input_scale"] = torch.ones(())  # static activation scale: dropped
            ref[name] = q.dequantize()
        else:
            fp8[name] = ref[name] = t
    for out, data in ((fp8_dir, fp8), (ref_dir, ref)):
        out.mkdir(parents=True, exist_ok=True)
        save_file(data, str(out / "model.safetensors"), metadata={"format": "pt"})
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / name, out / name)
    cfg = json.loads((src / "config.json").read_text())
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    if layout == "block":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)}
    elif layout == "channel":
        cfg["quantization_config"] = COMPRESSED_TENSORS_CHANNEL
    elif layout == "mixed":
        per_tensor = compressed_tensors_fp8("tensor")["config_groups"]["group_0"]
        cfg["quantization_config"] = {**COMPRESSED_TENSORS_CHANNEL, "config_groups": {
            "attention": {**COMPRESSED_TENSORS_CHANNEL["config_groups"]["group_0"], "targets": ["re:.*self_attn.*"]},
            "rest": {**per_tensor, "targets": ["re:.*mlp.*"]}}}
    else:
        (fp8_dir / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}))
    (fp8_dir / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def fp8_dirs(tiny_moe_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8")
    _write(tiny_moe_dir, root / "fp8", root / "ref")
    return root / "fp8", root / "ref"


def test_dequantize_scales_each_block_including_partial_ones():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 100, generator=g)
    q = fp8_block.quantize(w, BLOCK)
    got = fp8_block.dequantize(q.weight, q.scale, BLOCK)  # what the loader multiplies by (after scale_grid)
    assert got[64:, 96:].abs().max() > 0  # the partial corner block is scaled, not dropped
    for i, j in ((0, 0), (2, 2), (1, 0)):
        rows, cols = slice(i * 32, (i + 1) * 32), slice(j * 48, (j + 1) * 48)
        assert torch.equal(got[rows, cols], q.weight[rows, cols].float() * q.scale[i, j])
    assert ((got - w).norm() / w.norm()).item() < 0.05  # e4m3's rounding, no more


def test_experts_and_projections_stay_fp8(fp8_dirs):
    """The experts and every decoder projection keep one byte per weight with their block scales (fused q/k/v and
    gate/up partitions each start on a scale-block row); embeddings, norms, routers and the LM head do not."""
    from ember.engine import loader
    from ember.engine.fp8_loading import FP8Linear
    from ember.engine.models import get_model_class

    cfg = loader.load_model_config(fp8_dirs[0])
    assert get_model_class(cfg.architecture)(cfg, 64).model.layers[0].mlp.experts.w13.is_meta  # not allocated yet
    model = ember_model(fp8_dirs[0])
    ex = model.model.layers[0].mlp.experts
    assert isinstance(ex.quant13, FP8BlockTensor) and ex.w13 is None and ex.w2 is None
    assert ex.quant13.weight.dtype == torch.float8_e4m3fn and ex.quant13.weight.shape == (8, 64, 64)
    assert ex.quant13.scale.shape == (8, 2, 2) and ex.quant2.scale.shape == (8, 2, 1)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, FP8Linear) and qkv.weight.shape == (64 + 32 + 32, 64) and qkv.scale.shape == (4, 2)
    dense = model.model.layers[1].mlp
    assert isinstance(dense.gate_up_proj, FP8Linear) and isinstance(dense.down_proj, FP8Linear)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.layers[0].mlp.gate.weight.dtype == torch.float32


def test_triton_fp8_path_in_the_model_matches_the_torch_path(fp8_dirs, monkeypatch):
    """The grouped GEMM (interpreter on CPU) decodes the e4m3 experts and projections by their block scales."""
    from ember.kernels import moe

    prompt = prompts(1, seed=9, min_len=20, max_len=20)[0]
    want = ember_logits(ember_model(fp8_dirs[0]), prompt)
    monkeypatch.setenv("EMBER_MOE", "triton")
    calls = []
    for fn in ("fused_moe", "block_fp8_linear"):
        real = getattr(moe, fn)
        monkeypatch.setattr(moe, fn, lambda *a, _real=real, _fn=fn, **k: calls.append(_fn) or _real(*a, **k))
    got = ember_logits(ember_model(fp8_dirs[0]), prompt)
    assert calls.count("fused_moe") == 2 and calls.count("block_fp8_linear") == 3 * 2 + 2
    assert ((got - want).norm() / want.norm()).item() < 1e-4


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
    fmt = fp8_loading.fp8_format(loader.load_model_config(fp8_dir).raw, fp8_dir)
    whole = dict(fp8_loading.dequantized(loader.iter_weights(fp8_dir), fmt))
    for rank in range(2):
        shard = iter_shard_weights(fp8_dir, TensorParallel(rank, 2), fp8=fmt)
        got = dict(fp8_loading.dequantized(shard, fmt))  # as the engine's load_model reads a stream
        assert got.keys() == whole.keys()
        for name, t in got.items():
            kind, dim = _split_rule(name)[:2]
            want = whole[name] if kind == "replicate" else whole[name].chunk(2, dim=dim)[rank]
            assert torch.equal(t.to(want.dtype), want), name


def test_two_ranks_dequantize_what_their_share_cuts_and_keep_the_rest(fp8_dirs):
    """With 32x48 blocks, a rank's 16 expert channels, 16 rows of k and v, 32 columns of o_proj and 48 rows of
    gate/up each cut a block: those are dequantized (the experts with a log line); the dense down projection's 48
    columns per rank are whole blocks and stay FP8. Decode is unchanged."""
    from ember.engine.fp8_loading import FP8Linear

    def check(engine):
        layers = engine.runner.model.model.layers
        assert layers[0].mlp.experts.quant13 is None and layers[0].mlp.experts.w13.dtype == torch.float32
        assert not isinstance(layers[0].self_attn.qkv_proj, FP8Linear)
        assert not isinstance(layers[0].self_attn.o_proj, FP8Linear)
        assert not isinstance(layers[1].mlp.gate_up_proj, FP8Linear)
        assert isinstance(layers[1].mlp.down_proj, FP8Linear) and layers[1].mlp.down_proj.weight.shape == (64, 48)

    assert_two_ranks_match_one(fp8_dirs[0], prompts(4, seed=4, min_len=4, max_len=30), 6, check)


def test_two_ranks_keep_whole_blocks_in_fp8(tiny_moe_dir, tmp_path):
    """With 16x16 blocks every rank's share is whole blocks: its experts and projections stay e4m3 with the scales
    that cover its slice, and two ranks decode what one process does."""
    _write(tiny_moe_dir, tmp_path / "fp8", tmp_path / "ref", SMALL_BLOCK)

    from ember.engine.fp8_loading import FP8Linear

    def check(engine):
        layer = engine.runner.model.model.layers[0]
        ex = layer.mlp.experts
        assert isinstance(ex.quant13, FP8BlockTensor) and ex.quant13.weight.shape == (8, 32, 64)
        assert ex.quant13.scale.shape == (8, 2, 4) and ex.quant2.scale.shape == (8, 4, 1)
        qkv = layer.self_attn.qkv_proj
        assert isinstance(qkv, FP8Linear) and qkv.weight.shape == (32 + 16 + 16, 64) and qkv.scale.shape == (4, 4)
        assert isinstance(layer.self_attn.o_proj, FP8Linear) and layer.self_attn.o_proj.scale.shape == (4, 2)

    assert_two_ranks_match_one(tmp_path / "fp8", prompts(4, seed=4, min_len=4, max_len=30), 6, check)


@pytest.mark.parametrize("case", ["no scale", "scale shape", "expert scale shape", "no block size", "no config"])
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
    elif case == "expert scale shape":
        bad = "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"
        tensors[bad] = tensors[bad][:, :1]
        match = r"experts.3.up_proj.weight_scale_inv has shape \(1, 1\), expected \(1, 2\)"
    elif case == "no block size":
        del cfg["quantization_config"]["weight_block_size"]
        match = "without weight_block_size"
    else:  # FP8 tensors that config.json does not declare (it was reported as a broken NVFP4 module)
        del cfg["quantization_config"]
        tensors = {k: v for k, v in tensors.items() if not k.endswith("_scale_inv")}  # nor scales: never cast raw
        match = r"weight is FP8 \(F8_E4M3\) but the checkpoint declares no quantization"
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationError, match=match):
        Engine.from_pretrained(tmp_path, device="cpu", dtype="float32", num_kv_blocks=8)


@pytest.mark.parametrize("layout", ["channel", "tensor", "mixed"])
def test_per_channel_and_per_tensor_checkpoints_stay_fp8(tiny_moe_dir, tmp_path, layout):
    """compressed-tensors' per-channel FP8 and ModelOpt's per-tensor FP8 keep one byte per weight, with a scale per
    output row (a fused q/k/v carries each part's tensor scale on its rows); greedy tokens equal transformers' on
    the dequantized weights."""
    from ember.engine.fp8_loading import FP8Linear

    _write(tiny_moe_dir, tmp_path / "fp8", tmp_path / "ref", layout=layout)
    model = ember_model(tmp_path / "fp8")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, FP8Linear) and qkv.block == (1, fp8_block.CHANNEL) and qkv.scale.shape == (128, 1)
    if layout == "tensor":
        assert qkv.scale[:64].unique().numel() == 1 and qkv.scale[64].item() != qkv.scale[0].item()
    assert isinstance(model.model.layers[0].mlp.experts.quant13, FP8BlockTensor)
    ps = prompts(6, seed=5, min_len=3, max_len=30)
    ps, expected = clear_margin(ps, hf_greedy(tmp_path / "ref", ps), need=4)
    assert ember_greedy(tmp_path / "fp8", ps) == expected


@pytest.mark.parametrize("layout", ["channel", "mixed"])
def test_two_ranks_keep_per_channel_fp8_whole(tiny_moe_dir, tmp_path, layout):
    """A per-channel (or per-tensor) scale spans any K: every rank's slice of every projection and expert stays
    FP8."""
    from ember.engine.fp8_loading import FP8Linear

    _write(tiny_moe_dir, tmp_path / "fp8", tmp_path / "ref", layout=layout)

    def check(engine):
        layer = engine.runner.model.model.layers[0]
        assert isinstance(layer.self_attn.o_proj, FP8Linear) and layer.self_attn.o_proj.weight.shape == (64, 32)
        down = layer.mlp.experts.quant2
        assert isinstance(down, FP8BlockTensor) and down.scale.shape == (8, 64, 1)

    assert_two_ranks_match_one(tmp_path / "fp8", prompts(4, seed=6, min_len=4, max_len=30), 6, check)


def test_the_fp8_formats_are_read_from_their_configs(tmp_path):
    from ember.engine.fp8_loading import fp8_format

    assert fp8_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}).block \
        == (128, 128)
    auto = fp8_format({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})
    assert (auto.granularity, auto.scale_suffix) == ("tensor", ".weight_scale")
    assert fp8_format({"quantization_config": COMPRESSED_TENSORS_CHANNEL}).granularity == "channel"
    blocked = json.loads(json.dumps(COMPRESSED_TENSORS_CHANNEL))
    blocked["config_groups"]["group_0"]["weights"] |= {"strategy": "block", "block_structure": [128, 64]}
    assert fp8_format({"quantization_config": blocked}).block == (128, 64)
    int4 = json.loads(json.dumps(COMPRESSED_TENSORS_CHANNEL))
    int4["config_groups"]["group_0"]["weights"] |= {"type": "int", "num_bits": 4}
    assert fp8_format({"quantization_config": int4}) is None  # not FP8: refused elsewhere, naming the method
    grouped = json.loads(json.dumps(COMPRESSED_TENSORS_CHANNEL))
    grouped["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    with pytest.raises(QuantizationError, match="strategy 'group' is not supported"):
        fp8_format({"quantization_config": grouped})
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    assert fp8_format({}, tmp_path).granularity == "tensor" and fp8_format({}) is None


class _CountAllocations:
    """Bytes of every tensor the aten factory ops create while active (a torch dispatch mode)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.zeros,
                                           torch.ops.aten.empty_like, torch.ops.aten.zeros_like) \
                        and isinstance(out, torch.Tensor) and out.device.type != "meta":
                    counter.bytes += out.numel() * out.element_size()
                return out

        self.bytes, self._mode = 0, Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def test_loading_never_allocates_fp8_layers_in_the_model_dtype(tmp_path):
    """The model is built on the meta device and allocated once its FP8 layers are in place, so loading a dense
    model stored per-channel FP8 never allocates its projections in fp32 (which alone is 4x the FP8 bytes)."""
    from ember.engine import loader
    from ember.engine.engine import load_model

    h, inter, layers = 256, 1024, 2
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1280, hidden_size=h,
               intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
               quantization_config=COMPRESSED_TENSORS_CHANNEL)
    shapes = {"self_attn.q_proj": (256, h), "self_attn.k_proj": (128, h), "self_attn.v_proj": (128, h),
              "self_attn.o_proj": (h, 256), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(1280, h, generator=g), "model.norm.weight": torch.ones(h)}
    fp8_bytes = 0
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
                    p + "self_attn.q_norm.weight": torch.ones(64), p + "self_attn.k_norm.weight": torch.ones(64)}
        for name, (n, k) in shapes.items():
            tensors[p + name + ".weight"] = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn)
            tensors[p + name + ".weight_scale"] = torch.full((n, 1), 0.01)
            fp8_bytes += n * k
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mc = loader.load_model_config(tmp_path)
    with _CountAllocations() as allocated:
        model = load_model(tmp_path, mc, 64, torch.device("cpu"), torch.float32)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    embeddings = 1280 * h * 4
    assert allocated.bytes - embeddings < 2 * fp8_bytes, (allocated.bytes, fp8_bytes)


def test_quantization_fp8_quantizes_an_unquantized_checkpoint_as_it_loads(tiny_moe_dir, tmp_path):
    """``--quantization fp8`` on a full-precision checkpoint: every decoder projection and expert is quantized per
    output channel as it loads (what compressed-tensors' per-channel checkpoints hold), so greedy tokens equal
    transformers' on exactly those weights dequantized; two ranks quantize whole rows before taking their slices,
    so they decode what one process does. On a quantized checkpoint the flag must name its quantization."""
    from ember.engine.config import ConfigError
    from ember.engine.engine import Engine
    from ember.engine.fp8_loading import FP8Linear

    _write(tiny_moe_dir, tmp_path / "fp8", tmp_path / "ref", layout="channel")  # the same quantization, on disk
    engine = Engine.from_pretrained(tiny_moe_dir, dtype=torch.float32, device="cpu", num_kv_blocks=64,
                                    max_num_seqs=16, quantization="fp8")
    layer = engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, FP8Linear) and layer.self_attn.qkv_proj.block[0] == 1
    assert isinstance(layer.mlp.experts.quant13, FP8BlockTensor)
    ps = prompts(6, seed=7, min_len=3, max_len=30)
    ps, expected = clear_margin(ps, hf_greedy(tmp_path / "ref", ps), need=4)
    assert run_greedy(engine, ps, 8) == expected

    def check(tp_engine):
        o = tp_engine.runner.model.model.layers[0].self_attn.o_proj
        assert isinstance(o, FP8Linear) and o.weight.shape == (64, 32)

    assert_two_ranks_match_one(tiny_moe_dir, ps[:3], 6, check, quantization="fp8")
    # on a quantized checkpoint the name must be its own quantization, as vLLM rules
    with pytest.raises(ConfigError, match="quantized with compressed-tensors .*give --quantization compressed"):
        Engine.from_pretrained(tmp_path / "fp8", device="cpu", num_kv_blocks=8, quantization="fp8")
    named = Engine.from_pretrained(tmp_path / "fp8", dtype=torch.float32, device="cpu", num_kv_blocks=64,
                                   max_num_seqs=16, quantization="compressed-tensors")
    assert run_greedy(named, ps, 8) == expected



@pytest.mark.parametrize("transposed", [False, True], ids=["transformers", "released"])
def test_quantization_fp8_quantizes_fused_expert_stacks(tiny_moe_dir, tmp_path, transposed):
    """``--quantization fp8`` on experts stored fused (transformers 5's ``gate_up_proj [E, 2I, H]`` / ``down_proj
    [E, H, I]``, or transposed as Qwen3-VL-MoE and Llama 4 release them): every expert is e4m3, quantized exactly as
    the same experts stored one by one are (equal logits), within e4m3's rounding of the unquantized model."""
    fused = save_fused_experts(tiny_moe_dir, tmp_path / "fused", transposed)
    model = ember_model(fused, quantization="fp8")
    for i in (0, 2):
        ex = model.model.layers[i].mlp.experts
        assert ex.w13 is None and ex.w2 is None
        assert ex.quant13.weight.dtype == ex.quant2.weight.dtype == torch.float8_e4m3fn
        assert ex.quant13.scale.shape == (8, 64, 1) and ex.quant2.scale.shape == (8, 64, 1)  # per output channel
    prompt = prompts(1, seed=7, min_len=12, max_len=12)[0]
    got = ember_logits(model, prompt)
    assert torch.equal(got, ember_logits(ember_model(tiny_moe_dir, quantization="fp8"), prompt))
    want = ember_logits(ember_model(tiny_moe_dir), prompt)
    assert ((got - want).norm() / want.norm()).item() < 0.15  # e4m3 rounding, not wrong weights


@pytest.mark.parametrize("transposed", [False, True], ids=["transformers", "released"])
def test_two_ranks_quantize_fused_expert_stacks_as_one_process(tiny_moe_dir, tmp_path, transposed):
    """``--quantization fp8`` over two ranks on fused expert stacks: each rank holds exactly its slice of every
    expert as one process quantizes it. down_proj's per-row scales come from whole rows, not the rank's half of
    each row (TP=2 was valid FP8 but not bit-exact with TP=1)."""
    from ember.engine import distributed

    fused = save_fused_experts(tiny_moe_dir, tmp_path / "fused", transposed)
    with safe_open(str(tiny_moe_dir / "model.safetensors"), framework="pt") as f:
        experts = {k: f.get_tensor(k) for k in f.keys() if ".mlp.experts." in k}
    for rank in (0, 1):
        stream = distributed.iter_shard_weights(fused, distributed.TensorParallel(rank, 2), fp8=fp8_loading.ON_LOAD)
        stream.keep_fp8 = lambda module: ".mlp.experts." in module
        got = dict(fp8_loading.dequantized(stream, fp8_loading.ON_LOAD, "fused", stream.keep_fp8))
        for name, w in experts.items():
            want = fp8_block.quantize(w, fp8_loading.ON_LOAD.block)
            n, k = want.weight.shape
            down = name.endswith("down_proj.weight")
            cols = slice(rank * k // 2, (rank + 1) * k // 2) if down else slice(None)
            rows = slice(None) if down else slice(rank * n // 2, (rank + 1) * n // 2)
            scale = got[name[: -len(".weight")] + fp8_loading.SCALE]
            assert torch.equal(got[name].float(), want.weight[rows, cols].float()), name
            assert torch.equal(scale, want.scale[rows]), name


def test_quantization_fp8_quantizes_mixtral_named_experts(tmp_path, demo_model_dir):
    """Mixtral's (and MiniMax-M2's) experts, ``block_sparse_moe.experts.{e}.w1/w3/w2``, are quantized too."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    hf = MixtralForCausalLM(MixtralConfig(
        vocab_size=1280, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=0.1, tie_word_embeddings=True))
    path = save_with_tokenizer(hf, tmp_path / "mixtral", demo_model_dir)
    model = ember_model(path, quantization="fp8")
    ex = model.model.layers[0].mlp.experts
    assert ex.w13 is None and ex.quant13.weight.dtype == ex.quant2.weight.dtype == torch.float8_e4m3fn
    prompt = prompts(1, seed=7, min_len=12, max_len=12)[0]
    want = ember_logits(ember_model(path), prompt)
    got = ember_logits(model, prompt)
    assert ((got - want).norm() / want.norm()).item() < 0.15  # e4m3 rounding, not wrong weights

def test_a_quantization_flag_names_the_checkpoints_own_method(tmp_path):
    """vLLM's rule for ``--quantization`` on a quantized checkpoint: the name must be the checkpoint's method (then
    it is loaded as it is); ``fp8`` on an unquantized checkpoint quantizes it as it loads; anything else is refused
    naming both."""
    from ember.engine.config import ConfigError
    from ember.engine.fp8_loading import ON_LOAD, resolve_format

    nvfp4 = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
    assert resolve_format(nvfp4, tmp_path, "modelopt_fp4") is None  # the NVFP4 loader takes it from here
    with pytest.raises(ConfigError, match="quantized with modelopt_fp4 .*give --quantization modelopt_fp4"):
        resolve_format(nvfp4, tmp_path, "fp8")
    assert resolve_format({"quantization_config": {"quant_method": "mxfp4"}}, tmp_path, "mxfp4") is None
    block = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert resolve_format(block, tmp_path, "fp8").granularity == "block"
    assert resolve_format({}, tmp_path, "fp8") is ON_LOAD
    with pytest.raises(ConfigError, match="the checkpoint is not quantized"):
        resolve_format({}, tmp_path, "modelopt")
    legacy = tmp_path / "modelopt"
    legacy.mkdir()
    (legacy / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    assert resolve_format({}, legacy, "modelopt").source == str(legacy / "hf_quant_config.json")
