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


def _cut(text: str, limit: int | None) -> str:
    return text if limit is None or len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


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
        limit = self.max_len
        ids = list(prompt_ids if limit is None else prompt_ids[:limit])
        shown = repr(ids) if limit is None or len(prompt_ids) <= limit else \
            f"{repr(ids)[:-1]}, ...] ({len(prompt_ids)} tokens)"
        log.info("Received request %s: prompt: %r, params: {%s}, prompt_token_ids: %s", request_id,
                 _cut(decode(ids), limit), changed_settings(params), shown)

    def finished(self, request_id: str, reason: str, prompt_tokens: int, output_tokens: int, arrival: float,
                 **extra: Any) -> None:
        more = "".join(f", {k}={v}" for k, v in extra.items() if v is not None)
        log.info("Finished request %s: %s, prompt_tokens=%d, output_tokens=%d%s, %.3fs", request_id, reason,
                 prompt_tokens, output_tokens, more, time.monotonic() - arrival)
