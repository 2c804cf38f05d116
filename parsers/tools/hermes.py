"""Hermes JSON tool calls: `<tool_call>{"name": "NAME", "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3).

The wrapper object is scanned incrementally (`parsers.json_stream.HermesWrapper`); the arguments value passes through
as the model's own bytes. Pieces before the name is known are buffered (the name may come after the arguments) and
released, in order, once it is. A name or key string longer than `MAX_NAME` makes the call Malformed from there. A
named call that streamed no arguments (none written, an empty value, a wrapper broken or closed after the name) has
`"{}"`; one the output's end cut has what it streamed.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..json_stream import HermesWrapper
from ..profiles.base import BAD_CALL, TOOL_BETWEEN, TOOL_JSON, TOOL_PREAMBLE
from .base import MAX_NAME, Handler, ToolSyntax


class HermesSyntax(ToolSyntax):
    tool_format = "hermes"

    def __init__(self, machine, tools: Sequence[dict] | None) -> None:
        super().__init__(machine, tools)
        self._wrapper: HermesWrapper | None = None
        self._pre: list[tuple[str, str]] = []     # pieces before the name is known
        self._sent = False                        # the open call has streamed arguments

    def handlers(self) -> dict[str, Handler]:
        return {TOOL_PREAMBLE: self._preamble_text, TOOL_JSON: self._json_text}

    def close(self, state: str, at_finish: bool) -> None:
        if state == TOOL_JSON:
            m = self.m
            if m.call_open:
                m.drop(self._wrapper.pending_raw, "tool call wrapper")
                self._end_call(cut=at_finish)
            else:
                m.malformed(self._pre_raw(), "tool call cut short")

    def _preamble_text(self, s: str) -> int:
        m = self.m
        i = m.structural_ws(s, "text before tool call body", "{")
        if i < len(s):
            m.bad_run = False
            self._wrapper = HermesWrapper()
            self._pre = []
            m.state = TOOL_JSON
        return i

    def _json_text(self, s: str) -> int:
        m = self.m
        w = self._wrapper
        n, pieces = w.feed(s)
        for kind, text in pieces:
            if m.call_open:
                if kind == "args":
                    self._args(text)
                else:
                    m.drop(text, "tool call wrapper")
            elif kind == "name":
                self._start_named(text)
            else:
                self._pre.append((kind, text))
        if w.error is None and len(w.pending_raw) > MAX_NAME:
            m.malformed(self._pre_raw() if not m.call_open else w.pending_raw, "tool call name or key too long")
            m.state = BAD_CALL
        elif w.error is not None:
            if not m.call_open:
                m.malformed(self._pre_raw(), w.error)
            elif not self._sent:
                self._args("{}")  # the machine ends the call at its closer
            m.state = BAD_CALL
        elif w.done:
            if m.call_open:
                self._end_call()
            else:
                m.malformed(self._pre_raw(), "tool call without a name")
            m.state = TOOL_BETWEEN
        return n

    def _start_named(self, name: str) -> None:
        m = self.m
        pre, self._pre = self._pre, []
        k = 0
        while k < len(pre) and pre[k][0] == "drop":
            m.drop(pre[k][1], "tool call wrapper")
            k += 1
        m.start_call(name)
        self._sent = False
        for kind, text in pre[k:]:
            if kind == "args":
                self._args(text)
            else:
                m.drop(text, "tool call wrapper")

    def _args(self, text: str) -> None:
        if text:
            self._sent = True
            self.m.args(text)

    def _end_call(self, cut: bool = False) -> None:
        """End the open call: `"{}"` where it streamed no arguments, unless the output was cut (as far as it got)."""
        if not self._sent and not cut:
            self._args("{}")
        self.m.end_call()

    def _pre_raw(self) -> str:
        raw = "".join(t for _, t in self._pre) + (self._wrapper.pending_raw if self._wrapper else "")
        self._pre = []
        return raw
