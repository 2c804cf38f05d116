"""Block-quantized FP8 checkpoints (config.json ``quantization_config``: ``quant_method: "fp8"`` with
``weight_block_size [bn, bk]``, as DeepSeek-V3 and Qwen's ``-FP8`` releases ship them).

Each quantized projection stores ``{m}.weight`` as e4m3 ``[N, K]`` and ``{m}.weight_scale_inv`` fp32
``[ceil(N/bn), ceil(K/bk)]``, one scale per block (the last row and column of blocks may be partial). Ember
keeps them packed where the model can run them so (``keeps_fp8``): MoE experts stay e4m3 stacks with their block
scales (W8A16 in the fused-MoE kernel) and decoder projections become :class:`FP8Linear` (the same GEMM with one
expert), each where its fused parts and tensor-parallel slices start on block boundaries. Everything else is
dequantized as it loads (``weight * scale`` per block) to the model dtype. Activation scales (``input_scale``) are
dropped: activations stay in the model dtype. Under tensor parallelism each rank dequantizes
only its slice, by the blocks its rows and columns fall in, or keeps it packed with the scale blocks covering it
(`ember.engine.distributed`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from ember.engine.nvfp4_loading import QuantizationError, is_fp8, use_triton
from ember.kernels import fp8_block

SCALE = ".weight_scale_inv"
_ACTIVATIONSCALES = (".input_scale", ".activation_scale")


def block_size(raw_config: dict[str, Any], source: str = "config.json") -> tuple[int, int] | None:
    """``(bn, bk)`` for a block-FP8 checkpoint, None for any other; QuantizationError for FP8 without blocks."""
    if not is_fp8(raw_config):
        return None
    block = raw_config["quantization_config"].get("weight_block_size")
    if not isinstance(block, (list, tuple)) or len(block) != 2 or min(int(b) for b in block) < 1:
        raise QuantizationError(f"{source}: quantization_config fp8 without weight_block_size [n, k]; Ember reads "
                                "block-quantized FP8 only (per-tensor FP8 is not supported)")
    return int(block[0]), int(block[1])


def check_scale_shape(shape: list[int], scale_inv: torch.Tensor, block: tuple[int, int], module: str,
                      source: str) -> None:
    """QuantizationError unless ``scale_inv`` has one entry per ``block`` of a weight of ``shape`` ``[N, K]``."""
    bn, bk = block
    if len(shape) != 2:
        raise QuantizationError(f"{source}: tensor {module}.weight is FP8 with shape {tuple(shape)}; block-FP8 "
                                "weights are [N, K]")
    n, k = shape
    want = (-(-n // bn), -(-k // bk))
    if scale_inv.dim() != 2 or tuple(scale_inv.shape) != want:
        raise QuantizationError(f"{source}: tensor {module}{SCALE} has shape "
                                f"{tuple(scale_inv.shape)}, expected {want} (one per {bn}x{bk} block of [{n}, {k}])")


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], module: str = "",
               source: str = "checkpoint") -> torch.Tensor:
    """fp32 ``weight * scale`` with each ``block`` of ``weight`` scaled by its entry of ``scale_inv`` (``module``
    names the pair in errors)."""
    check_scale_shape(list(weight.shape), scale_inv, block, module, source)
    return fp8_block.dequantize(weight, scale_inv, block)


def paired_scales(files: list[Path]) -> dict[str, tuple[Path, list[int]]]:
    """Module -> (the file holding its ``weight_scale_inv``, its weight's shape), for every module with both an e4m3
    ``weight`` and a scale (from the safetensors headers; the pair may sit in different files)."""
    fp8_weights: dict[str, list[int]] = {}
    scales: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                if name.endswith(SCALE):
                    scales[name[: -len(SCALE)]] = f
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
    """A tensor-parallel slice of ``local`` out of ``full`` starts every rank on a block boundary."""
    return all(n == f or n % b == 0 for f, n, b in zip(full, local, block))


def install_linears(model: nn.Module, source: str, block: tuple[int, int]) -> set[str]:
    """Swap each decoder-layer linear whose checkpoint weights are all block-FP8 for an :class:`FP8Linear` (noted
    in ``model.fp8_linears``, by the names the model's loader reads) and return the checkpoint's module names now
    read packed. A fused layer needs every partition in FP8 and each
    partition but the last a whole number of scale-block rows; under tensor parallelism (``model.shard_shape``)
    this rank's slice of each tensor must start on a block boundary. Modules the model reads as plain weights
    (``model.fp8_dense_only``, e.g. MLA's ``kv_b_proj``) and experts (placed by the MoE loader) stay out; whatever
    stays out is dequantized as it loads."""
    from ember.engine import loader
    from ember.engine.nvfp4_loading import fused_target

    rename = getattr(model, "checkpoint_name", lambda n: n)
    shard_shape = getattr(model, "shard_shape", None)
    dense_only = tuple(getattr(model, "fp8_dense_only", ()))
    groups: dict[str, dict[int, tuple[str, str, list[int]]]] = {}
    for hf_module, (_, shape) in paired_scales(loader.weight_files(source)).items():
        name = rename(hf_module + ".weight")
        if name is None or ".layers." not in name or ".mlp.experts." in name or len(shape) != 2:
            continue
        module = name[: -len(".weight")]
        if module.endswith(dense_only):
            continue
        local = shape if shard_shape is None else shard_shape(hf_module + ".weight", shape)
        target, idx = fused_target(module)
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
        if sorted(parts) != list(range(len(sizes))) or any(n % block[0] for n in sizes[:-1]):
            continue
        if any(local != [sizes[i], old.in_features] for i, (_, _, local) in parts.items()):
            continue  # shapes the dense loader will name in its error
        new = FP8Linear(old.out_features, old.in_features, block, old.bias, old.weight.device)
        parent, _, leaf = target.rpartition(".")
        setattr(named[parent], leaf, new)
        for i, (hf, module, _) in parts.items():
            model.fp8_linears[module] = (new, sum(sizes[:i]), sizes[i])
            packed.add(hf)
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
    :class:`FP8Linear` rows (and left out); every other tensor passes on. Raises if one of them never came."""
    placed: dict[str, tuple[FP8Linear, int, int]] = getattr(model, "fp8_linears", {})
    seen: set[str] = set()
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if module in placed and leaf in ("weight", SCALE[1:]):
            lin, row, size = placed[module]
            bn = lin.block[0]
            if leaf == "weight":
                dest = lin.weight[row:row + size]
            else:
                dest = lin.scale[row // bn:row // bn - (-size // bn)]
            check_packed(name, tensor, dest, source)
            dest.copy_(tensor)
            seen.add(name)
            continue
        yield name, tensor
    for module in placed:
        for leaf in ("weight", SCALE[1:]):
            if f"{module}.{leaf}" not in seen:
                raise QuantizationError(f"{source}: tensor {module}.{leaf} was never read")


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int],
                source: str = "checkpoint", keep: Callable[[str], bool] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every e4m3 weight dequantized by its block scales (each pair is yielded once
    both halves have been read, in either order); activation scales are left out. Modules for which ``keep(module)``
    holds (a model running them in FP8) pass through as they are, weight and scale."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if keep is not None and name.endswith((SCALE, ".weight")) and keep(name.rsplit(".", 1)[0]):
            yield name, tensor
        elif name.endswith(SCALE):
            module = name[: -len(SCALE)]
            w = weights_waiting.pop(module, None)
            if w is None:
                scales_waiting[module] = tensor
            else:
                yield module + ".weight", dequantize(w, tensor, block, module, source)
        elif name.endswith(".weight") and tensor.dtype == torch.float8_e4m3fn:
            module = name[: -len(".weight")]
            s = scales_waiting.pop(module, None)
            if s is None:
                weights_waiting[module] = tensor
            else:
                yield name, dequantize(tensor, s, block, module, source)
        elif not name.endswith(_ACTIVATIONSCALES):
            yield name, tensor
    if weights_waiting:
        raise QuantizationError(f"{source}: tensor {next(iter(weights_waiting))}.weight is FP8 but the checkpoint "
                                f"has no {next(iter(weights_waiting))}{SCALE}")
    if scales_waiting:
        raise QuantizationError(f"{source}: tensor {next(iter(scales_waiting))}{SCALE} has no FP8 weight beside it")
