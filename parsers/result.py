"""The non-streaming result: the fold of the very events that would have been streamed (no second code path)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from .events import (ContentDelta, Dropped, Event, Malformed, ReasoningDelta, ToolCallArguments, ToolCallEnd,
                     ToolCallStart)

__all__ = ["ParsedToolCall", "ParsedOutput", "fold"]


class ParsedToolCall(NamedTuple):
    """One tool call as the final message carries it; ``arguments`` is the concatenation of its fragments."""

    id: str
    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """What a choice said. ``content`` holds Malformed bytes in place (they are content on the wire);
    ``malformed`` lists those events for diagnostics; ``unclosed`` holds the indices of calls cut short (no
    ToolCallEnd: the output ended inside them)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    unclosed: set[int] = field(default_factory=set)


def fold(events: Iterable[Event]) -> ParsedOutput:
    """Fold events into the final message: each text channel concatenated in order, calls by index."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, list] = {}
    out = ParsedOutput()
    for e in events:
        t = type(e)
        if t is ContentDelta:
            content.append(e.text)
        elif t is ReasoningDelta:
            reasoning.append(e.text)
        elif t is ToolCallArguments:
            calls.setdefault(e.index, ["", "", []])[2].append(e.fragment)
        elif t is ToolCallStart:
            calls[e.index] = [e.id, e.name, []]
            out.unclosed.add(e.index)
        elif t is ToolCallEnd:
            out.unclosed.discard(e.index)
        elif t is Malformed:
            content.append(e.text)
            out.malformed.append(e)
        elif t is Dropped:
            out.dropped.append(e)
    out.reasoning = "".join(reasoning)
    out.content = "".join(content)
    out.tool_calls = [ParsedToolCall(c[0], c[1], "".join(c[2])) for _, c in sorted(calls.items())]
    return out
