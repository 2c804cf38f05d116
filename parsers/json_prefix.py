"""How much of a streamed text keeps it a prefix of one valid JSON object (RFC 8259).

A client that parses streamed tool arguments as they arrive (the `anthropic` SDK parses each `input_json_delta`
prefix) fails on the first character that no valid object can continue with. `JsonObjectPrefix` accepts text
piece by piece and says how much of each piece may be passed on; work is proportional to the text fed.
"""
from __future__ import annotations

import re

_WS = " \t\r\n"
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrtu'
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# Number states: which characters may follow, and whether the number may end there.
_NUMBER_NEXT = {
    "sign": {"0": "zero", **dict.fromkeys("123456789", "int")},
    "zero": {".": "dot", "e": "exp", "E": "exp"},
    "int": {**dict.fromkeys(_DIGITS, "int"), ".": "dot", "e": "exp", "E": "exp"},
    "dot": dict.fromkeys(_DIGITS, "frac"),
    "frac": {**dict.fromkeys(_DIGITS, "frac"), "e": "exp", "E": "exp"},
    "exp": {"+": "exp_sign", "-": "exp_sign", **dict.fromkeys(_DIGITS, "exp_digits")},
    "exp_sign": dict.fromkeys(_DIGITS, "exp_digits"),
    "exp_digits": dict.fromkeys(_DIGITS, "exp_digits"),
}
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp_digits"})


class JsonObjectPrefix:
    """Feeds one JSON object's text (whitespace around it allowed) and accepts the longest prefix of each piece
    that keeps everything accepted so far a prefix of a valid object; after the first character that breaks it,
    nothing more is accepted (`broken`)."""

    def __init__(self) -> None:
        self._state = "start"
        self._stack: list[str] = []  # "{" or "[" per open container
        self._rest = ""              # the characters a literal still needs, or hex digits of a \u escape left
        self.broken = False

    def feed(self, text: str) -> int:
        """How many leading characters of ``text`` were accepted (all of them unless it broke here or before)."""
        if self.broken:
            return 0
        i, n = 0, len(text)
        while i < n:
            step = self._step(text, i)
            if step < 0:
                self.broken = True
                return i
            i = step
        return n

    def _step(self, s: str, i: int) -> int:
        """Consume from ``s[i]``; the index after what was consumed, or -1 where ``s[i]`` breaks the object."""
        st, c = self._state, s[i]
        if st == "string" or st == "key":
            m = _STRING_STOP.search(s, i)
            if m is None:
                return len(s)
            c = m.group()
            if c == "\\":
                self._state = st + "_escape"
            elif c == '"':
                self._state = "colon" if st == "key" else "after_value"
            else:  # a raw control character: the text before it stands
                return m.start() if m.start() > i else -1
            return m.end()
        if st.endswith("_escape"):
            if c not in _ESCAPES:
                return -1
            self._state, self._rest = (st[:-7] + "_hex", "xxxx") if c == "u" else (st[:-7], "")
            return i + 1
        if st.endswith("_hex"):
            if c not in _HEX:
                return -1
            self._rest = self._rest[1:]
            if not self._rest:
                self._state = st[:-4]
            return i + 1
        if st == "literal":
            if c != self._rest[0]:
                return -1
            self._rest = self._rest[1:]
            if not self._rest:
                self._state = "after_value"
            return i + 1
        if st in _NUMBER_NEXT:
            following = _NUMBER_NEXT[st].get(c)
            if following is not None:
                self._state = following
                return i + 1
            if st not in _NUMBER_ENDS:
                return -1
            self._state = "after_value"
            return i  # the character after a number is read as what follows a value
        if c in _WS:
            return i + 1
        if st == "start":
            return self._open(c, i) if c == "{" else -1
        if st == "done":
            return -1
        if st == "key_or_end" and c == "}" or st == "value_or_end" and c == "]":
            return self._close(i)
        if st in ("key_or_end", "key_start"):
            if c != '"':
                return -1
            self._state = "key"
            return i + 1
        if st == "colon":
            if c != ":":
                return -1
            self._state = "value"
            return i + 1
        if st in ("value", "value_or_end"):
            return self._value(c, i)
        # after_value
        top = self._stack[-1]
        if c == ",":
            self._state = "key_start" if top == "{" else "value"
            return i + 1
        if c == ("}" if top == "{" else "]"):
            return self._close(i)
        return -1

    def _value(self, c: str, i: int) -> int:
        if c in "{[":
            return self._open(c, i)
        if c == '"':
            self._state = "string"
        elif c in _LITERALS:
            self._state, self._rest = "literal", _LITERALS[c]
        elif c == "-":
            self._state = "sign"
        elif c in _DIGITS:
            self._state = "zero" if c == "0" else "int"
        else:
            return -1
        return i + 1

    def _open(self, c: str, i: int) -> int:
        self._stack.append(c)
        self._state = "key_or_end" if c == "{" else "value_or_end"
        return i + 1

    def _close(self, i: int) -> int:
        self._stack.pop()
        self._state = "after_value" if self._stack else "done"
        return i + 1
