"""Pythonic tool calls: `[f(a=1, b="x"), g(c=[1, 2])]` (see `parsers.profiles.pythonic`), converted to JSON arguments
as they stream (`parsers.python_literals.PythonArgs`: a character-level scanner, nothing is re-parsed).

At the reply's start (only whitespace before it) a `[` may open the list: the `[`, the name and its `(` are withheld
(bounded by `MAX_NAME`) until the `(` proves a call, else they are content and the whole reply stays content. After
`<|python_start|>` the list is expected, and text that breaks it is Malformed. Once a call's name is out, a break
in its arguments closes their JSON (so they stay valid) and the rest of the reply is Malformed. Arguments left open
where the model ended its turn (or its `<|python_end|>` came) are closed as a `)` there would close them; a call cut by
a length limit or a stop string keeps the JSON prefix it streamed.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..profiles.base import BAD_CALL, CONTENT, TOOL_BETWEEN, TOOL_PREAMBLE, Rule
from ..profiles.pythonic import P_AFTER, P_ARGS, P_HEAD
from ..python_literals import PythonArgs
from .base import MAX_NAME, WHITESPACE, Handler, ToolSyntax

_WS = WHITESPACE
_NAME = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")
_OPEN = Rule("tool_open")


class PythonicSyntax(ToolSyntax):
    tool_format = "pythonic"

    def __init__(self, machine, tools: Sequence[dict] | None) -> None:
        super().__init__(machine, tools)
        self._bare = False            # the list opened without `<|python_start|>` (a broken head is content)
        self._first = True            # the head still expects the list's `[`
        self._head = ""               # raw head text withheld
        self._name = ""
        self._name_done = False
        self._args: PythonArgs | None = None

    def handlers(self) -> dict[str, Handler]:
        return {CONTENT: self._content_text, TOOL_PREAMBLE: self._preamble_text, P_HEAD: self._head_text,
                P_ARGS: self._args_text, P_AFTER: self._after_text}

    def close(self, state: str, at_finish: bool) -> None:
        m = self.m
        if state == P_HEAD:
            self._release_head("tool call cut short")
        elif state == P_ARGS:
            conv = self._args
            if m.output_cut(at_finish):
                m.drop(conv.pending_raw, "tool call cut short")
            else:
                m.args(conv.end())
                m.malformed(conv.pending_raw, "malformed tool call")
            m.end_call()

    # ------------------------------------------------------------------------------------------- text handlers
    def _content_text(self, s: str) -> int:
        return self.bare_start_text(s, "[", lambda: self._new_head(bare=True))

    def _preamble_text(self, s: str) -> int:
        m = self.m
        i = len(s) - len(s.lstrip(_WS))
        m.drop(s[:i], "template whitespace")
        if i == len(s):
            return i
        self.at_reply_start = False
        if s[i] == "[":
            self._new_head(bare=False)
            return i
        m.state = BAD_CALL
        return i

    def _new_head(self, bare: bool) -> None:
        self._bare, self._first = bare, True
        self._head, self._name, self._name_done = "", "", False
        self.m.state = P_HEAD

    def _head_text(self, s: str) -> int:
        i, n = 0, len(s)
        while i < n:
            c = s[i]
            if self._first:
                if c != "[":
                    return self._broken_head(i)
                self._first = False
            elif c in _WS:
                self._name_done = bool(self._name)
            elif c in _NAME and not self._name_done:
                self._name += c
            elif c == "(" and self._name:
                self._start(self._head + c)
                return i + 1
            else:
                return self._broken_head(i)
            self._head += c
            i += 1
            if len(self._head) > MAX_NAME:
                return self._broken_head(i)
        return n

    def _broken_head(self, i: int) -> int:
        if not self._release_head("malformed tool call"):
            self.m.state = BAD_CALL
        return i

    def _release_head(self, reason: str) -> bool:
        """The withheld call head, when it cannot become a call: the reply's content where a bare call never
        started (True), else Malformed for ``reason``."""
        m = self.m
        head, self._head = self._head, ""
        if self._bare and m.n_calls == 0:
            m.state = CONTENT
            if head:
                m.content_text(head)
            return True
        m.malformed(head, reason)
        return False

    def _start(self, raw: str) -> None:
        m = self.m
        if self._bare and m.n_calls == 0:
            m.state = CONTENT
            m.apply(_OPEN, "")                    # drops the held whitespace
        name, self._head = self._name, ""
        at = raw.find(name)
        m.drop(raw[:at], "tool call list")
        m.start_call(name)
        m.drop(raw[at + len(name):], "tool call header")
        m.args("{")
        self._args = PythonArgs()
        m.state = P_ARGS

    def _args_text(self, s: str) -> int:
        m = self.m
        conv = self._args
        n, text = conv.feed(s)
        m.args(text)
        if conv.error is not None:
            m.args(conv.closers())
            m.end_call()
            m.malformed(conv.pending_raw + s[n:], "malformed tool call")     # the reason BAD_CALL goes on with
            m.state = BAD_CALL
            return len(s)
        if conv.done:
            m.end_call()
            m.state = P_AFTER
        return n

    def _after_text(self, s: str) -> int:
        m = self.m
        i, n = 0, len(s)
        while i < n and s[i] in _WS:
            i += 1
        m.drop(s[:i], "template whitespace")
        if i == n:
            return n
        if s[i] == ",":
            m.drop(",", "tool call separator")
            self._head, self._name, self._name_done, self._first = "", "", False, False
            m.state = P_HEAD
            return i + 1
        if s[i] == "]":
            m.drop("]", "tool call list")
            m.state = TOOL_BETWEEN
            return i + 1
        m.state = BAD_CALL
        return i
