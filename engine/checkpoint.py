"""A checkpoint folder's plain facts: where it is, its config.json (with vLLM's ``--hf-overrides`` applied) and its
tokenizer. No torch, so the HTTP front end reads the very config and tokenizer the engine reads without importing the
engine's model code."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """The checkpoint directory is missing a file or holds something unreadable."""


def checkpoint_dir(model_dir: str | os.PathLike) -> Path:
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (Ember loads local checkpoint directories only)")
    return path


def tokenizer_dir(model_dir: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> Path:
    """The folder a model's tokenizer loads from: ``tokenizer`` (``--tokenizer``) when given, else the model's. The
    engine and the front end both resolve it here, so each loads the same tokenizer."""
    return checkpoint_dir(tokenizer or model_dir)


def load_tokenizer(model_dir: str | os.PathLike):
    """The checkpoint's tokenizer (a transformers PreTrainedTokenizerBase). Its chat template is the one in
    tokenizer_config.json or chat_template.jinja, else the one in chat_template.json (where processor-based
    releases keep it, and which transformers' AutoTokenizer does not read)."""
    from transformers import AutoTokenizer

    root = checkpoint_dir(model_dir)
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((root / n).exists() for n in names):
        raise CheckpointError(f"{root}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root))
    except Exception as e:  # transformers raises many types here; name the directory
        _raise_for_config(root)
        raise CheckpointError(f"{root}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
    if getattr(tokenizer, "chat_template", None) is None and (root / "chat_template.json").exists():
        tokenizer.chat_template = processor_chat_template(root / "chat_template.json")
    if (root / "tokenizer_config.json").exists():
        _honour_added_special_tokens(tokenizer, read_json(root / "tokenizer_config.json"))
    return tokenizer


def _raise_for_config(root: Path) -> None:
    """CheckpointError naming config.json where transformers cannot read it (AutoTokenizer reads it too, and its
    failures would otherwise be blamed on the tokenizer files)."""
    if not (root / "config.json").exists():
        return
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(root))
    except Exception as e:
        raise CheckpointError(f"{root / 'config.json'}: transformers cannot read it ({type(e).__name__}: {e})") \
            from e


def _honour_added_special_tokens(tokenizer, config: Any) -> None:
    """Make ``tokenizer`` add the BOS / EOS that tokenizer_config.json asks for (``add_bos_token: true``).

    transformers 5 loads a ByteLevel tokenizer.json declared as ``LlamaTokenizerFast`` (DeepSeek V3 / R1 and the
    R1 distills) as ``TokenizersBackend``, which drops that flag: completions and /tokenize lost the BOS the model
    was trained with, which transformers 4 (vLLM's) adds."""
    if not isinstance(config, dict):
        return
    for flag, token in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        if config.get(flag) is True and getattr(tokenizer, token, None) is not None \
                and getattr(tokenizer, flag, True) is False:
            setattr(tokenizer, flag, True)


def processor_chat_template(path: Path) -> str | dict[str, str]:
    """The ``chat_template`` of a processor's chat_template.json: a template, or named templates (a list of
    ``{"name", "template"}``) as a dict by name; CheckpointError naming the file when it holds neither."""
    data = read_json(path)
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, str):
        return template
    if isinstance(template, list) and template and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in template):
        return {t["name"]: t["template"] for t in template}
    raise CheckpointError(f"{path}: 'chat_template' must be a template string or a list of "
                          "{\"name\", \"template\"} objects")


_ROPE_KEYS = ("rope_scaling", "rope_parameters")  # one setting, spelled by transformers 4 and 5
_ROPE_KEPT = ("rope_theta", "partial_rotary_factor")  # what transformers 5's rope_parameters also holds


def apply_hf_overrides(config: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``config`` (a config.json) with vLLM's ``--hf-overrides`` applied, as vLLM applies them to the loaded config:
    each key replaces the value, except that a dict given for a sub-config (a dict holding ``model_type``, such as
    ``text_config``) updates that sub-config key by key. ``rope_scaling`` and ``rope_parameters`` are one setting:
    overriding either sets both (a flat form keeps the checkpoint's ``rope_theta`` and ``partial_rotary_factor``), so
    the override wins whichever spelling the checkpoint used; a top-level ``rope_theta`` or ``partial_rotary_factor``
    override also replaces the one in ``rope_parameters`` (which transformers 5 reads first). ``config`` is not
    modified."""
    out = dict(config)
    for key, value in (overrides or {}).items():
        base = out.get(key)
        if isinstance(value, dict) and isinstance(base, dict) and "model_type" in base:
            out[key] = apply_hf_overrides(base, value)
        elif key in _ROPE_KEYS and isinstance(value, dict) and ("rope_type" in value or "type" in value):
            params = out.get("rope_parameters")
            kept = {k: params[k] for k in _ROPE_KEPT if isinstance(params, dict) and k in params}
            out["rope_scaling"] = out["rope_parameters"] = {**kept, **value}
        else:
            out[key] = value
            params = out.get("rope_parameters")
            if key in _ROPE_KEPT and isinstance(params, dict) and key in params:  # the copy transformers 5 reads
                out["rope_parameters"] = {**params, key: value}
    return out


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file; CheckpointError naming it when it is missing or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_config(model_dir: str | os.PathLike, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint's config.json with ``overrides`` (``--hf-overrides``) applied: the one view of the model's
    configuration that the engine and the front end both read."""
    path = checkpoint_dir(model_dir) / "config.json"
    config = read_json(path)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return apply_hf_overrides(config, overrides)
