"""FP8 checkpoints: e4m3 weights with block, per-channel or per-tensor scales (`fp8_format` reads which).

- Block: ``config.json`` ``quantization_config`` ``quant_method: "fp8"`` with ``weight_block_size [bn, bk]``
  (DeepSeek-V3 and Qwen's ``-FP8`` releases: ``{m}.weight_scale_inv`` fp32 ``[ceil(N/bn), ceil(K/bk)]``) or
  compressed-tensors' ``block`` strategy (``{m}.weight_scale``); the last row and column of blocks may be partial.
- Per channel: compressed-tensors' ``channel`` strategy (``{m}.weight_scale [N, 1]``).
- Per tensor: ModelOpt ``quant_algo: FP8`` (``hf_quant_config.json`` or ``config.json``), compressed-tensors'
  ``tensor`` strategy, or ``quant_method: "fp8"`` without a block size (AutoFP8): a scalar ``{m}.weight_scale``.

Every scale becomes a grid of `FP8Format.block` (per channel and per tensor: ``(1, CHANNEL)``, one scale per output
row). Ember keeps weights packed where the model can run them so (``keeps_fp8``): MoE experts stay e4m3 stacks with
their scales (W8A16 in the fused-MoE kernel) and decoder projections become :class:`FP8Linear` (the same GEMM with
one expert), each where its fused parts and tensor-parallel slices start on block boundaries. Everything else is
dequantized as it loads to the model dtype. Activation scales (``input_scale``) are dropped: activations stay in the
model dtype. Under tensor parallelism each rank dequantizes only its slice, by the blocks its rows and columns fall
in, or keeps it packed with the part of its scales that covers it (`ember.engine.distributed`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ember.engine import loader
from ember.engine.config import ConfigError
from ember.engine.nvfp4_loading import SUPPORTED_QUANTIZATIONS, QuantizationError, use_triton
from ember.kernels import fp8_block

SCALE = ".weight_scale_inv"
"""The scales' suffix in DeepSeek's and Qwen's block releases, and the name of every scale grid the loaders pass on."""
_ACTIVATION_SCALES = (".input_scale", ".activation_scale")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")
"""transformers 5's fused expert stacks: every expert's gate and up rows of a layer in one tensor, down in another."""
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""Ember's fused projections and the checkpoint projections they stack, in row order."""
_WHOLE = -2
"""`install_linears`' partition key for a checkpoint tensor that is the fused projection itself."""


@dataclass(frozen=True)
class FP8Format:
    """How a checkpoint scales its e4m3 weights. ``granularity`` is ``"block"`` (a scale per ``block``), ``"channel"``
    (per output row; a scalar scale is a tensor's, as where config groups mix the two) or ``"tensor"`` (one per
    tensor); Ember keeps all three as a block grid, the latter two as ``(1, CHANNEL)`` (a tensor's scale repeated per
    row). ``scale_suffix`` names the scale tensors in the files."""

    granularity: str
    block: tuple[int, int]
    scale_suffix: str
    source: str
    on_load: bool = False
    """Not the checkpoint's: ``--quantization fp8`` quantizes its floating-point projections per channel as they
    load."""


ON_LOAD = FP8Format("channel", (1, fp8_block.CHANNEL), ".weight_scale", "--quantization fp8", on_load=True)
QUANTIZATIONS = ("fp8", "modelopt", "modelopt_fp4", "compressed-tensors", "mxfp4")
"""vLLM's ``--quantization`` names Ember serves: each must name the checkpoint's own quantization, except ``fp8``,
which also quantizes an unquantized checkpoint as it loads."""


def resolve_format(raw_config: dict[str, Any], model_dir: str | os.PathLike, quantization: str | None
                   ) -> FP8Format | None:
    """The FP8 format the engine loads ``model_dir`` with: the checkpoint's (`fp8_format`), or `ON_LOAD` for
    ``quantization="fp8"`` on an unquantized checkpoint; QuantizationError for a checkpoint quantized by a method
    Ember does not read (whatever the architecture), ConfigError for an unknown ``quantization`` or one asked of a
    checkpoint that is quantized otherwise."""
    declared = declared_quantization(raw_config, model_dir)
    if declared is not None and declared[0] not in QUANTIZATIONS:  # every architecture's load, before any tensor
        method, source = declared
        what = "names no quant_method" if method == "None" else f"quant_method {method!r} is not supported"
        raise QuantizationError(f"{source}: {what}; Ember reads {SUPPORTED_QUANTIZATIONS}")
    fmt = fp8_format(raw_config, model_dir)
    if quantization is None:
        return fmt
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if declared is None:
        if quantization == "fp8":
            return ON_LOAD
        raise ConfigError(f"--quantization {quantization}: the checkpoint is not quantized (only fp8 quantizes one "
                          "as it loads)")
    method, source = declared
    if method != quantization:
        raise ConfigError(f"--quantization {quantization}: the checkpoint is quantized with {method} ({source}); "
                          f"give --quantization {method} or leave it unset")
    return fmt  # as vLLM does: the name confirms the checkpoint's own quantization


def declared_quantization(raw_config: dict[str, Any], model_dir: str | os.PathLike) -> tuple[str, str] | None:
    """(vLLM's ``--quantization`` name, where it is declared) of the checkpoint's quantization, or None for an
    unquantized checkpoint: config.json's ``quantization_config`` (``quant_method``; ModelOpt's ``quant_algo``
    FP8 -> ``modelopt``, NVFP4 -> ``modelopt_fp4``), ModelOpt's ``hf_quant_config.json``, or the sidecar files
    vLLM also reads, AutoGPTQ's ``quantize_config.json`` (``gptq``) and AutoAWQ's ``quant_config.json`` (``awq``)."""
    modelopt = {"FP8": "modelopt", "NVFP4": "modelopt_fp4"}
    qc = raw_config.get("quantization_config")
    if isinstance(qc, dict):
        method = qc.get("quant_method")
        source = f"{Path(model_dir) / 'config.json'}:quantization_config"
        if method in (None, "modelopt") and qc.get("quant_algo") in modelopt:
            return modelopt[qc["quant_algo"]], source
        return str(method), source
    legacy = Path(model_dir) / "hf_quant_config.json"
    if legacy.exists():
        algo = _legacy_quant_algo(legacy)
        return modelopt.get(algo, f"modelopt ({algo})"), str(legacy)
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        sidecar = Path(model_dir) / name
        if sidecar.exists():
            try:
                data = json.loads(sidecar.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                data = None
            named = data.get("quant_method") if isinstance(data, dict) else None
            return str(named or method), str(sidecar)
    return None


def _legacy_quant_algo(legacy: Path) -> str | None:
    """ModelOpt's ``hf_quant_config.json`` ``quantization.quant_algo``; None when the file is malformed (the NVFP4
    reader names it)."""
    try:
        return (json.loads(legacy.read_text(encoding="utf-8")).get("quantization") or {}).get("quant_algo")
    except (json.JSONDecodeError, AttributeError):
        return None


def _quantizable_on_load(module: str) -> bool:
    """A decoder layer's projection (``*_proj``, MLA's ``kv_a_proj_with_mqa``), including per-expert ones (also
    Mixtral's and MiniMax-M2's ``experts.{e}.w1/w2/w3``)."""
    leaf = module.rsplit(".", 1)[-1]
    return ".layers." in module and (leaf.endswith(("proj", "proj_with_mqa"))
                                     or leaf in ("w1", "w2", "w3") and ".experts." in module)


def fused_expert_stack(name: str) -> tuple[str, str] | None:
    """(``...experts.`` prefix, ``gate_up_proj`` or ``down_proj``) of a decoder layer's fused expert stack (transformers
    5's key form), else None."""
    if ".layers." in name and name.endswith(_FUSED_EXPERTS):
        prefix, _, leaf = name.rpartition(".")
        return prefix + ".", leaf
    return None


def stack_expert(stack: tuple[str, str]) -> str:
    """The first expert's module a fused stack (`fused_expert_stack`) holds: what a model's keep rule is asked about
    the whole stack."""
    prefix, leaf = stack
    return prefix + ("0.gate_proj" if leaf == "gate_up_proj" else "0.down_proj")


def fused_expert_dims(gate_up: Sequence[int], down: Sequence[int]) -> tuple[int, int, bool] | None:
    """(I, H, transposed) of one layer's fused expert stacks from their shapes: transformers' ``[E, 2I, H]`` and
    ``[E, H, I]``, or transposed ``[E, H, 2I]`` and ``[E, I, H]`` (Qwen3-VL-MoE's and Llama 4's releases); no pair of
    shapes fits both. None when they fit neither."""
    if len(gate_up) != 3 or len(down) != 3 or gate_up[0] != down[0]:
        return None
    (_, a, b), (_, c, d) = gate_up, down
    if a == 2 * d and b == c:
        return d, c, False
    if b == 2 * c and a == d:
        return c, d, True
    return None


def packed_candidates(files: list[Path], fmt: FP8Format) -> dict[str, tuple[Path, list[int]]]:
    """Module -> (file, weight shape) of every module that can run packed: for an FP8 checkpoint, those with an
    e4m3 weight and its scale (`paired_scales`); quantizing on load, every 2-D floating-point projection weight of a
    decoder layer, and each expert's gate, up and down projections of a layer whose experts are fused
    (`fused_expert_dims`)."""
    if not fmt.on_load:
        return paired_scales(files, fmt.scale_suffix)
    out: dict[str, tuple[Path, list[int]]] = {}
    stacks: dict[str, dict[str, tuple[Path, list[int]]]] = {}
    for f in files:
        with loader.open_safetensors(f) as sf:
            for name in sf.keys():
                module = name[: -len(".weight")]
                stack = fused_expert_stack(name)
                if not (stack or name.endswith(".weight") and _quantizable_on_load(module)):
                    continue
                sl = sf.get_slice(name)
                if sl.get_dtype() not in ("F32", "F16", "BF16"):
                    continue
                if stack is not None:
                    stacks.setdefault(stack[0], {})[stack[1]] = (f, list(sl.get_shape()))
                elif len(sl.get_shape()) == 2:
                    out[module] = (f, list(sl.get_shape()))
    for prefix, pair in stacks.items():
        dims = fused_expert_dims(pair["gate_up_proj"][1], pair["down_proj"][1]) if len(pair) == 2 else None
        if dims is None:
            continue  # the model's loader names the stack that does not fit
        inter, hidden, _ = dims
        for e in range(pair["gate_up_proj"][1][0]):
            out[f"{prefix}{e}.gate_proj"] = out[f"{prefix}{e}.up_proj"] = (pair["gate_up_proj"][0], [inter, hidden])
            out[f"{prefix}{e}.down_proj"] = (pair["down_proj"][0], [hidden, inter])
    return out


def _block(value: Any, source: str) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or min(int(b) for b in value) < 1:
        raise QuantizationError(f"{source}: FP8 block size {value!r} is not [n, k]")
    return int(value[0]), int(value[1])


def _compressed_tensors(qc: dict[str, Any], source: str) -> FP8Format | None:
    """compressed-tensors' FP8 (``float-quantized``: every config group's weights ``type: float, num_bits: 8``), or
    None for its other schemes."""
    specs = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    if not specs or not all(w.get("type") == "float" and int(w.get("num_bits") or 0) == 8 for w in specs):
        return None
    strategies = {w.get("strategy") for w in specs}
    if strategies == {"channel", "tensor"}:         # per config group, as vLLM reads them: each scale says which
        strategies = {"channel"}
    if len(strategies) != 1:
        raise QuantizationError(f"{source}: FP8 config groups mix weight strategies {sorted(map(str, strategies))}")
    strategy = strategies.pop()
    if strategy == "block":
        return FP8Format("block", _block(specs[0].get("block_structure"), source), ".weight_scale", source)
    if strategy in ("channel", "tensor"):
        return FP8Format(strategy, (1, fp8_block.CHANNEL), ".weight_scale", source)
    raise QuantizationError(f"{source}: compressed-tensors FP8 weight strategy {strategy!r} is not supported "
                            "(tensor, channel or block)")


def weightless(qc: Any) -> bool:
    """A compressed-tensors ``quantization_config`` that quantizes no weights (no config group): only its
    ``kv_cache_scheme``, the per-layer ``k_scale`` / ``v_scale`` of an FP8 KV cache, which any checkpoint may carry."""
    return isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors" and not qc.get("config_groups")


def _check_kv_cache_scheme(qc: dict[str, Any], source: str) -> None:
    """QuantizationError unless a compressed-tensors ``kv_cache_scheme`` is absent or FP8 (8-bit float, the one KV
    cache quantization Ember has, `--kv-cache-dtype fp8`)."""
    kv = qc.get("kv_cache_scheme")
    if kv is None:
        return
    if not isinstance(kv, dict) or kv.get("type") != "float" or int(kv.get("num_bits") or 0) != 8:
        raise QuantizationError(f"{source}: kv_cache_scheme {kv!r} is not supported (only 8-bit float, the FP8 KV "
                                "cache)")


def fp8_format(raw_config: dict[str, Any], model_dir: str | os.PathLike | None = None) -> FP8Format | None:
    """The checkpoint's FP8 weight format, or None when its weights are not FP8. Read from ``config.json``'s
    ``quantization_config`` (``quant_method: fp8`` with ``weight_block_size`` as DeepSeek's and Qwen's releases, or
    without it per tensor as AutoFP8 writes; ``compressed-tensors`` FP8 per tensor, channel or block; ModelOpt's
    ``quant_algo: FP8``) or ModelOpt's ``hf_quant_config.json``."""
    root = Path(model_dir) if model_dir is not None else None
    source = str(root / "config.json") if root is not None else "config.json"
    qc = raw_config.get("quantization_config")
    if isinstance(qc, dict):
        method = qc.get("quant_method")
        src = source + ":quantization_config"
        if method == "fp8":
            if qc.get("weight_block_size") is None:
                return FP8Format("tensor", (1, fp8_block.CHANNEL), ".weight_scale", src)
            return FP8Format("block", _block(qc["weight_block_size"], src), SCALE, src)
        if method == "compressed-tensors":
            _check_kv_cache_scheme(qc, src)
            return _compressed_tensors(qc, src)
        if method in (None, "modelopt") and qc.get("quant_algo") == "FP8":
            return FP8Format("tensor", (1, fp8_block.CHANNEL), ".weight_scale", src)
    legacy = root / "hf_quant_config.json" if root is not None else None
    if legacy is not None and legacy.exists() and _legacy_quant_algo(legacy) == "FP8":
        return FP8Format("tensor", (1, fp8_block.CHANNEL), ".weight_scale", str(legacy))
    return None


def check_scale_shape(shape: list[int], scale: torch.Tensor, block: tuple[int, int], module: str,
                      source: str, suffix: str = SCALE) -> None:
    """QuantizationError unless ``scale`` has one entry per ``block`` of a weight of ``shape`` ``[N, K]``."""
    bn, bk = block
    if len(shape) != 2:
        raise QuantizationError(f"{source}: tensor {module}.weight is FP8 with shape {tuple(shape)}; FP8 weights "
                                "are [N, K]")
    n, k = shape
    want = (-(-n // bn), -(-k // bk))
    if scale.dim() != 2 or tuple(scale.shape) != want:
        raise QuantizationError(f"{source}: tensor {module}{suffix} has shape "
                                f"{tuple(scale.shape)}, expected {want} (one per {bn}x{bk} block of [{n}, {k}])")


def scale_grid(scale: torch.Tensor, shape: list[int], fmt: FP8Format, module: str, source: str) -> torch.Tensor:
    """A checkpoint's scale tensor for a weight of ``shape`` as the float32 grid of ``fmt.block`` (per-channel
    ``[N]``/``[N, 1]`` and per-tensor scalars become ``[N, 1]``); QuantizationError naming the tensor otherwise."""
    n = shape[0] if shape else 0
    if fmt.granularity == "channel" and scale.numel() == n and scale.dim() <= 2:
        return scale.float().reshape(n, 1)
    if fmt.granularity in ("tensor", "channel") and scale.numel() == 1:
        return scale.float().reshape(1, 1).expand(n, 1).contiguous()
    if fmt.granularity == "block":
        check_scale_shape(shape, scale, fmt.block, module, source, fmt.scale_suffix)
        return scale.float()
    want = f"({n}, 1), one per output channel" if fmt.granularity == "channel" else "one scalar"
    raise QuantizationError(f"{source}: tensor {module}{fmt.scale_suffix} has shape {tuple(scale.shape)}, expected "
                            f"{want} ({fmt.granularity} FP8 of a [{', '.join(map(str, shape))}] weight)")


def paired_scales(files: list[Path], suffix: str = SCALE) -> dict[str, tuple[Path, list[int]]]:
    """Module -> (the file holding its scale ``{module}{suffix}``, its weight's shape), for every module with both
    an e4m3 ``weight`` and a scale (from the safetensors headers; the pair may sit in different files)."""
    fp8_weights: dict[str, list[int]] = {}
    scales: dict[str, Path] = {}
    for f in files:
        with loader.open_safetensors(f) as sf:
            for name in sf.keys():
                if name.endswith(suffix):
                    scales[name[: -len(suffix)]] = f
                elif name.endswith(".weight") and sf.get_slice(name).get_dtype() == "F8_E4M3":
                    fp8_weights[name[: -len(".weight")]] = list(sf.get_slice(name).get_shape())
    return {m: (f, fp8_weights[m]) for m, f in scales.items() if m in fp8_weights}


class FP8Linear(nn.Module):
    """A linear layer whose weight stays block-FP8 (W8A16): e4m3 ``weight [N, K]`` and a float32 ``scale`` per
    ``block``; fused partitions (q/k/v, gate/up) are stacked along N, each starting on a scale-block row. The Triton
    grouped GEMM decodes it on CUDA (or with ``EMBER_MOE=triton``); the torch path dequantizes per call. Buffers,
    not parameters, so ``Module.to(dtype)`` and the dense loader's parameter bookkeeping leave them alone."""

    def __init__(self, out_features: int, in_features: int, block: tuple[int, int], bias: nn.Parameter | None,
                 device: torch.device) -> None:
        super().__init__()
        bn, bk = block
        self.block, self.in_features, self.out_features = block, in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.uint8, device=device)
                             .view(torch.float8_e4m3fn))
        self.register_buffer("scale", torch.zeros(-(-out_features // bn), -(-in_features // bk), device=device,
                                                  dtype=torch.float32))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = fp8_block.FP8BlockTensor(self.weight, self.scale, self.block)
        if use_triton(x.device):
            from ember.kernels import moe

            return moe.block_fp8_linear(x, w, self.bias)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w.dequantize(x.dtype), bias)


def _aligned(full: list[int], local: list[int], block: tuple[int, int]) -> bool:
    """Equal tensor-parallel shares ``local`` of a tensor of shape ``full`` start on ``block`` boundaries in every
    dimension (or one block spans the whole dimension, as a per-channel scale does along K)."""
    return all(n == f or b >= f or n % b == 0 for f, n, b in zip(full, local, block))


def install_linears(model: nn.Module, fmt: FP8Format) -> set[str]:
    """Swap each decoder-layer linear whose checkpoint weights are all block-FP8 for an :class:`FP8Linear` (noted
    in ``model.fp8_linears``, by the names the model's loader reads) and return the checkpoint's module names now
    read packed. A fused layer needs every partition in FP8 and each
    partition but the last a whole number of scale-block rows; under tensor parallelism (``model.shard_shape``)
    this rank's slice of each tensor must start on a block boundary. A checkpoint that stores the fused layer itself
    (Phi-3's ``qkv_proj`` / ``gate_up_proj``) covers every partition with one weight and its own scales, so its
    partitions need no block alignment, except under tensor parallelism, where each rank takes a share of every
    partition. Modules the model reads as plain weights (``model.dense_only``, e.g. MLA's ``kv_b_proj``) and experts
    (placed by the MoE loader) stay out; whatever stays out is dequantized as it loads."""
    from ember.engine.nvfp4_loading import fused_target

    rename = getattr(model, "checkpoint_name", lambda n: n)
    shard_shape = getattr(model, "shard_shape", None)
    dense_only = tuple(getattr(model, "dense_only", ()))
    groups: dict[str, dict[int, tuple[str, str, list[int]]]] = {}
    block = fmt.block
    for hf_module, (_, shape) in model.fp8_candidates.items():  # set by load_model with ``model.fp8``
        name = rename(hf_module + ".weight")
        if name is None or ".layers." not in name or ".mlp.experts." in name or len(shape) != 2:
            continue
        module = name[: -len(".weight")]
        if module.endswith(dense_only):
            continue
        local = shape if shard_shape is None else shard_shape(hf_module + ".weight", shape)
        target, idx = fused_target(module)
        if module.rsplit(".", 1)[-1] in _FUSED_PARTS:
            idx = _WHOLE
        # a slice that cuts a block poisons its whole group (-1)
        groups.setdefault(target, {})[idx if _aligned(shape, local, block) else -1] = (hf_module, module, local)
    named = dict(model.named_modules())
    model.fp8_linears = {}
    packed: set[str] = set()
    for target, parts in groups.items():
        old = named.get(target)
        if -1 in parts or not isinstance(old, nn.Linear):
            continue
        leaf = target.rsplit(".", 1)[-1]
        if leaf == "gate_up_proj":
            sizes = [old.out_features // 2] * 2
        else:
            sizes = model._shard_sizes(leaf) if leaf == "qkv_proj" else [old.out_features]
        if _WHOLE in parts:
            hf, module, local = parts[_WHOLE]
            sliced = shard_shape is not None and local != model.fp8_candidates[hf][1]
            if len(parts) > 1 or local != [old.out_features, old.in_features] \
                    or (sliced and any(n % block[0] for n in sizes)):
                continue
            parent = target.rpartition(".")[0]
            # the whole weight and scales, or (as a model that splits fused tensors yields them) each part's rows
            spans = [(module, 0, old.out_features)] + [
                (f"{parent}.{name}", sum(sizes[:i]), sizes[i]) for i, name in enumerate(_FUSED_PARTS[leaf])]
            hfs = [hf]
        else:
            if sorted(parts) != list(range(len(sizes))) or any(n % block[0] for n in sizes[:-1]):
                continue
            if any(local != [sizes[i], old.in_features] for i, (_, _, local) in parts.items()):
                continue  # shapes the dense loader will name in its error
            spans = [(module, sum(sizes[:i]), sizes[i]) for i, (_, module, _) in parts.items()]
            hfs = [hf for hf, _, _ in parts.values()]
        new = FP8Linear(old.out_features, old.in_features, block, old.bias, old.weight.device)
        parent, _, leaf = target.rpartition(".")
        setattr(named[parent], leaf, new)
        for module, row, size in spans:
            model.fp8_linears[module] = (new, row, size)
        packed.update(hfs)
    return packed


def check_packed(name: str, tensor: torch.Tensor, dest: torch.Tensor, source: str) -> None:
    """QuantizationError naming tensor ``name`` unless it has the shape and dtype of ``dest``, where it goes."""
    if tuple(tensor.shape) != tuple(dest.shape):
        raise QuantizationError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, expected "
                                f"{tuple(dest.shape)}")
    if tensor.dtype != dest.dtype:
        raise QuantizationError(f"{source}: tensor {name} is {tensor.dtype}, expected {dest.dtype}")


def fill_linears(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with the packed FP8 weights and scales of ``model.fp8_linears`` copied into their
    :class:`FP8Linear` rows (and left out); every other tensor passes on. Raises unless every row of each layer's
    weight and scales came exactly once."""
    placed: dict[str, tuple[FP8Linear, int, int]] = getattr(model, "fp8_linears", {})
    seen: set[str] = set()
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if module in placed and leaf in ("weight", SCALE[1:]):
            dest = _rows(*placed[module], leaf)
            check_packed(name, tensor, dest, source)
            dest.copy_(tensor)
            seen.add(name)
            continue
        yield name, tensor
    by_linear: dict[FP8Linear, list[str]] = {}
    for module, (lin, _, _) in placed.items():
        by_linear.setdefault(lin, []).append(module)
    for lin, modules in by_linear.items():
        for leaf, total in (("weight", lin.out_features), (SCALE[1:], lin.scale.shape[0])):
            names = [f"{m}.{leaf}" for m in modules]
            if sum(_rows(*placed[m], leaf).shape[0] for m in modules if f"{m}.{leaf}" in seen) != total:
                missing = next((n for n in names if n not in seen), names[0])
                raise QuantizationError(f"{source}: tensor {missing} was never read")


def _rows(lin: FP8Linear, row: int, size: int, leaf: str) -> torch.Tensor:
    """The rows of ``lin``'s weight (``leaf`` ``weight``) or scales that hold output rows ``row:row + size``."""
    if leaf == "weight":
        return lin.weight[row:row + size]
    bn = lin.block[0]
    return lin.scale[row // bn:row // bn - (-size // bn)]


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], fmt: FP8Format, source: str = "checkpoint",
                keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every e4m3 weight paired with its scale (in either order) and dequantized;
    activation scales are left out. A module for which ``keep(module)`` holds (a model running it in FP8) comes as
    its e4m3 weight followed by ``{module}.weight_scale_inv``, the scale as a grid of ``fmt.block``."""
    if fmt.on_load:
        yield from _quantized_on_load(weights, keep, source)
        return
    suffix = fmt.scale_suffix
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}

    def pair(module: str, weight: torch.Tensor, scale: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        grid = scale_grid(scale, list(weight.shape), fmt, module, source)
        if keep is not None and keep(module):
            yield module + ".weight", weight
            yield module + SCALE, grid
        else:
            yield module + ".weight", fp8_block.dequantize(weight, grid, fmt.block)

    for name, tensor in weights:
        if suffix != SCALE and name.endswith(SCALE):
            raise QuantizationError(f"{source}: tensor {name} is a block scale, but {fmt.source} declares FP8 "
                                    "without weight_block_size [n, k]")
        if name.endswith(suffix):
            module = name[: -len(suffix)]
            w = weights_waiting.pop(module, None)
            if w is None:
                scales_waiting[module] = tensor
            else:
                yield from pair(module, w, tensor)
        elif name.endswith(".weight") and tensor.dtype == torch.float8_e4m3fn:
            module = name[: -len(".weight")]
            s = scales_waiting.pop(module, None)
            if s is None:
                weights_waiting[module] = tensor
            else:
                yield from pair(module, tensor, s)
        elif not name.endswith(_ACTIVATION_SCALES):
            yield name, tensor
    if weights_waiting:
        raise QuantizationError(f"{source}: tensor {next(iter(weights_waiting))}.weight is FP8 but the checkpoint "
                                f"has no {next(iter(weights_waiting))}{suffix}")
    if scales_waiting:
        raise QuantizationError(f"{source}: tensor {next(iter(scales_waiting))}{suffix} has no FP8 weight beside it")


def _quantized_on_load(weights: Iterable[tuple[str, torch.Tensor]], keep: Callable[[str], bool] | None,
                       source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``--quantization fp8``: each projection the model keeps packed comes as its e4m3 weight, quantized per output
    channel (``amax / 448``), followed by its ``[N, 1]`` scale grid; so does each expert's of a layer whose fused
    stacks the model keeps (split per expert once both have come, as `_quantized_experts`); every other tensor passes
    on as it is."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # a kept layer's first fused stack, until its partner comes
    for name, tensor in weights:
        module = name[: -len(".weight")]
        stack = fused_expert_stack(name)
        if stack is not None and keep is not None and tensor.dtype in _FLOATS \
                and keep(stack_expert(stack)):
            pair = waiting.setdefault(stack[0], {})
            pair[stack[1]] = tensor
            if len(pair) == 2:
                del waiting[stack[0]]
                yield from _quantized_experts(stack[0], pair["gate_up_proj"], pair["down_proj"], source)
        elif name.endswith(".weight") and keep is not None and keep(module) and tensor.dtype in _FLOATS:
            q = fp8_block.quantize(tensor, ON_LOAD.block)
            yield name, q.weight
            yield module + SCALE, q.scale
        else:
            yield name, tensor
    for prefix, pair in waiting.items():
        have, = pair
        raise QuantizationError(f"{source}: tensor {prefix}{have} has no "
                                f"{prefix}{'down_proj' if have == 'gate_up_proj' else 'gate_up_proj'} beside it")


def _quantized_experts(prefix: str, gate_up: torch.Tensor, down: torch.Tensor,
                       source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's fused expert stacks (either layout) as every expert's per-channel e4m3 ``{gate,up,down}_proj.weight``
    and scale grid: exactly what the same experts stored one by one quantize to (one expert in float32 at a time);
    QuantizationError naming both stacks when their shapes fit neither layout."""
    dims = fused_expert_dims(list(gate_up.shape), list(down.shape))
    if dims is None:
        raise QuantizationError(f"{source}: tensors {prefix}gate_up_proj {tuple(gate_up.shape)} and {prefix}down_proj "
                                f"{tuple(down.shape)} are neither [E, 2I, H] and [E, H, I] nor [E, H, 2I] and "
                                "[E, I, H]")
    inter, _, transposed = dims
    for e in range(gate_up.shape[0]):
        for name, q in quantized_expert(f"{prefix}{e}.", gate_up[e], down[e], inter, transposed):
            yield name, q.weight
            yield name[: -len(".weight")] + SCALE, q.scale


def quantized_expert(prefix: str, gate_up: torch.Tensor, down: torch.Tensor, inter: int,
                     transposed: bool) -> Iterator[tuple[str, fp8_block.FP8BlockTensor]]:
    """One expert of a fused stack (its ``[2I, H]`` and ``[H, I]`` slices, or ``[H, 2I]`` and ``[I, H]`` when
    ``transposed``) as ``{prefix}{gate,up,down}_proj.weight`` names, each with its per-output-channel e4m3 weight
    and ``[N, 1]`` scales."""
    w13, w2 = (gate_up.T, down.T) if transposed else (gate_up, down)
    q13 = fp8_block.quantize(w13, ON_LOAD.block)  # one scale per row: gate's and up's are their own
    for proj, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, None))):
        yield f"{prefix}{proj}.weight", fp8_block.FP8BlockTensor(q13.weight[rows], q13.scale[rows], ON_LOAD.block)
    yield f"{prefix}down_proj.weight", fp8_block.quantize(w2, ON_LOAD.block)
