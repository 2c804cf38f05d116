"""The one rule for which token IDs end a turn: the engine's stop check, the grammar backend's EOS set and the output
pipeline's dropped specials all come from `end_of_turn_ids`, so they never disagree.

Torch-free on purpose: the server and the grammar backend import it without loading the engine.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _config_eos(cfg: dict[str, Any]) -> list[int]:
    out = _ids(cfg.get("eos_token_id"))
    text = cfg.get("text_config")
    if isinstance(text, dict):
        out += _ids(text.get("eos_token_id"))
    return out


def end_of_turn_ids(tokenizer: Any, model_dir: str | os.PathLike | None) -> tuple[int, ...]:
    """Every token ID that ends generation, in a stable order.

    As Hugging Face generation decides: ``generation_config.json``'s ``eos_token_id`` (an int or a list) when it has
    one, otherwise ``config.json``'s (or its ``text_config``'s); plus the tokenizer's own ``eos_token_id``.
    ``tokenizer`` may be None (the checkpoint's files alone) and ``model_dir`` None (the tokenizer alone).
    """
    ids: list[int] = []
    if model_dir is not None:
        root = Path(model_dir)
        gen = _read_json(root / "generation_config.json")
        ids += _ids(gen.get("eos_token_id")) if gen.get("eos_token_id") is not None \
            else _config_eos(_read_json(root / "config.json"))
    own = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(own, int):
        ids.append(own)
    return tuple(dict.fromkeys(ids))
