"""``ember quantize-nvfp4 SRC DST``: write a ModelOpt-format NVFP4 checkpoint from a bf16/fp16/fp32 one.

What is quantized: every linear projection inside the decoder layers (``q/k/v/o_proj``, ``gate/up/down_proj``
of dense MLPs and of each MoE expert, Phi-3's fused ``qkv_proj`` and ``gate_up_proj``; transformers 5's fused expert
keys, in either layout, are split back into per-expert ModelOpt names). Kept as they are: embeddings, ``lm_head``,
norms, the MoE router ``mlp.gate``, and any projection whose input size is not a multiple of 16; all of those are
listed in ``exclude_modules``.

Output: ``model.safetensors`` with ``{m}.weight`` U8 ``[N, K/2]``, ``{m}.weight_scale`` F8_E4M3 ``[N, K/16]``,
``{m}.weight_scale_2`` F32 scalar per module; ``config.json`` with ``quantization_config`` and the legacy
``hf_quant_config.json``; every other file of SRC (tokenizer, generation config) copied. Written into a temporary
sibling of DST that becomes DST only once complete. Refused (ValueError): an already quantized SRC, an architecture
Ember does not serve or the quantizer does not handle (gpt-oss, encoders), and a checkpoint with no projection to
quantize.

How this differs from ModelOpt's calibrated output:
- no activation calibration: no ``input_scale`` tensors are written (ModelOpt writes ``amax(|x|)/(6*448)`` from
  calibration data). Ember's W4A16 path needs none; its W4A4 path then uses a dynamic per-tensor activation scale.
  Engines that require static input scales (vLLM's W4A4) cannot load such a checkpoint;
- the weight scales are the uncalibrated ModelOpt formulas (``weight_scale_2 = amax/(6*448)``, block scales
  ``amax_block/(6*weight_scale_2)`` in E4M3), shared across q/k/v and across each gate/up pair as ModelOpt's
  layer fusion does, but without its optional AWQ/SmoothQuant pre-scaling;
- a block whose E4M3 scale underflows to 0 gets zero codes (ModelOpt divides by zero there).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ember.engine import fp8_loading, loader
from ember.engine.checkpoint_writer import holds_checkpoint, save_safetensors, staged
from ember.engine.config import ENCODER_ARCHITECTURES
from ember.kernels import nvfp4

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                "gate_up_proj")
# Modules sharing one input (and so one weight_scale_2 in ModelOpt's fused export)
_SHARED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")
_UNHANDLED = {"GptOssForCausalLM": "its fused interleaved experts are not split by the quantizer; Ember serves "
                                   "gpt-oss as bf16 or MXFP4"}


def _is_stack(name: str) -> bool:
    """A fused expert stack under ``mlp.experts`` (Llama 4's ``feed_forward.experts``; see
    `fp8_loading.fused_expert_stack`)."""
    return (".mlp.experts." in name or ".feed_forward.experts." in name) \
        and fp8_loading.fused_expert_stack(name) is not None


def _fused_stacks(files: list[Path]) -> dict[str, list[int]]:
    """Name -> shape of every fused expert stack in ``files`` (from their headers: a layer's two stacks may sit in
    different shards); ValueError naming a file that is not readable safetensors."""
    shapes: dict[str, list[int]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                shapes |= {n: list(sf.get_slice(n).get_shape()) for n in sf.keys() if _is_stack(n)}
        except SafetensorError as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
    return shapes


def _expand_fused_experts(tensors: dict[str, torch.Tensor],
                          stacks: dict[str, list[int]] | None = None) -> dict[str, torch.Tensor]:
    """transformers 5 fused experts (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``, or both
    transposed as Qwen3-VL-MoE releases them) -> per-expert ``experts.{e}.{gate,up,down}_proj.weight``; ``stacks``
    (`_fused_stacks`; default: those of ``tensors``) orient each layer's pair. ValueError naming a pair of neither
    layout."""
    if stacks is None:
        stacks = {n: list(t.shape) for n, t in tensors.items() if _is_stack(n)}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name not in stacks or t.dim() != 3:
            out[name] = t
            continue
        prefix, leaf = fp8_loading.fused_expert_stack(name)
        gate_up, down = stacks.get(prefix + "gate_up_proj", []), stacks.get(prefix + "down_proj", [])
        dims = fp8_loading.fused_expert_dims(gate_up, down)
        if dims is None:
            raise ValueError(f"fused experts {prefix}gate_up_proj {gate_up} and {prefix}down_proj {down} are neither "
                             "[E, 2I, H] and [E, H, I] nor [E, H, 2I] and [E, I, H]")
        inter, _, transposed = dims
        for e in range(t.shape[0]):
            w = t[e].T if transposed else t[e]
            if leaf == "gate_up_proj":
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = w[:inter], w[inter:]
            else:
                out[f"{prefix}{e}.down_proj.weight"] = w
    return out


def _quantizable(name: str, t: torch.Tensor) -> bool:
    parts = name.split(".")
    return (len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in _PROJECTIONS and ".layers." in name
            and t.dim() == 2 and t.is_floating_point())


def _classify(tensors: dict[str, torch.Tensor], narrow: dict[str, int] | None = None
              ) -> tuple[dict[str, float], set[str]]:
    """(amax of each projection to quantize, modules kept as they are) of one set of (expanded) tensors; projections
    kept for an input size not a multiple of 16 are also added to ``narrow`` (module -> input size)."""
    amax: dict[str, float] = {}
    exclude: set[str] = set()
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if _quantizable(name, t) and t.shape[1] % nvfp4.BLOCK == 0:
            amax[module] = float(t.float().abs().amax())
        elif _quantizable(name, t):
            exclude.add(module)
            if narrow is not None:
                narrow[module] = t.shape[1]
        elif t.dim() == 2 and name.endswith(".weight") and "norm" not in module.rsplit(".", 1)[-1]:
            exclude.add(module)  # lm_head, embed_tokens, routers: kept in their dtype
    return amax, exclude


def _group_scales(amax: dict[str, float]) -> dict[str, torch.Tensor]:
    """One ``weight_scale_2`` per fused group (q/k/v of an attention block, gate/up of an MLP or expert), as
    ModelOpt's export shares them; a projection whose partners stay unquantized keeps its own."""
    groups: dict[str, list[str]] = {}
    for m in amax:
        parent, leaf = m.rsplit(".", 1)
        complete = leaf in _SHARED and all(f"{parent}.{p}" in amax for p, g in _SHARED.items() if g == _SHARED[leaf])
        groups.setdefault(f"{parent}.{_SHARED[leaf]}" if complete else m, []).append(m)
    scales: dict[str, torch.Tensor] = {}
    for members in groups.values():
        s2 = nvfp4.tensor_scale(max(amax[m] for m in members))
        scales.update({m: s2 for m in members})
    return scales


def _apply(tensors: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module in scales:
            q = nvfp4.quantize(t, scales[module])
            out[name] = q.weight
            out[module + ".weight_scale"] = q.weight_scale
            out[module + ".weight_scale_2"] = q.weight_scale_2.reshape(())
        else:
            out[name] = t
    return out


def quantize_state_dict(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """NVFP4 tensors for every quantizable projection, the rest unchanged; and the excluded module names."""
    tensors = _expand_fused_experts(tensors)
    amax, exclude = _classify(tensors)
    return _apply(tensors, _group_scales(amax)), sorted(exclude)


def quant_configs(exclude: list[str]) -> tuple[dict, dict]:
    """(``hf_quant_config.json``, ``config.json:quantization_config``) in ModelOpt's two forms."""
    producer = {"name": "ember", "version": "0.1.0"}
    legacy = {"producer": producer,
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": nvfp4.BLOCK,
                               "exclude_modules": exclude}}
    scheme = {"num_bits": 4, "type": "float", "group_size": nvfp4.BLOCK, "dynamic": False}
    compressed = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": exclude, "producer": producer,
                  "config_groups": {"group_0": {"weights": dict(scheme), "input_activations": dict(scheme),
                                                "targets": ["Linear"]}}}
    return legacy, compressed


def _read(f: Path, stacks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Every tensor of weight file ``f``, fused experts split (as ``stacks`` orient them); ValueError naming ``f``
    when it is not readable safetensors (truncated, or another format) or its fused experts fit no layout."""
    try:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            tensors = {name: sf.get_tensor(name) for name in sf.keys()}
    except SafetensorError as e:
        raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
    try:
        return _expand_fused_experts(tensors, stacks)
    except ValueError as e:
        raise ValueError(f"{f}: {e}") from None


def _check_architecture(config: dict, source: Path) -> None:
    """ValueError naming ``source`` unless its architecture is a decoder Ember serves and the quantizer handles."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{source}: no 'architectures' list naming the model class, got {archs!r}")
    from ember.engine.models import get_model_class

    arch = archs[0]
    get_model_class(arch, str(source))
    if arch in ENCODER_ARCHITECTURES:
        raise ValueError(f"{source}: architecture {arch!r} is an encoder; quantize-nvfp4 quantizes decoders only")
    if arch in _UNHANDLED:
        raise ValueError(f"{source}: architecture {arch!r} is not supported by quantize-nvfp4 ({_UNHANDLED[arch]})")


def _check_unquantized(f: Path, tensors: dict[str, torch.Tensor]) -> None:
    """ValueError naming ``f`` when a weight tensor (``weight``, ``weight_scale``, ``weight_packed``...) is packed
    or 8-bit: the checkpoint is already quantized."""
    for name, t in tensors.items():
        if name.rsplit(".", 1)[-1].startswith("weight") and (not t.is_floating_point() or t.element_size() < 2):
            raise ValueError(f"{f}: the checkpoint is already quantized (tensor {name} is {t.dtype})")


def quantize_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Write the NVFP4 version of checkpoint ``src`` into ``dst`` (must not hold a checkpoint; nothing written there
    unless the whole checkpoint is).

    Two passes over the weight files, one file in memory at a time: the first finds every projection's amax (fused
    partners may live in different shards), the second quantizes and writes one output shard per input shard.
    """
    src, dst = loader.checkpoint_dir(src), Path(dst)
    config = loader.read_json(src / "config.json")
    if config.get("quantization_config"):
        raise ValueError(f"{src / 'config.json'}: the checkpoint is already quantized")
    if (src / "hf_quant_config.json").exists():
        raise ValueError(f"{src / 'hf_quant_config.json'}: the checkpoint is already quantized")
    _check_architecture(config, src / "config.json")
    if holds_checkpoint(dst):
        raise ValueError(f"{dst}: already holds a checkpoint")
    files = loader.weight_files(src)
    stacks = _fused_stacks(files)
    amax: dict[str, float] = {}
    exclude: set[str] = set()
    narrow: dict[str, int] = {}
    for f in files:
        tensors = _read(f, stacks)
        _check_unquantized(f, tensors)
        a, e = _classify(tensors, narrow)
        amax.update(a)
        exclude |= e
    if not amax:
        why = (f"the input size of every projection ({', '.join(map(str, sorted(set(narrow.values()))))}) is not a "
               f"multiple of {nvfp4.BLOCK}" if narrow else
               f"no decoder projection ({', '.join(_PROJECTIONS)} under .layers.) was found")
        raise ValueError(f"{src}: nothing to quantize: {why}")
    scales = _group_scales(amax)
    with staged(dst) as tmp:
        weight_map: dict[str, str] = {}
        total = 0
        for f in files:
            out = _apply(_read(f, stacks), scales)
            name = "model.safetensors" if len(files) == 1 else f.name
            save_safetensors({k: v.contiguous() for k, v in out.items()}, tmp / name, dst / name)
            weight_map.update({k: name for k in out})
            total += sum(v.numel() * v.element_size() for v in out.values())
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith(_WEIGHT_FILES) and f.name not in (
                    "config.json", "model.safetensors.index.json", "hf_quant_config.json"):
                shutil.copy2(f, tmp / f.name)
        legacy, compressed = quant_configs(sorted(exclude))
        config["quantization_config"] = compressed
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / "hf_quant_config.json").write_text(json.dumps(legacy, indent=2) + "\n", encoding="utf-8")
    return dst


def main(argv: list[str] | None = None) -> int:
    """CLI entry: ``ember quantize-nvfp4 SRC DST``."""
    ap = argparse.ArgumentParser(prog="ember quantize-nvfp4",
                                 description="Write a ModelOpt-format NVFP4 checkpoint (weights only, no "
                                             "activation calibration) from a bf16/fp16/fp32 checkpoint.")
    ap.add_argument("src", help="source checkpoint directory (safetensors)")
    ap.add_argument("dst", help="output directory")
    args = ap.parse_args(argv)
    try:
        out = quantize_checkpoint(args.src, args.dst)
    except (ValueError, OSError) as e:
        print(f"ember quantize-nvfp4: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote NVFP4 checkpoint to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
