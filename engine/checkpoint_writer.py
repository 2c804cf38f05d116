"""Writing a checkpoint directory so that a failed run leaves none: files go into a temporary sibling that takes the
output's place only once complete (`ember convert-llama2c`, `ember quantize-nvfp4`)."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file


@contextlib.contextmanager
def staged(dst: Path) -> Iterator[Path]:
    """A fresh temporary sibling directory of ``dst`` to write into: when the block completes its files move into
    ``dst`` (created if absent), when it fails it is removed and ``dst`` is left as it was."""
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"{dst}: not a directory")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
                os.replace(f, dst / f.name)
        else:
            tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, shown: Path) -> None:
    """``save_file`` to ``path``; ValueError naming ``shown`` (the file's final place) when it cannot be written
    (safetensors raises its own error, not OSError, on a full disk)."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        raise ValueError(f"{shown}: cannot be written ({e})") from None


def holds_checkpoint(d: Path) -> bool:
    """Whether directory ``d`` holds safetensors weights or their index."""
    return d.is_dir() and (any(d.glob("*.safetensors")) or (d / "model.safetensors.index.json").exists())
