"""A checkpoint folder's plain facts: where it is and its tokenizer. No torch, so the HTTP front end loads the very
tokenizer the engine loads without importing the engine's model code."""
from __future__ import annotations

import os
from pathlib import Path


class CheckpointError(ValueError):
    """The checkpoint directory is missing a file or holds something unreadable."""


def checkpoint_dir(model_dir: str | os.PathLike) -> Path:
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (Ember loads local checkpoint directories only)")
    return path


def load_tokenizer(model_dir: str | os.PathLike):
    """The checkpoint's tokenizer (a transformers PreTrainedTokenizerBase)."""
    from transformers import AutoTokenizer

    root = checkpoint_dir(model_dir)
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((root / n).exists() for n in names):
        raise CheckpointError(f"{root}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(str(root))
    except Exception as e:  # transformers raises many types here; name the directory
        raise CheckpointError(f"{root}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
