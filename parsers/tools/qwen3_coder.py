"""Qwen3-Coder XML tool calls: `<function=NAME><parameter=KEY>VALUE</parameter></function>` inside `<tool_call>`.

Values are converted to JSON as they stream, typed by the tool's JSON schema (`parsers.xml_values.XmlValue`): a value
whose schema allows a string streams as a JSON string; others are written whole, with their key, at `</parameter>`.
A call cut by the end of the output keeps no close-tag markup in its values.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..profiles.base import BAD_CALL, FN_BODY, PARAM_KEY, PARAM_SKIP, PARAM_VALUE, TOOL_BETWEEN, TOOL_NAME
from ..xml_values import XmlValue, parameter_types
from .base import MAX_NAME, Action, Handler, ToolSyntax


class Qwen3CoderSyntax(ToolSyntax):
    tool_format = "qwen3_coder"
    start_actions = frozenset({"name_start"})

    def __init__(self, machine, tools: Sequence[dict] | None) -> None:
        super().__init__(machine, tools)
        self._types = parameter_types(tools)
        p = machine.profile
        self._value = XmlValue(machine, p.terminals["parameter_close"], newline=p.strip_value_newlines,
                               trim=p.strip_values, untyped=p.type_untyped_values)
        self._opener = ""                         # `<function=` / `<parameter=` text, withheld with the name
        self._name_buf = ""

    def handlers(self) -> dict[str, Handler]:
        m = self.m
        return {TOOL_NAME: self._name_text, FN_BODY: self._fn_body_text, PARAM_KEY: self._key_text,
                PARAM_VALUE: self._value_text, PARAM_SKIP: m.bad_text}

    def actions(self) -> dict[str, Action]:
        return {"name_start": self._do_name_start, "name_end": self._do_name_end, "cut_short": self._do_cut_short,
                "function_end": self._do_function_end, "key_start": self._do_key_start,
                "key_end": self._do_key_end, "value_end": self._do_value_end, "value_cut": self._do_value_cut,
                "skip_end": self._do_skip_end}

    def close(self, state: str, at_finish: bool) -> None:
        m = self.m
        if state == TOOL_NAME:
            name, self._name_buf = self._name_buf, ""
            m.malformed(self._opener + name, "tool call cut short")
        elif state in (FN_BODY, PARAM_KEY, PARAM_VALUE, PARAM_SKIP):
            cut = m.output_cut(at_finish)
            if state == PARAM_KEY:
                key, self._name_buf = self._name_buf, ""
                m.malformed(self._opener + key, "parameter cut short")
            elif state == PARAM_VALUE:
                self._value.close(cut)
            if not cut and m.call_open:
                m.args("}" if self._value.n_keys else "{}")
            m.end_call()

    # ------------------------------------------------------------------------------------------- text handlers
    def _fn_body_text(self, s: str) -> int:
        return self.m.structural_ws(s, "text between parameters")

    def _name_text(self, s: str) -> int:
        self._name_buf += s
        if len(self._name_buf) > MAX_NAME:
            self.m.malformed(self._opener + self._name_buf, "tool name too long")
            self.m.state = BAD_CALL
        return len(s)

    def _key_text(self, s: str) -> int:
        self._name_buf += s
        if len(self._name_buf) > MAX_NAME:
            self.m.malformed(self._opener + self._name_buf, "parameter name too long")
            self.m.state = PARAM_SKIP
        return len(s)

    def _value_text(self, s: str) -> int:
        self._value.text(s)
        return len(s)

    # ------------------------------------------------------------------------------------------- actions
    def _do_name_start(self, text: str) -> None:
        self._opener, self._name_buf = text, ""
        self.m.state = TOOL_NAME

    def _do_name_end(self, text: str) -> None:
        m = self.m
        name, self._name_buf = self._name_buf, ""
        if not name.strip():
            m.malformed(self._opener + name + text, "empty tool name")
            m.state = BAD_CALL
            return
        m.drop(self._opener, "function tag")
        m.start_call(name)
        m.drop(text, "function tag")
        self._value.n_keys = 0
        m.state = FN_BODY

    def _do_cut_short(self, text: str) -> None:
        m = self.m
        name, self._name_buf = self._name_buf, ""
        if m.state == TOOL_NAME:
            m.malformed(self._opener + name + text, "tag cuts the tool name short")
            m.state = BAD_CALL
            return
        m.malformed(self._opener + name, "tag cuts the parameter name short")
        m.state = FN_BODY
        rule = m.text_rule(FN_BODY, text)
        if rule is not None:
            m.apply(rule, text)
        else:
            m.malformed(text, "tag out of place")

    def _do_function_end(self, text: str) -> None:
        m = self.m
        m.args("}" if self._value.n_keys else "{}")
        m.end_call()
        m.drop(text, "function tag")
        m.state = TOOL_BETWEEN

    def _do_key_start(self, text: str) -> None:
        self._opener, self._name_buf = text, ""
        self.m.state = PARAM_KEY

    def _do_key_end(self, text: str) -> None:
        m = self.m
        key, self._name_buf = self._name_buf, ""
        if not key.strip():
            m.malformed(self._opener + key + text, "empty parameter name")
            m.state = PARAM_SKIP
            return
        m.drop(self._opener + key + text, "parameter tag")
        self._value.open(key, self._types.get(m.call_name, {}).get(key, ()))
        m.state = PARAM_VALUE

    def _do_value_end(self, text: str) -> None:
        self._value.close(at_finish=False)
        self.m.drop(text, "parameter tag")
        self.m.state = FN_BODY

    def _do_value_cut(self, text: str) -> None:
        """A parameter or function tag inside a value whose close tag is missing: the value ends there and the tag
        does what it does between parameters."""
        m = self.m
        self._value.close(at_finish=False)
        m.state = FN_BODY
        m.apply(m.text_rule(FN_BODY, text), text)

    def _do_skip_end(self, text: str) -> None:
        self.m.malformed(text, "malformed parameter")
        self.m.state = FN_BODY
