"""The non-streaming result: the fold of the very events that would have been streamed (no second code path)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from .events import (ContentDelta, Dropped, Event, Malformed, ReasoningDelta, ToolCallArguments, ToolCallEnd,
                     ToolCallStart)

__all__ = ["ParsedToolCall", "Block", "ParsedOutput", "fold"]


class ParsedToolCall(NamedTuple):
    """One tool call as the final message carries it; ``arguments`` is the concatenation of its fragments; ``index``
    its position among the calls of this choice."""

    id: str
    name: str
    arguments: str
    index: int = -1


class Block(NamedTuple):
    """One run of the reply, in order: ``kind`` "reasoning" or "content" with its ``text``, or "tool" with the
    call's ``index`` and as ``text`` all its argument fragments. A call's run is never split: text that arrives
    while it is open (stray text inside a call) forms the runs that follow it. A run ends where the channel changes
    or a call starts or ends (Anthropic's content blocks are these runs)."""

    kind: str
    text: str = ""
    index: int = -1


@dataclass
class ParsedOutput:
    """What a choice said. ``content`` holds Malformed bytes in place (they are content on the wire);
    ``malformed`` lists those events for diagnostics; ``unclosed`` holds the indices of calls cut short (no
    ToolCallEnd: the output ended inside them); ``blocks`` is the same reply as ordered runs."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    unclosed: set[int] = field(default_factory=set)
    blocks: list[Block] = field(default_factory=list)

    @property
    def completed_calls(self) -> int:
        """Calls that ended (not cut short)."""
        return len(self.tool_calls) - len(self.unclosed)


def fold(events: Iterable[Event]) -> ParsedOutput:
    """Fold events into the final message: each text channel concatenated in order, calls by index, and the ordered
    runs (`Block`). The one fold of parser events: the server's non-streaming bodies are built from it."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, list] = {}
    runs: list[list] = []           # [kind, text parts, call index]
    open_run: list | None = None    # the run text may still join (None after a call ended)
    held: list[list] = []           # text runs that arrived inside the open call: they follow its run
    out = ParsedOutput()

    def release() -> None:
        nonlocal open_run
        if held:
            runs.extend(held)
            open_run = held[-1]
            held.clear()

    for e in events:
        t = type(e)
        if t is ContentDelta or t is Malformed or t is ReasoningDelta:
            kind = "reasoning" if t is ReasoningDelta else "content"
            (reasoning if t is ReasoningDelta else content).append(e.text)
            if t is Malformed:
                out.malformed.append(e)
            if e.text:
                if open_run is not None and open_run[0] == "tool":
                    if not held or held[-1][0] != kind:
                        held.append([kind, [], -1])
                    held[-1][1].append(e.text)
                    continue
                if open_run is None or open_run[0] != kind:
                    open_run = [kind, [], -1]
                    runs.append(open_run)
                open_run[1].append(e.text)
        elif t is ToolCallArguments:
            calls.setdefault(e.index, ["", "", []])[2].append(e.fragment)
            if open_run is not None and open_run[2] == e.index:
                open_run[1].append(e.fragment)
        elif t is ToolCallStart:
            release()
            calls[e.index] = [e.id, e.name, []]
            out.unclosed.add(e.index)
            open_run = ["tool", [], e.index]
            runs.append(open_run)
        elif t is ToolCallEnd:
            out.unclosed.discard(e.index)
            if open_run is not None and open_run[0] == "tool" and open_run[2] == e.index:
                open_run = None
                release()
        elif t is Dropped:
            out.dropped.append(e)
    release()
    out.reasoning = "".join(reasoning)
    out.content = "".join(content)
    out.tool_calls = [ParsedToolCall(c[0], c[1], "".join(c[2]), i) for i, c in sorted(calls.items())]
    out.blocks = [Block(k, "".join(parts), i) for k, parts, i in runs]
    return out
