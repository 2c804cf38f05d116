"""DeepSeek-V3 / R1-0528 / V3.1 tool calls: a section of calls, each a head, a separator token and JSON arguments.

`SepJsonSyntax` is the shape DeepSeek and Kimi K2 share: `tool_open (call_open HEAD call_sep JSON call_close)*
tool_close`, every marker a single token. The head is buffered (bounded by `MAX_NAME`) until the separator; the
arguments JSON streams through verbatim (`parsers.json_stream.JsonValueScanner` says where it ends); whitespace and
code fences around it are Dropped, any other stray text is Malformed. A subclass says what a head means (`_head_end`).

DeepSeek's head is either V3's type word `function`, followed after the separator by `NAME\\n```json\\n{..}\\n````, or
V3.1's NAME, followed by the bare JSON.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..json_stream import JsonValueScanner
from ..profiles.base import BAD_CALL, TOOL_PREAMBLE
from ..profiles.deepseek_v3 import SJ_ARGS, SJ_HEAD, SJ_NAME, SJ_POST, SJ_PRE
from .base import MAX_NAME, Action, Handler, ToolSyntax

_WS = " \t\r\n"
_FENCE = _WS + "`"
_LANG = "json"
_TYPE_WORD = "function"


class SepJsonSyntax(ToolSyntax):
    """Calls `call_open HEAD call_sep JSON call_close` inside a section (see the module docstring)."""

    def __init__(self, machine, tools: Sequence[dict] | None) -> None:
        super().__init__(machine, tools)
        self._head = ""                 # SJ_HEAD / SJ_NAME text so far
        self._held = ("", "")           # V3's type word and separator, withheld until the name is known
        self._scan: JsonValueScanner | None = None
        self._lang = -1                 # SJ_PRE: how much of "json" followed the fence's backticks (-1: no backtick)
        self._has_args = False
        self._broken = False            # stray text around the arguments: the rest of the call is Malformed

    def handlers(self) -> dict[str, Handler]:
        return {SJ_HEAD: self._head_text, SJ_NAME: self._name_text, SJ_PRE: self._pre_text,
                SJ_ARGS: self._args_text, SJ_POST: self._post_text}

    def actions(self) -> dict[str, Action]:
        return {"call_open": self._do_call_open, "call_sep": self._do_call_sep, "call_close": self._do_call_close}

    def close(self, state: str, at_finish: bool) -> None:
        m = self.m
        if state in (SJ_HEAD, SJ_NAME):
            raw, self._held, self._head = "".join(self._held) + self._head, ("", ""), ""
            m.malformed(raw, "tool call cut short")
        elif state in (SJ_PRE, SJ_ARGS, SJ_POST):
            if m.call_open and not self._has_args and not at_finish:
                m.args("{}")
            m.end_call()

    # ------------------------------------------------------------------------------------------- heads
    def _head_end(self, head: str, sep: str) -> None:
        """The separator ended the head ``head`` (raw): start the call or move on (DeepSeek: the type word or V3.1's
        name)."""
        if head.strip() == _TYPE_WORD:
            self._held = (head, sep)
            self.m.state = SJ_NAME
        else:
            self._start(head, "", sep, head.strip())

    def _start(self, raw: str, before: str, after: str, name: str, call_id: str | None = None) -> None:
        """Start the call ``name``, found in ``raw`` (its bytes around the name Dropped with ``before`` and ``after``),
        then read its arguments; an empty name makes the call Malformed."""
        m = self.m
        at = raw.find(name) if name else -1
        if at < 0:
            m.malformed(before + raw + after, "empty tool name")
            m.state = BAD_CALL
            return
        m.drop(before + raw[:at], "tool call header")
        m.start_call(name, call_id)
        m.drop(raw[at + len(name):] + after, "tool call header")
        self._has_args, self._broken, self._lang = False, False, -1
        m.state = SJ_PRE

    # ------------------------------------------------------------------------------------------- text handlers
    def _head_text(self, s: str) -> int:
        self._head += s
        if len(self._head) > MAX_NAME:
            self._too_long()
        return len(s)

    def _too_long(self) -> None:
        raw, self._held, self._head = "".join(self._held) + self._head, ("", ""), ""
        self.m.malformed(raw, "tool call header too long")
        self.m.state = BAD_CALL

    def _name_text(self, s: str) -> int:
        i = s.find("\n")
        part = s if i < 0 else s[:i]
        if not self._head.strip():
            j = len(part) - len(part.lstrip(_WS))
            if j < len(part) and part[j] in "{[":
                # bare JSON right after `function<sep>`: V3.1's spelling of a tool named like the type word
                word, sep = self._held
                ws, self._held, self._head = self._head + part[:j], ("", ""), ""
                self._start(word, "", sep + ws, word.strip())
                return j
        self._head += part
        if len(self._head) > MAX_NAME:
            self._too_long()
            return len(s)
        if i < 0:
            return len(s)
        if not self._head.strip():
            self._head += "\n"          # newlines before the name
            return i + 1
        held, self._held = "".join(self._held), ("", "")
        raw, self._head = self._head, ""
        self._start(raw, held, "\n", raw.strip())
        return i + 1

    def _pre_text(self, s: str) -> int:
        m = self.m
        j, n = 0, len(s)
        while j < n:
            c = s[j]
            if c == "`":
                self._lang = 0
            elif c in _WS:
                self._lang = -1
            elif 0 <= self._lang < len(_LANG) and c == _LANG[self._lang]:
                self._lang += 1
            else:
                break
            j += 1
        m.drop(s[:j], "template fence")
        if j < n:
            if s[j] in "{[":
                self._scan = JsonValueScanner()
                m.state = SJ_ARGS
            else:
                self._broken = True
                m.state = SJ_POST
        return j

    def _args_text(self, s: str) -> int:
        end = self._scan.feed(s)
        self.m.args(s if end < 0 else s[:end])
        self._has_args = True
        if end < 0:
            return len(s)
        self.m.state = SJ_POST
        return end

    def _post_text(self, s: str) -> int:
        i = 0
        if not self._broken:
            n = len(s)
            while i < n and s[i] in _FENCE:
                i += 1
            self.m.drop(s[:i], "template fence")
            self._broken = i < n
        self.m.malformed(s[i:], "malformed tool arguments")        # from the first stray character to the closer
        return len(s)

    # ------------------------------------------------------------------------------------------- actions
    def _do_call_open(self, text: str) -> None:
        m = self.m
        if m.state != TOOL_PREAMBLE:
            m.close_body(at_finish=False)
        m.drop(text, "tool call open")
        self._head, self._held = "", ("", "")
        m.state = SJ_HEAD

    def _do_call_sep(self, text: str) -> None:
        head, self._head = self._head, ""
        self._head_end(head, text)

    def _do_call_close(self, text: str) -> None:
        m = self.m
        m.close_body(at_finish=False)
        m.drop(text, "tool call close")
        m.state = TOOL_PREAMBLE


class DeepSeekV3Syntax(SepJsonSyntax):
    tool_format = "deepseek_v3"
