"""Building an `Engine` from `EngineArgs` and describing it as a `ModelInfo`; shared by both engine clients.

Structured output reaches the engine through a `ConstraintBackend` (built by the server's grammar package): it fills
bitmasks and turns a plain-data constraint spec into the engine's `Constraint`. A `ConstraintBackendFactory` is a
top-level function (picklable by name) so the engine process can build its own backend from the model directory.
"""
from __future__ import annotations

import inspect
import os
import time
from typing import Any, Callable, Protocol

from ember.engine.args import EngineArgs
from ember.engine.client import ModelInfo
from ember.engine.config import ConfigError
from ember.engine.constraint import BitmaskFiller, Constraint
from ember.engine.engine import Engine
from ember.engine.eos import end_of_turn_ids
from ember.engine.models import classifier


class ConstraintBackend(Protocol):
    """The engine side of structured output."""

    def bitmask_filler(self) -> BitmaskFiller: ...

    def build(self, spec: Any) -> Constraint:
        """A fresh Constraint for one request from its plain-data spec."""
        ...


ConstraintBackendFactory = Callable[[str], "ConstraintBackend | None"]


def build_engine(model_dir: str | os.PathLike, args: EngineArgs,
                 constraints: ConstraintBackend | None = None) -> tuple[Engine, ModelInfo]:
    """Load the engine as ``args`` say; its `ModelInfo` records the load time."""
    args.apply_environment()
    options = args.engine_options()
    if "kv_cache_dtype" not in inspect.signature(Engine.from_pretrained).parameters:
        if options.pop("kv_cache_dtype") != "auto":
            raise ConfigError(f"kv_cache_dtype={args.kv_cache_dtype!r} is not supported by this engine build")
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(model_dir, bitmask_filler=constraints.bitmask_filler() if constraints else None,
                                    **options)
    return engine, model_info_of(engine, time.perf_counter() - t0, args.kv_cache_dtype)


def model_info_of(engine: Engine, load_seconds: float = 0.0, kv_cache_dtype: str = "auto") -> ModelInfo:
    mc = engine.model_config
    model = getattr(engine.runner, "model", None)
    num_params = sum(p.numel() for p in model.parameters()) if model is not None else 0
    labels = classifier.labels(mc) if engine.score_head is not None else ()
    return ModelInfo(
        model_dir=str(engine.model_dir), tokenizer_path=str(engine.tokenizer_dir), model_type=mc.model_type or None,
        architecture=mc.architecture, dtype=str(engine.dtype).removeprefix("torch."), device=str(engine.device),
        vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
        eos_token_ids=end_of_turn_ids(engine.tokenizer, engine.model_dir), block_size=engine.config.block_size,
        num_kv_blocks=engine.kv.num_blocks, max_num_seqs=engine.config.max_num_seqs,
        tensor_parallel_size=engine.config.tensor_parallel_size, kv_cache_dtype=kv_cache_dtype,
        load_seconds=float(load_seconds), num_params=int(num_params),
        labels=labels, label_activation=classifier.activation(mc) if engine.score_head is not None else "",
        score_activation=classifier.score_activation(mc) if len(labels) == 1 else "sigmoid",
        joins_pairs=engine.score_head is not None and classifier.joins_pairs(mc),
        encoder=mc.is_encoder,
        lora_adapters=engine.lora.listed() if engine.lora else (),
        max_prompt_tokens=engine.scheduler.max_prompt_tokens)
