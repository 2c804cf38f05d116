"""Plain data crossing the engine's boundary: what a request asks for and what each step returns.

The engine deals in token IDs only; text, stop strings and parsing belong to the output pipeline (`ember.parsers`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]
"""`stop`: EOS, a stop token ID or the constraint terminated; `length`: max_tokens or max model length;
`abort`: the caller aborted; `error`: the request's constraint rejected a token or failed."""


@dataclass
class SamplingParams:
    """Per-request sampling settings, named as in vLLM / the OpenAI API."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # None: none; 0: the sampled token's logprob; N: plus the top-N alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (its prefix scores it)
    logit_bias: dict[int, float] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    lora: str | None = None  # the LoRA adapter (by its served name) this request runs under; None: the base model
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these tokens
    bad_words_ids: list[list[int]] | None = None
    """vLLM's ``bad_words``, tokenized: a sequence's last token is banned wherever the output so far ends with the
    tokens before it (a one-token sequence is banned everywhere)."""
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only among requests with the same salt
    priority: int = 0  # vLLM's, under the priority scheduling policy: lower values are admitted first
    pooling: str | None = None
    """None: generate. ``"last"``, ``"mean"`` or ``"cls"``: an embedding request (`ember.engine.pooling`): the
    prompt is computed and its final hidden states pooled into `RequestOutput.embedding`; no token is generated and
    the sampling settings are ignored."""
    token_type_start: int | None = None
    """A pooling prompt's first position of token type 1 (the second text of a pair; the prompt's length or more: a
    single text) on models that read token types (BERT). None: after the prompt's first ``[SEP]``, as the tokenizer's
    pair encoding writes them."""


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives (token ID, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # prompt logprobs: 1 + how many tokens score higher than ``token_id`` (sampled: None)


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per new token when requested
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the EOS / stop token that ended it (also in new_token_ids)
    error: str | None = None  # set with finish_reason "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_seconds: float | None = None  # from add_request to the first step that scheduled it (None: not yet)
    scheduled_at: float | None = None
    """The engine's `time.monotonic()` at the first step that scheduled it (None: not yet): the system-wide clock of the
    host, so comparable with the front end's readings across the engine-process boundary (vLLM's first SCHEDULED
    event)."""
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (with the first output), when requested
    embedding: list[float] | None = None  # the pooled hidden state (fp32, not normalized): a pooling request's end
    rejected: bool = False  # with "error": the request's own settings caused it (a client error, not the server's)
    steps: int = 1  # the engine steps whose tokens it carries: more once outputs are merged for a lagging consumer
