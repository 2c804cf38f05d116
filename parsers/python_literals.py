"""Streaming conversion of a Python call's keyword arguments (`a=1, b="x", c=[1, (2, 3)], d={"k": None})`) into the
JSON object of its arguments, for pythonic tool calls.

A character-level state machine, fed from just after the call's `(`: literals only (str with its escapes, in any
quoting Python reads: `'`, `"`, triple quotes, `r`/`u` prefixes, adjacent literals joined; int, float with Python's
number syntax, True/False/None, list, tuple as a list, dict), never `eval`/`ast`. Strings stream out as they arrive
(a string's closing `"` waits for the next character that is not another literal joining it); a number or name is
buffered (bounded by `MAX_SCALAR`) until the character after it; a dict key is buffered (bounded) until its `:`. A
key and its separator go out together with the first fragment of their value, so what has been sent is always a JSON
prefix that `closers` can complete. Work is linear in the text fed.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

__all__ = ["PythonArgs", "MAX_SCALAR", "JSON_NUMBER"]

MAX_SCALAR = 512
"""A number, name, keyword or dict key longer than this is an error (bounds what is buffered)."""

_WS = " \t\r\n"
_SCALAR = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.+-")
_IDENT_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_NAMES = {"True": "true", "False": "false", "None": "null", "true": "true", "false": "false", "null": "null"}
_CLOSER = {"args": ")", "list": "]", "tuple": ")", "dict": "}"}
_JSON_CLOSER = {"args": "}", "list": "]", "tuple": "]", "dict": "}"}
_STRING_STOP = {"'": re.compile(r"['\\]"), '"': re.compile(r'["\\]')}
_SIMPLE_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t",
                   "v": "\v", "\n": ""}
_HEX_LEN = {"x": 2, "u": 4, "U": 8}
_OCTAL = frozenset("01234567")
_HEX = frozenset("0123456789abcdefABCDEF")
_QUOTES = "\"'"
_STR_PREFIXES = {"r": True, "R": True, "u": False, "U": False}      # prefix -> raw
_STRING_MODES = ("open", "string", "escape", "joined", "prefix")


@dataclass
class _Frame:
    kind: str                 # "args" | "list" | "tuple" | "dict"
    state: str    # args: key0 key eq value after; list/tuple: value0 after; dict: key0 keyval colon value after
    count: int = 0            # values written
    key: str = ""             # JSON text of the key of the next value (args, dict)


JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
"""A JSON (RFC 8259) number, whole."""


def _number(text: str) -> str | None:
    """JSON text of the Python int or float literal ``text`` (sign allowed), or None: `0123` is no literal, as in
    Python (never read as 123 or 123.0). A float past a double's range (`1e400`, which a strict tool's number
    grammar allows) is its text where that is a JSON number, as the JSON-argument families write it."""
    t = text.replace("_", "")
    try:
        return json.dumps(int(t, 0))
    except ValueError:
        pass
    if not any(c in t for c in ".eE") or t.lstrip("+-")[:2].lower() in ("0x", "0o", "0b"):
        return None
    try:
        v = float(t)
    except ValueError:
        return None
    if math.isfinite(v):
        return json.dumps(v)
    return text if JSON_NUMBER.fullmatch(text) else None


def _past_whitespace(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _json_chars(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)[1:-1]


class PythonArgs:
    """The keyword arguments of one call, fed from just after its `(`; see the module docstring.

    ``feed(s)`` returns (how much of ``s`` it consumed, JSON text): it consumes less than all only when the call's
    `)` came (``done``) or the text broke the syntax (``error`` names why; ``pending_raw`` is the buffered source that
    was not converted, to surface with the rest). The JSON text starts after the object's `{`, which the caller
    writes."""

    def __init__(self) -> None:
        self._frames = [_Frame("args", "key0")]
        self._mode = ""     # "" (structure) | "scalar" | "ident" | a string mode: "open" (its quote(s) seen, one
        # or triple still unknown), "string", "escape", "joined" (a literal ended, another may join it), "prefix"
        self._quote = ""
        self._triple = False
        self._raw = False
        self._quotes = 0                # quotes read at an "open" (1-2), or inside a triple-quoted string (1-2)
        self._buf = ""                  # scalar, keyword or escape being read
        self._capture: list[str] | None = None    # a dict key being read, as JSON text
        self._captured = 0
        self._out: list[str] = []
        self.done = False
        self.error: str | None = None

    @property
    def pending_raw(self) -> str:
        return self._buf

    def closers(self) -> str:
        """JSON text that completes what was written (for a call that broke or was closed early)."""
        tail = '"' if self._mode in _STRING_MODES and self._capture is None else ""
        return tail + "".join(_JSON_CLOSER[f.kind] for f in reversed(self._frames))

    def end(self) -> str:
        """JSON text that completes the arguments where the text ended inside them, as a `)` there would: a number
        or name being read is converted where it is a whole literal (else it stays in ``pending_raw``, with
        ``error`` set), then `closers`."""
        self._out = []
        if self._mode == "scalar":
            self._end_scalar()
        elif self._mode == "string" and self._quotes:
            self._emit(_json_chars(self._quote * self._quotes))
            self._quotes = 0
        return "".join(self._out) + self.closers()

    def feed(self, s: str) -> tuple[int, str]:
        self._out = []
        i, n = 0, len(s)
        while i < n and not self.done and self.error is None:
            mode = self._mode
            if mode == "string":
                i = self._string(s, i)
            elif mode == "escape":
                i = self._escape(s, i)
            elif mode == "open":
                i = self._open(s[i], i)
            elif mode == "joined":
                i = self._joined(s, i)
            elif mode == "prefix":
                if s[i] not in _QUOTES:
                    self.error = f"unexpected {s[i]!r} in tool call arguments"
                    break
                self._part(s[i], _STR_PREFIXES[self._buf])
                i += 1
            elif mode in ("scalar", "ident"):
                j = i
                while j < n and s[j] in _SCALAR:
                    j += 1
                self._buf += s[i:j]
                i = j
                if len(self._buf) > MAX_SCALAR:
                    self.error = "literal too long"
                elif i < n and mode == "scalar" and s[i] in _QUOTES and self._buf in _STR_PREFIXES:
                    self._emit(self._begin() + '"')
                    self._part(s[i], _STR_PREFIXES[self._buf])
                    i += 1
                elif i < n:
                    self._end_scalar()
            else:
                i = self._structure(s, i)
        return i, "".join(self._out)

    # ------------------------------------------------------------------------------------------------ internals
    def _emit(self, text: str) -> None:
        if self._capture is not None:
            self._capture.append(text)
            self._captured += len(text)
            if self._captured > MAX_SCALAR:
                self.error = "dict key too long"
        else:
            self._out.append(text)

    def _begin(self) -> str:
        """The separator and key that go before a new value of the top frame."""
        f = self._frames[-1]
        if f.state == "keyval":
            return ""
        prefix = ", " if f.count else ""
        if f.kind in ("args", "dict"):
            prefix += f.key + ": "
        f.count += 1
        return prefix

    def _value_done(self) -> None:
        f = self._frames[-1]
        if f.state == "keyval":
            key, self._capture, self._captured = "".join(self._capture or ()), None, 0
            f.key = key if key.startswith('"') else json.dumps(key)
            f.state = "colon"
        else:
            f.state = "after"

    def _end_scalar(self) -> None:
        text, mode = self._buf, self._mode
        self._mode, self._buf = "", ""
        if mode == "ident":
            self._frames[-1].key = json.dumps(text)
            self._frames[-1].state = "eq"
            return
        value = _NAMES.get(text) or _number(text)
        if value is None:
            self._buf = text
            self.error = f"not a literal: {text!r}"
            return
        self._emit(self._begin() + value)
        self._value_done()

    def _part(self, quote: str, raw: bool) -> None:
        """A string literal (or one more joined to it) opens with ``quote``."""
        self._mode, self._quote, self._raw, self._triple, self._quotes, self._buf = "open", quote, raw, False, 1, ""

    def _open(self, c: str, i: int) -> int:
        """After a literal's opening quote(s): a third quote makes it triple-quoted, two then another character are an
        empty literal."""
        if c == self._quote:
            if self._quotes == 1:
                self._quotes = 2
            else:
                self._mode, self._triple, self._quotes = "string", True, 0
            return i + 1
        self._mode = "joined" if self._quotes == 2 else "string"
        self._quotes = 0
        return i

    def _string(self, s: str, i: int) -> int:
        quote = self._quote
        if self._quotes:                                    # triple-quoted: quotes that may end it
            if s[i] == quote:
                self._quotes += 1
                if self._quotes == 3:
                    self._mode, self._quotes = "joined", 0
                return i + 1
            self._emit(_json_chars(quote * self._quotes))
            self._quotes = 0
        m = _STRING_STOP[quote].search(s, i)
        j = m.start() if m else len(s)
        if j > i:
            self._emit(_json_chars(s[i:j]))
        if m is None:
            return j
        if s[j] == "\\":
            self._mode, self._buf = "escape", ""
        elif self._triple:
            self._quotes = 1
        else:
            self._mode = "joined"
        return j + 1

    def _joined(self, s: str, i: int) -> int:
        """After a string literal: whitespace, then another literal joining it, or the string ends."""
        c = s[i]
        if c in _WS:
            return _past_whitespace(s, i)
        if c in _QUOTES:
            self._part(c, False)
            return i + 1
        if c in _STR_PREFIXES:
            self._mode, self._buf = "prefix", c
            return i + 1
        self._emit('"')
        self._mode = ""
        self._value_done()
        return i

    def _escape(self, s: str, i: int) -> int:
        buf = self._buf
        if self._raw:                                       # a raw string keeps the backslash and what follows it
            self._emit(_json_chars("\\" + s[i]))
            self._mode = "string"
            return i + 1
        if not buf:
            c = s[i]
            if c in _SIMPLE_ESCAPES:
                self._emit(_json_chars(_SIMPLE_ESCAPES[c]))
                self._mode = "string"
                return i + 1
            if c in _OCTAL or c in _HEX_LEN:
                self._buf = c
                return i + 1
            self._emit(_json_chars("\\" + c))           # an unknown escape keeps its backslash, as in Python
            self._mode = "string"
            return i + 1
        c = s[i]
        if buf[0] in _OCTAL:
            if c in _OCTAL and len(buf) < 3:
                self._buf = buf = buf + c
                i += 1
                if len(buf) < 3:
                    return i
            self._emit(json.dumps(chr(int(buf, 8)))[1:-1])
            self._mode, self._buf = "string", ""
            return i
        if c not in _HEX:
            self.error = "bad escape"
            return i
        self._buf = buf = buf + c
        if len(buf) - 1 == _HEX_LEN[buf[0]]:
            code = int(buf[1:], 16)
            if code > 0x10FFFF:
                self.error = "bad escape"
                return i
            self._emit(json.dumps(chr(code))[1:-1])
            self._mode, self._buf = "string", ""
        return i + 1

    def _structure(self, s: str, i: int) -> int:
        c = s[i]
        if c in _WS:
            return _past_whitespace(s, i)
        f = self._frames[-1]
        st = f.state
        if st in ("key0", "value0") and c == _CLOSER[f.kind]:
            return self._pop(i)
        if st == "after":
            if c == ",":
                f.state = "value0" if f.kind in ("list", "tuple") else "key0"
                return i + 1
            if c == _CLOSER[f.kind]:
                return self._pop(i)
            self.error = f"unexpected {c!r} in tool call arguments"
            return i
        if st == "eq" or st == "colon":
            if c == ("=" if st == "eq" else ":"):
                f.state = "value"
                return i + 1
            self.error = f"unexpected {c!r} in tool call arguments"
            return i
        if f.kind == "args" and st == "key0":
            if c in _IDENT_START:
                self._mode, self._buf = "ident", ""
                f.state = "key"
                return i
            self.error = "positional argument" if c not in ",=" else f"unexpected {c!r} in tool call arguments"
            return i
        if f.kind == "dict" and st == "key0":
            f.state = "keyval"
            self._capture, self._captured = [], 0
            st = "keyval"
        if c in _QUOTES:
            self._emit(self._begin() + '"')
            self._part(c, False)
            return i + 1
        if c in _SCALAR:
            self._mode, self._buf = "scalar", ""
            return i
        if c in "[({" and st != "keyval":
            kind = {"[": "list", "(": "tuple", "{": "dict"}[c]
            self._emit(self._begin() + ("{" if kind == "dict" else "["))
            self._frames.append(_Frame(kind, "key0" if kind == "dict" else "value0"))
            return i + 1
        self.error = f"unexpected {c!r} in tool call arguments"
        return i

    def _pop(self, i: int) -> int:
        f = self._frames.pop()
        self._emit(_JSON_CLOSER[f.kind])
        if not self._frames:
            self.done = True
        else:
            self._value_done()
        return i + 1
