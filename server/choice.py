"""What one choice of a request produced, step by step: the plain data between generation and the wire encoders."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ember.engine.params import TokenLogprob
from ember.parsers.events import Event

EndReason = Literal["eos", "stop_string", "length", "abort", "error"]
"""`eos`: an EOS / stop token or the constraint ended the turn; `stop_string`: a request stop string matched;
`length`: max_tokens or the model's length; `abort`: the engine aborted it; `error`: generation failed."""


@dataclass
class TokenInfo:
    """One generated token with its log-probability data and the channel its first byte went to (text of a tool
    call surfaced as Malformed is content; whitespace the parser held and then dropped is structure)."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # top alternatives (token ID, logprob), best first
    channel: str | None = None  # "content" | "reasoning" | "tool" | "dropped" (never surfaced) | None (structure)


@dataclass
class ChoiceEnd:
    reason: EndReason
    stop_string: str | None = None
    error: str | None = None
    rejected: bool = False  # the request's own settings failed it (it can never fit the KV cache, no token allowed)
    cached_tokens: int | None = None  # prompt tokens the engine served from its prefix cache (None: not known)
    stop_token: int | None = None  # the request's `stop_token_ids` token that ended it (an EOS: None)

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's `stop_reason`: the stop string that matched or the stop token ID that ended the choice; None
        for EOS, length and any other end."""
        return self.stop_string if self.reason == "stop_string" else self.stop_token


@dataclass
class ChoiceStep:
    """Generated tokens of one choice and the events they completed; `end` is set on the choice's last step. A token
    whose text the parser held (whitespace at a boundary, a call's head) comes in the step that surfaced or dropped
    that text, so its logprob entry rides with its text."""

    index: int
    tokens: list[TokenInfo] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    end: ChoiceEnd | None = None
    finish_at: int | None = None  # on the last step: where in `events` the pipeline's end-of-output flush begins
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first step, when asked: prompt tokens 1.. scored
