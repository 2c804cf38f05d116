"""GLM-4.5 / 4.6 / 4.7 tool calls: `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>`.

The name runs from `<tool_call>` to its newline (or straight to the first `<arg_key>` or `</tool_call>`, as GLM-4.7
writes it), buffered up to `MAX_NAME`. Arguments become one JSON object as they stream, each value typed by the tool's
JSON schema (`parsers.xml_values.XmlValue`), whitespace around it stripped: a value whose schema allows a string
streams as a JSON string, others (and one of no declared type, read as JSON or a Python literal, else a string) are
written whole, with their key, at `</arg_value>`; a call cut by the end of the output keeps no close-tag markup in its
values. Whitespace between tags is Dropped, other stray text Malformed.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..profiles.base import BAD_CALL, TOOL_PREAMBLE
from ..profiles.glm45 import GLM_BODY, GLM_KEY, GLM_KEYED, GLM_VALUE
from ..xml_values import XmlValue, parameter_types
from .base import MAX_NAME, Action, Handler, ToolSyntax


class Glm45Syntax(ToolSyntax):
    tool_format = "glm45"

    def __init__(self, machine, tools: Sequence[dict] | None) -> None:
        super().__init__(machine, tools)
        self._types = parameter_types(tools)
        self._buf = ""                   # the name (TOOL_PREAMBLE) or an argument's key (GLM_KEY) so far
        self._opener = ""                # `<arg_key>`, withheld with the key
        self._key = ""
        p = machine.profile
        self._value = XmlValue(machine, p.terminals["value_close"], trim=p.strip_values,
                               untyped=p.type_untyped_values)

    def handlers(self) -> dict[str, Handler]:
        m = self.m
        return {TOOL_PREAMBLE: self._name_text, GLM_BODY: self._ws_text, GLM_KEYED: self._ws_text,
                GLM_KEY: self._key_text, GLM_VALUE: self._value_text, BAD_CALL: m.bad_text}

    def actions(self) -> dict[str, Action]:
        return {"glm_key_open": self._do_key_open, "glm_key_close": self._do_key_close,
                "glm_value_open": self._do_value_open, "glm_value_close": self._do_value_close}

    def close(self, state: str, at_finish: bool) -> None:
        m = self.m
        if state == TOOL_PREAMBLE:
            if not self._buf.strip():
                m.drop(self._buf, "template whitespace")
                self._buf = ""
            elif at_finish:
                m.malformed(self._buf, "tool call cut short")
                self._buf = ""
            elif self._start(""):              # `<tool_call>NAME</tool_call>`: a call without arguments
                m.args("{}")
                m.end_call()
            return
        if state not in (GLM_BODY, GLM_KEY, GLM_KEYED, GLM_VALUE):
            return
        cut = m.output_cut(at_finish)
        if state == GLM_KEY:
            key, self._buf = self._buf, ""
            m.malformed(self._opener + key, "argument cut short")
        elif state == GLM_VALUE:
            self._value.close(cut)
        if not cut and m.call_open:
            m.args("}" if self._value.n_keys else "{}")
        m.end_call()

    def _start(self, after: str) -> bool:
        """Start the call named by the buffered name (its surrounding whitespace and ``after`` Dropped); an empty
        name is Malformed (then False)."""
        m = self.m
        raw, self._buf = self._buf, ""
        name = raw.strip()
        if not name:
            m.malformed(raw + after, "empty tool name")
            m.state = BAD_CALL
            return False
        at = raw.find(name)
        m.drop(raw[:at], "template whitespace")
        m.start_call(name)
        m.drop(raw[at + len(name):] + after, "template whitespace")
        self._value.n_keys = 0
        m.state = GLM_BODY
        return True

    # ------------------------------------------------------------------------------------------- text handlers
    def _name_text(self, s: str) -> int:
        i = s.find("\n")
        self._buf += s if i < 0 else s[:i]
        if len(self._buf) > MAX_NAME:
            self.m.malformed(self._buf, "tool name too long")
            self._buf = ""
            self.m.state = BAD_CALL
            return len(s)
        if i < 0:
            return len(s)
        if not self._buf.strip():
            self._buf += "\n"            # newlines before the name
            return i + 1
        self._start("\n")
        return i + 1

    def _ws_text(self, s: str) -> int:
        return self.m.structural_ws(s, "text between arguments")

    def _key_text(self, s: str) -> int:
        self._buf += s
        if len(self._buf) > MAX_NAME:
            self.m.malformed(self._opener + self._buf, "argument name too long")
            self._buf = ""
            self.m.state = BAD_CALL
        return len(s)

    def _value_text(self, s: str) -> int:
        self._value.text(s)
        return len(s)

    # ------------------------------------------------------------------------------------------- actions
    def _do_key_open(self, text: str) -> None:
        m = self.m
        if m.state == TOOL_PREAMBLE and not self._start(""):
            m.malformed(text, "empty tool name")
            return
        self._opener, self._buf = text, ""
        m.bad_run = False
        m.state = GLM_KEY

    def _do_key_close(self, text: str) -> None:
        m = self.m
        raw, self._buf = self._buf, ""
        self._key = raw.strip()
        m.drop(self._opener + raw + text, "argument tag")
        m.state = GLM_KEYED

    def _do_value_open(self, text: str) -> None:
        m = self.m
        m.drop(text, "argument tag")
        self._value.open(self._key, self._types.get(m.call_name, {}).get(self._key, ()))
        m.state = GLM_VALUE

    def _do_value_close(self, text: str) -> None:
        self._value.close(at_finish=False)
        self.m.drop(text, "argument tag")
        self.m.state = GLM_BODY
