"""How `/v1/embeddings` turns the served model's hidden states into an embedding: `PoolingSpec`, read once at start.

Where it comes from, first found wins:
- ``--pooler-config`` (vLLM's flag): ``{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true | false}``;
- the checkpoint's sentence-transformers files: ``modules.json`` names a ``Pooling`` module whose ``config.json``
  picks the mode (``pooling_mode_lasttoken``, ``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``), and a
  ``Normalize`` module after it means unit length. A module that changes the vector further (``Dense``, ...) or a
  mode Ember does not compute makes the spec ``refused``: serving a different vector than the model's authors
  would be silently wrong, so `/v1/embeddings` answers 400 with the reason;
- otherwise last-token pooling, normalized (vLLM's default for a decoder model), or the first ([CLS]) position's
  for an encoder (BERT, XLM-RoBERTa), as vLLM pools one.

Matryoshka (the request's ``dimensions``) is allowed only where config.json says the model was trained for it
(``is_matryoshka``, or ``matryoshka_dimensions`` listing the sizes it supports; either may come from
``--hf-overrides``), as vLLM rules.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.engine.checkpoint import read_config

log = logging.getLogger(__name__)

_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_PASSIVE_MODULES = ("Transformer", "Normalize", "Pooling")


@dataclass(frozen=True)
class PoolingSpec:
    kind: str = "last"  # `ember.engine.pooling.POOLING_TYPES`
    normalize: bool = True
    matryoshka: bool = False  # `dimensions` may shorten the vector
    matryoshka_dimensions: tuple[int, ...] | None = None  # the only sizes allowed, when the model lists them
    source: str = "default"  # where the spec came from (logged at start)
    refused: str | None = None  # why this model's embeddings are not served (None: they are)
    hidden_size: int | None = None  # the embedding's length (config.json), when known

    def check_dimensions(self, dimensions: int) -> str | None:
        """Why ``dimensions`` cannot be served (None: it can)."""
        if not self.matryoshka:
            return ("this model does not support Matryoshka representation (config.json has no is_matryoshka or "
                    "matryoshka_dimensions): changing the output dimensions would give poor embeddings")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            return (f"dimensions must be one of {list(self.matryoshka_dimensions)} for this model, "
                    f"got {dimensions}")
        top = self.hidden_size
        if dimensions < 1 or (top is not None and dimensions > top):
            return f"dimensions must be in [1, {top}] (the model's hidden size), got {dimensions}"
        return None


def parse_pooler_config(text: str) -> dict[str, Any]:
    """`--pooler-config`: the JSON object, checked (ValueError naming the bad key or value)."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--pooler-config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("--pooler-config must be a JSON object, e.g. '{\"pooling_type\": \"MEAN\"}'")
    unknown = sorted(set(raw) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"--pooler-config: unknown key {unknown[0]!r} (Ember reads pooling_type and normalize)")
    kind = raw.get("pooling_type")
    if kind is not None and (not isinstance(kind, str) or kind.lower() not in ("last", "mean", "cls")):
        raise ValueError(f"--pooler-config: pooling_type must be LAST, MEAN or CLS, got {kind!r}")
    if "normalize" in raw and not isinstance(raw["normalize"], bool):
        raise ValueError(f"--pooler-config: normalize must be true or false, got {raw['normalize']!r}")
    return raw


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _sentence_transformers(model_dir: Path) -> tuple[str, bool, str | None] | None:
    """``(kind, normalize, refused)`` from ``modules.json``, or None when the checkpoint has none."""
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None
    types = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
    kind, refused = "last", None
    others = [t for t in types if t not in _PASSIVE_MODULES]
    if others:
        refused = f"its sentence-transformers pipeline has a {others[0]} module, which Ember does not apply"
    pool = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")), None)
    if pool is not None:
        cfg = _read_json(model_dir / str(pool.get("path", "")) / "config.json") or {}
        chosen = [_ST_MODES[k] for k in _ST_MODES if cfg.get(k)]
        other = [k for k in _ST_OTHER_MODES if cfg.get(k)]
        if len(chosen) == 1 and not other and cfg.get("include_prompt", True):
            kind = chosen[0]
        elif refused is None:
            refused = f"its sentence-transformers pooling {cfg!r} is not one mode of last, mean or cls over the prompt"
    return kind, "Normalize" in types, refused


def load_pooling_spec(model_dir: Path, pooler_config: dict[str, Any] | None,
                      hf_overrides: dict[str, Any] | None = None, encoder: bool = False) -> PoolingSpec:
    """The spec for the model in ``model_dir`` (see the module docstring; ``encoder``: `ModelInfo.encoder`); its
    config.json is read with ``hf_overrides`` applied (vLLM's way to declare Matryoshka for a model whose config
    does not)."""
    config = read_config(model_dir, hf_overrides)
    dims = config.get("matryoshka_dimensions")
    dims = tuple(int(d) for d in dims) if isinstance(dims, list) and dims else None
    matryoshka = bool(config.get("is_matryoshka")) or dims is not None
    hidden = config.get("hidden_size", (config.get("text_config") or {}).get("hidden_size"))
    common = dict(matryoshka=matryoshka, matryoshka_dimensions=dims,
                  hidden_size=hidden if isinstance(hidden, int) else None)
    st = _sentence_transformers(model_dir)
    default = "cls" if encoder else "last"
    if pooler_config:
        kind = str(pooler_config.get("pooling_type") or (st[0] if st else default)).lower()
        normalize = pooler_config.get("normalize", st[1] if st else True)
        spec = PoolingSpec(kind, normalize, source="--pooler-config", **common)
    elif st is not None:
        spec = PoolingSpec(st[0], st[1], source="sentence-transformers modules.json", refused=st[2], **common)
    else:
        spec = PoolingSpec(default, **common)
    if spec.refused:
        log.warning("/v1/embeddings is refused for this model: %s (pass --pooler-config to choose a pooling)",
                    spec.refused)
    else:
        log.info("embeddings: %s pooling%s (%s)", spec.kind, ", normalized" if spec.normalize else "", spec.source)
    return spec
