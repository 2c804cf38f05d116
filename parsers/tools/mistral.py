"""Mistral tool calls after `[TOOL_CALLS]`: the older JSON list `[{"name": .., "arguments": {..}, "id": ..}, ..]` and
the v11+ `NAME[ARGS]{json}` / `NAME[CALL_ID]ID[ARGS]{json}` (see `parsers.profiles.mistral`).

Which one follows is decided by the first non-whitespace character after `[TOOL_CALLS]`: `[` opens a list, whose
objects are read by the Hermes wrapper code (`HermesSyntax`, ``"arguments"`` passed through as the model's bytes; an
``"id"`` key is structure: the call has already streamed under the server's id when it arrives); `{` is one such
object without its list. Anything else is a name (OpenAI's name characters plus `.` and `:`, else the call is
Malformed), buffered (bounded by `MAX_NAME`) until `[ARGS]` or `[CALL_ID]`; an id written with `[CALL_ID]` becomes
the call's id. The arguments after `[ARGS]` stream through verbatim until their JSON value ends
(`parsers.json_stream.JsonValueScanner`). Stray text is Malformed (surfaced as content).
"""
from __future__ import annotations

import re
from collections.abc import Sequence

from ..json_stream import HermesWrapper, JsonValueScanner
from ..profiles.base import BAD_CALL, TOOL_BETWEEN, TOOL_JSON, TOOL_PREAMBLE
from ..profiles.mistral import M_ARGS, M_ID, M_LIST, M_NAME
from .base import MAX_NAME, Action, Handler
from .hermes import HermesSyntax

_WS = " \t\r\n"
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")      # a tool name (OpenAI's characters, plus `.` and `:`)


class MistralSyntax(HermesSyntax):
    tool_format = "mistral"

    def __init__(self, machine, tools: Sequence[dict] | None) -> None:
        super().__init__(machine, tools)
        self._in_list = False
        self._name = ""                  # M_NAME: raw name text so far
        self._held = ("", "")            # M_ID: the raw name and `[CALL_ID]`, withheld until `[ARGS]`
        self._id = ""                    # M_ID: raw id text so far
        self._scan: JsonValueScanner | None = None

    def handlers(self) -> dict[str, Handler]:
        return {TOOL_PREAMBLE: self._preamble_text, TOOL_JSON: self._object_text, M_LIST: self._list_text,
                M_NAME: self._name_text, M_ID: self._id_text, M_ARGS: self._args_text}

    def actions(self) -> dict[str, Action]:
        return {"m_args": self._do_args, "m_call_id": self._do_call_id}

    def call_id(self, generated: str) -> str:
        """Mistral's templates (and mistral_common) want 9 alphanumerics: the last 9 of the server's id, 0-padded."""
        return "".join(c for c in generated if c in _ALNUM)[-9:].rjust(9, "0")

    def close(self, state: str, at_finish: bool) -> None:
        m = self.m
        if state in (M_NAME, M_ID):
            m.malformed(self._take_raw(), "tool call cut short")
        elif state == M_ARGS:
            if m.call_open and self._scan is None and not at_finish:
                m.args("{}")
            m.end_call()
        elif state == TOOL_JSON:
            super().close(state, at_finish)
        self._in_list = False

    # ------------------------------------------------------------------------------------------- text handlers
    def _preamble_text(self, s: str) -> int:
        m = self.m
        i = len(s) - len(s.lstrip(_WS))
        m.drop(s[:i], "template whitespace")
        if i == len(s):
            return i
        if s[i] == "[":
            m.drop("[", "tool call list")
            self._in_list = True
            m.state = M_LIST
            return i + 1
        if s[i] == "{":                    # one object without its list, as some older models write it
            self._wrapper, self._pre, self._in_list = HermesWrapper(), [], False
            m.state = TOOL_JSON
            return i
        self._take_raw()
        m.state = M_NAME
        return i

    def _list_text(self, s: str) -> int:
        m = self.m
        i, n = 0, len(s)
        while i < n and s[i] in _WS + ",":
            i += 1
        m.drop(s[:i], "tool call list")
        if i == n:
            return n
        c = s[i]
        if c == "{":
            self._wrapper, self._pre = HermesWrapper(), []
            m.state = TOOL_JSON
            return i
        if c == "]":
            m.drop(c, "tool call list")
            self._in_list = False
            m.state = TOOL_BETWEEN
            return i + 1
        self._in_list = False
        m.state = BAD_CALL
        return i

    def _object_text(self, s: str) -> int:
        n = self._json_text(s)
        if self._in_list and self.m.state == TOOL_BETWEEN:
            self.m.state = M_LIST
        return n

    def _name_text(self, s: str) -> int:
        self._name += s
        if len(self._name) > MAX_NAME:
            self._too_long()
        return len(s)

    def _id_text(self, s: str) -> int:
        self._id += s
        if len(self._id) > MAX_NAME:
            self._too_long()
        return len(s)

    def _take_raw(self) -> str:
        raw = "".join(self._held) + self._name + self._id
        self._held, self._name, self._id = ("", ""), "", ""
        return raw

    def _too_long(self) -> None:
        self.m.malformed(self._take_raw(), "tool call header too long")
        self.m.state = BAD_CALL

    def _args_text(self, s: str) -> int:
        m = self.m
        i = 0
        if self._scan is None:
            i = len(s) - len(s.lstrip(_WS))
            m.drop(s[:i], "template whitespace")
            if i == len(s):
                return i
            if s[i] != "{":
                m.args("{}")
                m.end_call()
                m.state = BAD_CALL
                return i
            self._scan = JsonValueScanner()
        end = self._scan.feed(s, i)
        m.args(s[i:] if end < 0 else s[i:end])
        if end < 0:
            return len(s)
        m.end_call()
        m.state = TOOL_BETWEEN
        return end

    # ------------------------------------------------------------------------------------------- actions
    def _do_call_id(self, text: str) -> None:
        self._held, self._name, self._id = (self._name, text), "", ""
        self.m.state = M_ID

    def _do_args(self, text: str) -> None:
        m = self.m
        if m.state == M_ID:
            name_raw, after, call_id = self._held[0], self._held[1] + self._id + text, self._id.strip() or None
        else:
            name_raw, after, call_id = self._name, text, None
        self._take_raw()
        name = name_raw.strip()
        if not _NAME.fullmatch(name):
            m.malformed(name_raw + after, "not a tool name")
            m.state = BAD_CALL
            return
        at = name_raw.find(name)
        m.drop(name_raw[:at], "template whitespace")
        m.start_call(name, call_id)
        m.drop(name_raw[at + len(name):] + after, "tool call header")
        self._scan = None
        m.state = M_ARGS
