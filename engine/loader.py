"""Reading a local Hugging Face checkpoint directory: config, safetensors weights (single or sharded), tokenizer,
generation config. Every failure names the file (and tensor) that is missing or wrong."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open

from ember.engine.checkpoint import CheckpointError, checkpoint_dir, load_tokenizer  # noqa: F401 (re-exported)
from ember.engine.checkpoint import read_config, read_json
from ember.engine.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)


def load_model_config(model_dir: str | os.PathLike, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The model's `ModelConfig`: config.json with ``overrides`` (``--hf-overrides``) applied."""
    path = checkpoint_dir(model_dir) / "config.json"
    source = f"{path} with --hf-overrides" if overrides else str(path)
    try:
        return ModelConfig.from_dict(read_config(model_dir, overrides), source=source)
    except (ConfigError, CheckpointError):
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {e}") from None


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files that make up the checkpoint, sharded index first if present."""
    root = checkpoint_dir(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map'")
        files = [root / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{f}: shard named in {index.name} not found")
        return files
    single = root / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(root.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(f"{root}: no model.safetensors, model.safetensors.index.json or *.safetensors file")


READ_ERRORS = (OSError, RuntimeError, SafetensorError)
"""What opening or reading a safetensors file raises when the file is unreadable or not safetensors."""

_LFS_POINTER = b"version https://git-lfs"


def unreadable(path: Path, error: Exception) -> CheckpointError:
    """The CheckpointError for weight file ``path`` that safetensors could not read; a git-lfs pointer (a clone made
    without git-lfs) is named as such."""
    try:
        with open(path, "rb") as f:
            lfs = f.read(len(_LFS_POINTER)) == _LFS_POINTER
    except OSError:
        lfs = False
    if lfs:
        return CheckpointError(f"{path}: a git-lfs pointer, not the weights (the repository was cloned without "
                               f"git-lfs; run `git lfs pull` in {path.parent})")
    return CheckpointError(f"{path}: cannot read safetensors ({error})")


def open_safetensors(path: Path) -> Any:
    """safetensors' ``safe_open`` of weight file ``path`` on the CPU (a context manager); a file it cannot read
    (corrupt, truncated, a git-lfs pointer) raises `unreadable`'s CheckpointError naming it."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except READ_ERRORS as e:
        raise unreadable(path, e) from None


def iter_weights(model_dir: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every weight file, loaded on CPU; a sharded checkpoint logs its progress
    (one line per file read)."""
    files = weight_files(model_dir)
    t0 = time.monotonic()
    for i, f in enumerate(files, 1):
        with open_safetensors(f) as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)
        if len(files) > 1:
            log.info("loading weights: %d/%d files (%s) after %.1f s", i, len(files), f.name, time.monotonic() - t0)
