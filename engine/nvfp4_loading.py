"""NVFP4 (ModelOpt) checkpoints: which modules are quantized, checked against the config, and the modules that hold
them at run time.

A module ``m`` is NVFP4 when its tensors say so: ``m.weight`` U8 ``[N, K/2]``, ``m.weight_scale`` F8_E4M3
``[N, K/16]``, ``m.weight_scale_2`` F32 scalar (``m.input_scale`` F32 scalar optional). The decision is taken per
module from the safetensors headers (before any tensor is read), then cross-checked against ``hf_quant_config.json``
and/or ``config.json:quantization_config`` (``quant_algo: NVFP4``, ``group_size: 16``, excluded modules). Any
disagreement raises :class:`QuantizationError` naming the file and the tensor.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from ember.engine.attention import check_triton_device
from ember.engine import loader
from ember.engine.config import ConfigError
from ember.kernels import moe_reference
from ember.kernels.nvfp4 import BLOCK, NVFP4Tensor

QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")


class QuantizationError(ConfigError):
    """An NVFP4 checkpoint's tensors and its quantization config disagree, or a tensor is malformed."""


@dataclass
class QuantConfig:
    """The checkpoint's declared quantization (either config form)."""

    quant_algo: str
    group_size: int
    exclude: list[str]
    source: str  # the file it came from

    def is_excluded(self, module: str) -> bool:
        """Exact names, dotted prefixes and ``*`` wildcard patterns, as vLLM matches ModelOpt's lists."""
        for pat in self.exclude:
            if module == pat or module.startswith(pat + "."):
                return True
            if "*" in pat and re.fullmatch(re.escape(pat).replace(r"\*", ".*"), module):
                return True
        return False


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise QuantizationError(f"{path}: invalid JSON ({e})") from None


SUPPORTED_QUANTIZATIONS = (
    "ModelOpt NVFP4 and FP8 (quant_algo NVFP4 / FP8), quant_method fp8 (block or per-tensor scales), "
    "compressed-tensors FP8 (float-quantized, 8-bit float weights with tensor, channel or block strategy) "
    "and mxfp4 (gpt-oss)")
"""The checkpoint quantizations Ember reads, for the message refusing another."""


def _compressed_tensors_scheme(q: dict[str, Any]) -> str:
    """A compressed-tensors config's scheme in words: its format, and each config group's weights and input
    activations as type, bits and strategy."""
    groups = []
    for grp in (q.get("config_groups") or {}).values():
        if not isinstance(grp, dict):
            continue
        specs = [(role, grp.get(role)) for role in ("weights", "input_activations")]
        groups.append(", ".join(f"{role} {spec.get('type')} {spec.get('num_bits')}-bit {spec.get('strategy')}"
                                for role, spec in specs if isinstance(spec, dict)))
    return "; ".join([f"format {q.get('format')!r}", *dict.fromkeys(g for g in groups if g)])


def _parse_quant_dict(q: dict[str, Any], source: str) -> QuantConfig:
    algo = q.get("quant_algo")
    method = q.get("quant_method")
    if algo is None and method == "compressed-tensors":
        raise QuantizationError(f"{source}: compressed-tensors scheme ({_compressed_tensors_scheme(q)}) is not "
                                f"supported; Ember reads {SUPPORTED_QUANTIZATIONS}")
    if algo is None and method not in (None, "modelopt"):
        raise QuantizationError(f"{source}: quant_method {method!r} is not supported; Ember reads "
                                f"{SUPPORTED_QUANTIZATIONS}")
    group = q.get("group_size")
    if group is None:
        for grp in (q.get("config_groups") or {}).values():
            group = (grp.get("weights") or {}).get("group_size", group)
    exclude = q.get("exclude_modules", q.get("ignore")) or []
    if algo != "NVFP4":
        raise QuantizationError(f"{source}: quant_algo {algo!r} is not supported (only NVFP4)")
    if int(group if group is not None else BLOCK) != BLOCK:
        raise QuantizationError(f"{source}: NVFP4 group_size must be {BLOCK}, got {group}")
    return QuantConfig(algo, BLOCK, list(exclude), source)


def is_fp8(raw_config: dict[str, Any], model_dir: str | os.PathLike | None = None) -> bool:
    """The checkpoint's weights are FP8 (`ember.engine.fp8_loading.fp8_format`), not NVFP4."""
    from ember.engine import fp8_loading

    return fp8_loading.fp8_format(raw_config, model_dir) is not None


def read_quant_config(model_dir: str | os.PathLike | None, raw_config: dict[str, Any]) -> QuantConfig | None:
    """The quantization declared by ``hf_quant_config.json`` (legacy) and/or ``config.json:quantization_config``;
    both must agree where both exist. None when the checkpoint declares none."""
    found: list[QuantConfig] = []
    if model_dir is not None:
        legacy = Path(model_dir) / "hf_quant_config.json"
        if legacy.exists():
            data = _read_json(legacy)
            if not isinstance(data.get("quantization"), dict):
                raise QuantizationError(f"{legacy}: no 'quantization' object")
            found.append(_parse_quant_dict(data["quantization"], str(legacy)))
    from ember.engine.fp8_loading import weightless

    qc = raw_config.get("quantization_config")
    if isinstance(qc, dict) and not is_fp8(raw_config) and not weightless(qc):
        src = str(Path(model_dir) / "config.json") if model_dir is not None else "config.json"
        found.append(_parse_quant_dict(qc, src + ":quantization_config"))
    if not found:
        return None
    if len(found) == 2 and set(found[0].exclude) != set(found[1].exclude):
        raise QuantizationError(f"{found[0].source} and {found[1].source} exclude different modules: "
                                f"{sorted(found[0].exclude)} vs {sorted(found[1].exclude)}")
    return found[0]


@dataclass
class ModuleSpec:
    """One NVFP4 module as its headers describe it."""

    name: str
    out_features: int
    in_features: int
    has_input_scale: bool
    file: str


@dataclass
class NVFP4Plan:
    """Every NVFP4 module of a checkpoint, validated; ``files`` maps each tensor name to its file."""

    modules: dict[str, ModuleSpec]
    config: QuantConfig
    files: dict[str, str] = field(repr=False, default_factory=dict)

    def renamed(self, rename: Callable[[str], str | None]) -> "NVFP4Plan":
        """The plan under the names a model's loader gives the checkpoint's tensors (``rename(tensor name)``, None
        for a tensor it skips, such as a multi-token-prediction layer's)."""
        modules: dict[str, ModuleSpec] = {}
        for m, spec in self.modules.items():
            new = rename(m + ".weight")
            if new is not None:
                module = new[: -len(".weight")]
                modules[module] = dataclasses.replace(spec, name=module)
        files = {new: f for name, f in self.files.items() if (new := rename(name)) is not None}
        return NVFP4Plan(modules, self.config, files)


def _headers(model_dir: Path) -> dict[str, tuple[str, list[int], str]]:
    out: dict[str, tuple[str, list[int], str]] = {}
    for f in loader.weight_files(model_dir):
        with loader.open_safetensors(f) as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                out[name] = (sl.get_dtype(), list(sl.get_shape()), str(f))
    return out


ShardShape = Callable[[str, list[int]], list[int]]
"""(tensor name, shape in the file) -> the shape of the slice this tensor-parallel rank loads."""


def plan(model_dir: str | os.PathLike, raw_config: dict[str, Any], shard_shape: ShardShape | None = None
         ) -> NVFP4Plan | None:
    """Decide NVFP4 per module from the safetensors headers and cross-check with the config; under tensor
    parallelism (``shard_shape``) the shapes checked and recorded are this rank's slices.

    Returns None for a checkpoint with neither NVFP4 tensors nor a quantization config, and for a block-FP8 one
    (`ember.engine.fp8_loading` dequantizes it as it loads).
    """
    if is_fp8(raw_config, model_dir):
        return None
    root = Path(model_dir)
    heads = _headers(root)
    if shard_shape is not None:
        heads = {name: (dt, shard_shape(name, shape), f) for name, (dt, shape, f) in heads.items()}
    qcfg = read_quant_config(root, raw_config)
    modules: dict[str, ModuleSpec] = {}
    candidates = {n.rsplit(".", 1)[0] for n in heads if n.rsplit(".", 1)[-1] in QUANT_SUFFIXES}
    candidates |= {n[: -len(".weight")] for n, (dt, _, _) in heads.items()
                   if n.endswith(".weight") and dt in ("U8", "F8_E4M3")}
    for m in sorted(candidates):
        def get(suffix: str, m: str = m) -> tuple[str, list[int], str] | None:
            return heads.get(f"{m}.{suffix}")

        w, s, s2, a = get("weight"), get("weight_scale"), get("weight_scale_2"), get("input_scale")
        if qcfg is None and w is not None and w[0] == "F8_E4M3":
            raise QuantizationError(f"{w[2]}: tensor {m}.weight is FP8 (F8_E4M3) but the checkpoint declares no "
                                    "quantization (config.json has no quantization_config naming its format)")
        for suffix, item in (("weight", w), ("weight_scale", s), ("weight_scale_2", s2)):
            if item is None:
                anyfile = next(x for x in (w, s, s2, a) if x is not None)[2]
                raise QuantizationError(f"{anyfile}: NVFP4 module {m!r} has no tensor {m}.{suffix}")
        if w[0] != "U8" or len(w[1]) != 2:
            raise QuantizationError(f"{w[2]}: tensor {m}.weight is {w[0]} {w[1]}, expected U8 [N, K/2] for NVFP4")
        n, k = w[1][0], w[1][1] * 2
        if s[0] != "F8_E4M3" or s[1] != [n, k // BLOCK]:
            raise QuantizationError(f"{s[2]}: tensor {m}.weight_scale is {s[0]} {s[1]}, expected F8_E4M3 "
                                    f"{[n, k // BLOCK]} (one per {BLOCK} of {m}.weight's {k} inputs)")
        for suffix, item in (("weight_scale_2", s2), ("input_scale", a)):
            if item is not None and (item[0] != "F32" or item[1] not in ([], [1])):
                raise QuantizationError(f"{item[2]}: tensor {m}.{suffix} is {item[0]} {item[1]}, "
                                        "expected an F32 scalar")
        if qcfg is None:
            raise QuantizationError(f"{w[2]}: tensor {m}.weight_scale is NVFP4 but the checkpoint has no "
                                    "hf_quant_config.json and no config.json quantization_config")
        if qcfg.is_excluded(m):
            raise QuantizationError(f"{w[2]}: tensor {m}.weight is NVFP4 but {qcfg.source} excludes {m!r}")
        modules[m] = ModuleSpec(m, n, k, a is not None, w[2])
    if qcfg is None:
        return None
    if not modules:
        raise QuantizationError(f"{qcfg.source}: declares NVFP4 but no tensor in {root} is NVFP4 "
                                "(no U8 weight with weight_scale / weight_scale_2)")
    return NVFP4Plan(modules, qcfg, {name: h[2] for name, h in heads.items()})


def plan_for_source(source: str, raw_config: dict[str, Any], shard_shape: ShardShape | None = None
                    ) -> NVFP4Plan | None:
    """:func:`plan` when ``source`` (what the engine passes to ``load_weights``) is the checkpoint directory."""
    return plan(source, raw_config, shard_shape) if os.path.isdir(source) else None


# ---------------------------------------------------------------------------------------------------------------
# Run-time modules


def use_triton(device: torch.device) -> bool:
    """Triton MoE / NVFP4 kernels on CUDA, or anywhere with ``EMBER_MOE=triton``; the torch references otherwise."""
    forced = os.environ.get("EMBER_MOE", "").strip().lower()
    if forced == "triton":
        check_triton_device(device, "--moe-backend (EMBER_MOE)")
    if forced in ("triton", "reference", "torch"):
        return forced == "triton"
    if forced:
        raise ValueError(f"EMBER_MOE={forced!r}: expected 'triton' or 'reference'")
    return device.type == "cuda"


class NVFP4Linear(nn.Module):
    """A linear layer whose weight stays NVFP4 (W4A16): one or more fused partitions (q/k/v, gate/up) stacked along
    the output dimension, each with its own ``weight_scale_2``. Buffers, not parameters, so ``Module.to(dtype)``
    and the dense loader's parameter bookkeeping leave them alone."""

    def __init__(self, part_sizes: list[int], in_features: int, bias: nn.Parameter | None,
                 device: torch.device) -> None:
        super().__init__()
        n = sum(part_sizes)
        self.part_sizes = list(part_sizes)
        self.in_features = in_features
        self.register_buffer("weight", torch.zeros(n, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(n, in_features // BLOCK, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale_2", torch.zeros(len(part_sizes), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.zeros(len(part_sizes), dtype=torch.float32, device=device))
        self.bias = bias
        self._parts: list[NVFP4Tensor] | None = None

    def partitions(self) -> list[NVFP4Tensor]:
        """The weight as NVFP4 tensors: one when every partition shares ``weight_scale_2`` (ModelOpt's fused
        layers do), else one per partition. Decided on the first forward (a host sync), then cached, so later
        forwards can be captured in CUDA graphs."""
        if self._parts is None:
            self._parts = self._split()
        return self._parts

    def _split(self) -> list[NVFP4Tensor]:
        s8 = self.weight_scale.view(torch.float8_e4m3fn)
        if bool((self.weight_scale_2 == self.weight_scale_2[0]).all()):
            return [NVFP4Tensor(self.weight, s8, self.weight_scale_2[0])]
        out, start = [], 0
        for i, size in enumerate(self.part_sizes):
            out.append(NVFP4Tensor(self.weight[start:start + size], s8[start:start + size], self.weight_scale_2[i]))
            start += size
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x.device):
            from ember.kernels import moe

            parts = self.partitions()
            if len(parts) == 1:  # one launch, the bias added in its epilogue
                return moe.nvfp4_linear(x, parts[0], self.bias)
            ys = [moe.nvfp4_linear(x, p) for p in parts]
        else:
            ys = [moe_reference.nvfp4_linear(x, p) for p in self.partitions()]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)


# HF projection -> (Ember's fused module, partition index)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def fused_target(hf_module: str) -> tuple[str, int]:
    """The Ember module a checkpoint projection lands in, and its partition: ``q_proj`` -> (``qkv_proj``, 0)..."""
    parent, _, leaf = hf_module.rpartition(".")
    if parent and leaf in _FUSED:
        fused, idx = _FUSED[leaf]
        return f"{parent}.{fused}", idx
    return hf_module, 0


def _install_linears(model: nn.Module, p: NVFP4Plan,
                     skip: tuple[str, ...]) -> dict[str, tuple[NVFP4Linear, int, int]]:
    """Swap each planned ``nn.Linear`` for an :class:`NVFP4Linear`; returns HF module -> (module, first row,
    partition)."""
    groups: dict[str, dict[int, ModuleSpec]] = {}
    for name, spec in p.modules.items():
        if any(s in name for s in skip):
            continue
        target, idx = fused_target(name)
        groups.setdefault(target, {})[idx] = spec
    placed: dict[str, tuple[NVFP4Linear, int, int]] = {}
    named = dict(model.named_modules())
    for target, parts in groups.items():
        old = named.get(target)
        if ".layers." not in target:
            spec = next(iter(parts.values()))
            raise QuantizationError(f"{spec.file}: tensor {spec.name}.weight is NVFP4; Ember runs only the decoder "
                                    "layers' projections in NVFP4 (keep embeddings and lm_head unquantized)")
        if not isinstance(old, nn.Linear):
            spec = next(iter(parts.values()))
            raise QuantizationError(f"{spec.file}: tensor {spec.name}.weight is NVFP4 but {target!r} is not a "
                                    f"linear layer of {type(model).__name__}")
        if target.endswith(tuple(getattr(model, "dense_only", ()))):
            spec = next(iter(parts.values()))
            raise QuantizationError(f"{spec.file}: tensor {spec.name}.weight is NVFP4; {type(model).__name__} reads "
                                    "that projection's weights directly, so it must stay unquantized (exclude it "
                                    "from quantization)")
        leaf = target.rsplit(".", 1)[-1]
        if target in p.modules:  # the checkpoint's own module, fused there too (Phi-3's qkv_proj): one partition
            sizes = [old.out_features]
        elif leaf == "gate_up_proj":  # halves of the module itself: shared experts have their own width
            sizes = [old.out_features // 2] * 2
        else:
            sizes = model._shard_sizes(leaf) if leaf == "qkv_proj" else [old.out_features]
        if len(parts) != len(sizes):
            spec = next(iter(parts.values()))
            raise QuantizationError(f"{spec.file}: {target} fuses {len(sizes)} projections but only "
                                    f"{sorted(s.name for s in parts.values())} are NVFP4; quantize all or none")
        for idx, spec in parts.items():
            if spec.out_features != sizes[idx] or spec.in_features != old.in_features:
                raise QuantizationError(f"{spec.file}: tensor {spec.name}.weight is [{spec.out_features}, "
                                        f"{spec.in_features}] (unpacked), expected [{sizes[idx]}, {old.in_features}]")
        new = NVFP4Linear(sizes, old.in_features, old.bias, old.weight.device)
        parent_name, leaf = target.rsplit(".", 1)
        setattr(named[parent_name], leaf, new)
        for idx, spec in parts.items():
            placed[spec.name] = (new, sum(sizes[:idx]), idx)
    return placed


class PreparedWeights:
    """A weight stream that :func:`prepare` has already handled (it passes such a stream through unchanged)."""

    def __init__(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._it = iter(stream)

    def __iter__(self) -> "PreparedWeights":
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._it)


def prepare(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], source: str,
            skip: tuple[str, ...] = (".mlp.experts.",)) -> PreparedWeights:
    """Hook for a model's ``load_weights``, to call before it reads its parameters: when ``source`` is an NVFP4
    checkpoint directory, swap the planned linear layers for :class:`NVFP4Linear` now (and set
    ``model.nvfp4_plan``), and return a stream that fills them from their quantized tensors and yields every other
    tensor (including modules whose names contain one of ``skip``, which the model places itself). An unquantized
    checkpoint's ``weights`` come back unchanged, and so does a stream this function already returned. A
    tensor-parallel rank's model carries ``shard_shape`` (set by the engine's ``load_model``), so the plan checks
    the slices that rank reads."""
    if isinstance(weights, PreparedWeights):
        return weights
    cfg = getattr(model, "config", None)
    p = plan_for_source(source, getattr(cfg, "raw", {}) or {}, getattr(model, "shard_shape", None))
    if p is not None and hasattr(model, "checkpoint_name"):
        p = p.renamed(model.checkpoint_name)
    model.nvfp4_plan = p
    if p is None:
        return PreparedWeights(weights)
    return PreparedWeights(_fill(p, _install_linears(model, p, skip), weights, source))


def _fill(p: NVFP4Plan, placed: dict[str, tuple[NVFP4Linear, int, int]],
          weights: Iterable[tuple[str, torch.Tensor]], source: str) -> Iterator[tuple[str, torch.Tensor]]:
    filled: set[str] = set()
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if module in placed and suffix in ("weight", *QUANT_SUFFIXES):
            lin, row, idx = placed[module]
            lin._parts = None
            if suffix == "weight":
                lin.weight[row:row + tensor.shape[0]].copy_(tensor)
            elif suffix == "weight_scale":
                lin.weight_scale[row:row + tensor.shape[0]].copy_(tensor.view(torch.uint8))
            elif suffix == "weight_scale_2":
                lin.weight_scale_2[idx] = tensor.float().reshape(())
            else:
                lin.input_scale[idx] = tensor.float().reshape(())
            filled.add(name)
            continue
        yield name, tensor
    for module in placed:
        for suffix in ("weight", "weight_scale", "weight_scale_2"):
            if f"{module}.{suffix}" not in filled:
                raise QuantizationError(f"{p.files.get(module + '.weight', source)}: tensor {module}.{suffix} "
                                        "was never read")
