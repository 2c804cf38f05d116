"""Incremental JSON scanning for tool-call bodies: where a JSON value ends, and the Hermes wrapper
`{"name": .., "arguments": ..}` split into its parts. Work is proportional to the text fed; nothing is re-scanned."""
from __future__ import annotations

import json
import re

_WS = " \t\r\n"
_IN_STRING = re.compile(r'["\\]')
_SCALAR_END = re.compile(r'[\s,}\]]')


class JsonValueScanner:
    """Follows one JSON value (object, array, string or scalar) from its first character and says where it ends.

    Only structure is tracked (depth, strings, escapes), not validity: the bytes pass through untouched."""

    def __init__(self) -> None:
        self._kind: str | None = None      # "container" | "string" | "scalar"
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, s: str, i: int = 0) -> int:
        """Scan ``s[i:]``; the index just past the value's end, or -1 when the value goes on past ``s``.

        A scalar ends before the character that ends it (that character is not part of the value)."""
        n = len(s)
        if self._kind is None:
            if i >= n:
                return -1
            c = s[i]
            if c in "{[":
                self._kind, self._depth = "container", 1
                i += 1
            elif c == '"':
                self._kind, self._in_string = "string", True
                i += 1
            else:
                self._kind = "scalar"
        if self._kind == "scalar":
            m = _SCALAR_END.search(s, i)
            return m.start() if m else -1
        depth, in_string, escape = self._depth, self._in_string, self._escape
        end = -1
        while i < n:
            if in_string:
                if escape:
                    escape = False
                    i += 1
                    continue
                m = _IN_STRING.search(s, i)
                if m is None:
                    i = n
                    break
                i = m.end()
                if m.group() == "\\":
                    escape = True
                    continue
                in_string = False
                if self._kind == "string":
                    end = i
                    break
                continue
            c = s[i]
            i += 1
            if c == '"':
                in_string = True
            elif c == "{" or c == "[":
                depth += 1
            elif c == "}" or c == "]":
                depth -= 1
                if depth == 0:
                    end = i
                    break
        self._depth, self._in_string, self._escape = depth, in_string, escape
        return end


def _decode_string(raw: str) -> str:
    try:
        return json.loads('"' + raw + '"')
    except ValueError:
        return raw


class HermesWrapper:
    """The Hermes tool-call object `{"name": "X", "arguments": {...}}`, fed from its opening `{`.

    ``feed`` returns how much of the text it consumed (less than all once the object closed or broke) and the pieces:
    ("drop", text) for structure, ("name", decoded_name) when the name string is complete (its quotes are "drop"),
    ("args", text) for the arguments value's own bytes, verbatim. ``done`` when the object closed; ``error`` names
    the first character that broke the syntax (the rest of the call is the caller's to report)."""

    _ARG_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self._state = "open"
        self._raw = ""               # key or name string being read, raw
        self._escape = False
        self._key = ""
        self._target = "skip"
        self._value: JsonValueScanner | None = None
        self.has_name = False
        self.has_args = False
        self.done = False
        self.error: str | None = None

    @property
    def pending_raw(self) -> str:
        """A key or name string being read, as its raw characters so far (not yet in any piece)."""
        return self._raw

    def feed(self, s: str) -> tuple[int, list[tuple[str, str]]]:
        out: list[tuple[str, str]] = []
        i, n = 0, len(s)
        while i < n and not self.done and self.error is None:
            st = self._state
            if st == "value":
                end = self._value.feed(s, i)
                stop = n if end < 0 else end
                if stop > i:
                    out.append(("args" if self._target == "args" else "drop", s[i:stop]))
                i = stop
                if end >= 0:
                    self._state = "after_value"
                continue
            if st in ("key", "name"):
                j = i
                while j < n:
                    c = s[j]
                    if self._escape:
                        self._escape = False
                    elif c == "\\":
                        self._escape = True
                    elif c == '"':
                        break
                    j += 1
                self._raw += s[i:j]
                if j == n:
                    i = n
                    continue
                if st == "key":
                    out.append(("drop", self._raw + '"'))
                    self._key = _decode_string(self._raw)
                    self._state = "colon"
                else:
                    out.append(("name", _decode_string(self._raw)))
                    out.append(("drop", '"'))
                    self.has_name = True
                    self._state = "after_value"
                self._raw = ""
                i = j + 1
                continue
            c = s[i]
            if c in _WS:
                j = i + 1
                while j < n and s[j] in _WS:
                    j += 1
                out.append(("drop", s[i:j]))
                i = j
                continue
            if st == "open" and c == "{":
                self._state = "key_or_end"
            elif st in ("key_or_end", "key_start") and c == '"':
                self._state = "key"
            elif st in ("key_or_end", "after_value") and c == "}":
                self.done = True
            elif st == "colon" and c == ":":
                self._state = "value_start"
            elif st == "after_value" and c == ",":
                self._state = "key_start"
            elif st == "value_start":
                if self._key == "name" and not self.has_name and c == '"':
                    self._state = "name"
                    out.append(("drop", c))
                    i += 1
                    continue
                if self._key in self._ARG_KEYS and not self.has_args:
                    self._target = "args"
                    self.has_args = True
                else:
                    self._target = "skip"
                self._value = JsonValueScanner()
                self._state = "value"
                continue
            else:
                self.error = f"unexpected {c!r} in tool call JSON"
                break
            out.append(("drop", c))
            i += 1
        return i, out
