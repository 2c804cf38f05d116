"""Per-request log lines (``--enable-log-requests``, vLLM's flag): what each engine request received, and how it
ended. Off by default: prompts are user data.

One INFO line when a request (one choice, or one pooled input) reaches the engine: its ID, the prompt text and
token IDs (each cut to ``--max-log-len`` characters / IDs), and the sampling settings that differ from their
defaults; one when it ends: the reason, token counts and seconds since the HTTP request arrived.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ember.engine.params import SamplingParams

log = logging.getLogger("ember.requests")


def changed_settings(params: SamplingParams) -> str:
    """``params``' fields that differ from their defaults, as ``name=value`` (vLLM logs the whole object)."""
    out = []
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value != default:
            out.append(f"{f.name}={value!r}")
    return ", ".join(out)


@dataclass(frozen=True)
class RequestLog:
    """Writes the lines; ``max_len`` None logs prompts whole."""

    max_len: int | None = None

    def received(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                 decode: Callable[[list[int]], str]) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        limit, n = self.max_len, len(prompt_ids)
        if limit is None:
            ids = list(prompt_ids)
            text, shown = repr(decode(ids)), repr(ids)
        else:  # only the first ``limit`` IDs are decoded: logging a long prompt costs what its cut costs
            ids = list(prompt_ids[:limit])
            decoded = decode(ids)
            text = repr(decoded[:limit])
            if n > limit or len(decoded) > limit:
                text = f"{repr(decoded[:limit].rstrip(chr(0xFFFD)))}... ({n} tokens)"
            shown = repr(ids) if n <= limit else "[" + "".join(f"{i}, " for i in ids) + f"...] ({n} tokens)"
        log.info("Received request %s: prompt: %s, params: {%s}, prompt_token_ids: %s", request_id, text,
                 changed_settings(params), shown)

    def finished(self, request_id: str, reason: str, prompt_tokens: int, output_tokens: int, arrival: float,
                 **extra: Any) -> None:
        more = "".join(f", {k}={v}" for k, v in extra.items() if v is not None)
        log.info("Finished request %s: %s, prompt_tokens=%d, output_tokens=%d%s, %.3fs", request_id, reason,
                 prompt_tokens, output_tokens, more, time.monotonic() - arrival)
