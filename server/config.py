"""Options of `ember serve`, as one plain dataclass shared by the CLI, the app factory and tests."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class ServeConfig:
    """How to load the model and run the HTTP server.

    `model_dir` None means the built-in demo model (built once into the cache directory). `kv_cache_blocks` and
    `kv_cache_memory` (bytes) are alternatives; with neither the engine sizes the cache itself. `chat_template` is a
    path to a Jinja file or the template text. `reasoning_parser` / `tool_parser` name a parser profile (or
    "none" to switch that part off); unset, the profile is detected from the chat template and model type.
    """

    model_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    kv_cache_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    chat_template: str | None = None
    max_waiting: int = 1024  # admission answers 503 while this many requests already wait in the engine
    max_n: int = 16  # largest `n` a request may ask for
    log_level: str = "info"
    tensor_parallel_size: int = 1  # ranks that split every layer (the engine spawns N-1 worker processes)
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory the engine may use (sizes the KV cache)
    enforce_eager: bool = False  # decode without CUDA graphs


def parse_fraction(text: str) -> float:
    """`"0.9"` -> 0.9; ValueError outside (0, 1]."""
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{text!r} is not in (0, 1]")
    return value


def parse_memory(text: str) -> int:
    """`"512M"`, `"2G"`, `"1.5GiB"` or a plain byte count -> bytes."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in scale:
        return int(float(s[:-1]) * scale[s[-1]])
    return int(float(s))
