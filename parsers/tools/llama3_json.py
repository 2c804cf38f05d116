"""Llama 3.x JSON tool calls: `{"name": "f", "parameters": {...}}` after `<|python_tag|>` or bare at the start of the
reply, several separated by `; ` (vLLM's `llama3_json`).

Each object is the Hermes wrapper with ``"parameters"`` (or ``"arguments"``) as the arguments key, read by the same
code (`HermesSyntax`, `parsers.json_stream.HermesWrapper`); the arguments stream as the model's own bytes. What this
syntax adds: a call may start without an opener, when the reply's first non-whitespace character is `{` (whitespace
before it is held and Dropped), and after a call `;` and whitespace are separators before the next `{`. Any other
text after a call is Malformed (surfaced as content) to the end of the reply. A reply whose first character is not
`{` stays content, whole (a `<|python_tag|>` token later in it still starts calls).
"""
from __future__ import annotations

from collections.abc import Sequence

from ..profiles.base import CONTENT, TOOL_BETWEEN, TOOL_PREAMBLE, Rule
from .base import WHITESPACE, Handler
from .hermes import HermesSyntax

_WS = WHITESPACE
_SEPARATORS = _WS + ";"
_OPEN = Rule("tool_open")


class Llama3JsonSyntax(HermesSyntax):
    tool_format = "llama3_json"

    def __init__(self, machine, tools: Sequence[dict] | None) -> None:
        super().__init__(machine, tools)
        self._trailing = False       # stray text after a call: the rest is Malformed

    def handlers(self) -> dict[str, Handler]:
        return {**super().handlers(), CONTENT: self._content_text, TOOL_BETWEEN: self._between_text}

    def _content_text(self, s: str) -> int:
        # a bare `{` opens the call as `tool_open` would (drops the held whitespace, enters TOOL_PREAMBLE)
        return self.bare_start_text(s, "{", lambda: self.m.apply(_OPEN, ""))

    def _between_text(self, s: str) -> int:
        m = self.m
        if self._trailing:
            m.malformed(s, "text after tool call")
            return len(s)
        i, n = 0, len(s)
        while i < n and s[i] in _SEPARATORS:
            i += 1
        m.drop(s[:i], "tool call separator")
        if i == n:
            return n
        if s[i] == "{":
            m.state = TOOL_PREAMBLE
            return i
        self._trailing = True
        m.malformed(s[i:], "text after tool call")
        return n
