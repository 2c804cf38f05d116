"""Events of the output pipeline: what each generated token became.

Every byte of the generated text lands in exactly one event, in order. The wire encoders (OpenAI chunks, Anthropic
events) are pure functions of these events, and a non-streaming response is their fold.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningDelta:
    """Text of the model's thought (`reasoning_content`, Anthropic `thinking`)."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """Text of the answer (`content`, Anthropic `text`)."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call began; ``index`` counts calls in this choice from 0, ``id`` is ``call_...``."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """An append-only fragment of the call's JSON ``arguments`` string."""

    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


@dataclass(frozen=True)
class Malformed:
    """Bytes that broke the family's syntax; surfaced (as content on the wire), never dropped."""

    text: str
    reason: str


@dataclass(frozen=True)
class Dropped:
    """Accounting only: delimiters and template whitespace that are not surfaced."""

    text: str
    reason: str


CHANNEL_ENDS = frozenset({"reasoning close", "reasoning open", "tool call open", "harmony end", "harmony start"})
"""`Dropped` reasons of the delimiters that end the reasoning or answer text before them (`</think>`, a tool call's
opener, harmony's message boundaries): text cut by the end of the output after one was not cut itself."""

Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArguments | ToolCallEnd | Malformed | Dropped
