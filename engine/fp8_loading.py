"""Block-quantized FP8 checkpoints (config.json ``quantization_config``: ``quant_method: "fp8"`` with
``weight_block_size [bn, bk]``, as DeepSeek-V3 and Qwen's ``-FP8`` releases ship them).

Each quantized projection stores ``{m}.weight`` as e4m3 ``[N, K]`` and ``{m}.weight_scale_inv`` fp32
``[ceil(N/bn), ceil(K/bk)]``, one scale per block (the last row and column of blocks may be partial). Ember
dequantizes them as they load (``weight * scale`` per block) and runs the model in its dtype, except where a
model keeps them packed: MoE experts stay e4m3 with their block scales and run W8A16 in the fused-MoE kernel
(``Qwen3MoeForCausalLM.keeps_fp8``), which holds most of a large MoE's weights at FP8's memory. Activation scales
(``input_scale``) are dropped: activations stay in the model dtype. Under tensor parallelism each rank dequantizes
only its slice, by the blocks its rows and columns fall in, or keeps it packed with the scale blocks covering it
(`ember.engine.distributed`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from ember.engine.nvfp4_loading import QuantizationError, is_fp8
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


def paired_scales(files: list[Path]) -> dict[str, Path]:
    """Module -> the file holding its ``weight_scale_inv``, for every module with both an e4m3 ``weight`` and a
    scale (from the safetensors headers; the pair may sit in different files)."""
    fp8_weights: set[str] = set()
    scales: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                if name.endswith(SCALE):
                    scales[name[: -len(SCALE)]] = f
                elif name.endswith(".weight") and sf.get_slice(name).get_dtype() == "F8_E4M3":
                    fp8_weights.add(name[: -len(".weight")])
    return {m: f for m, f in scales.items() if m in fp8_weights}


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
