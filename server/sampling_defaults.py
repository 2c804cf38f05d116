"""The model's recommended sampling settings: generation_config.json's ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (the reply length of a request that sets none), which a request that
leaves one unset takes (vLLM's ``--generation-config auto``; Qwen3,
for instance, asks for temperature 0.6, top_p 0.95 and top_k 20). ``--generation-config vllm`` ignores them (each
unset setting is then neutral: temperature 1, no truncation, no penalty); a folder reads its generation_config.json
instead of the model's. ``--override-generation-config`` (vLLM's flag) sets some of them over whichever of those
applies. As in vLLM, the override's ``max_new_tokens`` (or, with a folder, the folder's) is also a cap on every
reply, a request's own limit included; the model's own ``max_new_tokens`` is only a default."""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

log = logging.getLogger("ember.server")

IGNORE = ("vllm", "none")
_SETTINGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
"""The generation_config.json keys read (and the only ones ``--override-generation-config`` may set)."""


@dataclass(frozen=True)
class SamplingDefaults:
    """Values for unset request settings (None: the setting's neutral value)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    max_tokens_cap: int | None = None
    """The most tokens any reply may have, whatever the request asks (vLLM's override_max_tokens)."""

    @classmethod
    def from_generation_config(cls, raw: dict[str, Any], source: str, strict: bool = False) -> "SamplingDefaults":
        """The usable settings of a generation_config.json (a value out of its range is logged and skipped; with
        ``strict``, ValueError naming it, as for a key that is not one of these settings)."""
        if strict:
            unknown = sorted(set(raw) - set(_SETTINGS))
            if unknown:
                raise ValueError(f"{source}: {', '.join(unknown)} not supported (only {', '.join(_SETTINGS)})")
        ranges = {"temperature": (0.0, 100.0), "top_p": (1e-9, 1.0), "top_k": (-1, 1 << 31), "min_p": (0.0, 1.0),
                  "repetition_penalty": (1e-9, 100.0), "max_new_tokens": (1, 1 << 31)}
        values: dict[str, Any] = {}
        for name in _SETTINGS:
            v = raw.get(name)
            if v is None:
                continue
            lo, hi = ranges[name]
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi
            if name in ("top_k", "max_new_tokens"):
                ok = ok and float(v).is_integer()
            if not ok:
                if strict:
                    raise ValueError(f"{source}: {name} = {v!r} is not a usable value")
                log.warning("%s: %s = %r is not a usable default; ignored", source, name, v)
                continue
            values[name] = int(v) if name in ("top_k", "max_new_tokens") else float(v)
        return cls(**values)

    @classmethod
    def load(cls, setting: str, model_dir: str | Path, override: dict[str, Any] | None = None) -> "SamplingDefaults":
        """``setting`` is ``--generation-config``: ``auto`` (the model's), ``vllm`` / ``none``, or a folder;
        ``override`` (``--override-generation-config``) sets values over it."""
        defaults = cls._from_setting(setting, model_dir)
        given = cls.from_generation_config(override or {}, "--override-generation-config", strict=True)
        if override:
            defaults = replace(defaults, **{name: getattr(given, name) for name in _SETTINGS
                                            if getattr(given, name) is not None})
        folder = setting != "auto" and setting not in IGNORE
        defaults = replace(defaults, max_tokens_cap=defaults.max_new_tokens if folder else given.max_new_tokens)
        if override:
            log.info("sampling defaults after --override-generation-config: %s", defaults)
        return defaults

    @classmethod
    def _from_setting(cls, setting: str, model_dir: str | Path) -> "SamplingDefaults":
        if setting in IGNORE:
            return cls()
        path = Path(model_dir if setting == "auto" else setting) / "generation_config.json"
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise _unusable(setting, path, f"cannot be read ({e.strerror or e})") from None
        except ValueError as e:  # not JSON, or not UTF-8
            raise _unusable(setting, path, f"is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise _unusable(setting, path, "is not a JSON object")
        defaults = cls.from_generation_config(raw, str(path))
        chosen = {name: getattr(defaults, name) for name in _SETTINGS if getattr(defaults, name) is not None}
        if chosen:
            log.info("sampling defaults from %s: %s (--generation-config vllm ignores them)", path,
                     ", ".join(f"{k}={v}" for k, v in chosen.items()))
        return defaults


def _unusable(setting: str, path: Path, why: str) -> Exception:
    """The one-line StartupError for a generation_config.json that cannot be used, naming the flag and the file."""
    from .startup import StartupError

    return StartupError(f"--generation-config {setting}: {path} {why}; fix the file, or pass --generation-config "
                        f"vllm to ignore it")
