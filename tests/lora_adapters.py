"""PEFT LoRA adapter folders for the tiny Qwen3 of `tests.conftest.save_tiny_qwen3`, and the reference checkpoint
with an adapter merged into its weights."""
from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
SIZES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64), "gate_proj": (64, 128),
         "up_proj": (64, 128), "down_proj": (128, 64)}  # (in, out) of the tiny Qwen3's projections


def save_adapter(path, seed: int, rank: int, alpha: float, modules: list[str], rslora: bool = False,
                 **config) -> dict[str, torch.Tensor]:
    """A random PEFT adapter folder over both layers of the tiny Qwen3; returns its tensors."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for m in modules:
            part = "self_attn" if m in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            n_in, n_out = SIZES[m]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.2
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules, "bias": "none",
        "use_rslora": rslora, "modules_to_save": None, **config}))
    return tensors


def merged_copy(base, adapter: dict[str, torch.Tensor], scaling: float, out):
    """``base`` with ``W + scaling * B @ A`` written into each adapted projection: the reference checkpoint."""
    shutil.copytree(base, out)
    weights = load_file(str(out / "model.safetensors"))
    for key, a in adapter.items():
        if key.endswith("lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = adapter[key.replace("lora_A", "lora_B")]
            weights[f"{module}.weight"] = weights[f"{module}.weight"] + scaling * (b @ a)
    save_file(weights, str(out / "model.safetensors"))
    return out
