"""Kimi K2 tool calls: `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{args}<|tool_call_end|>`
inside `<|tool_calls_section_begin|>` .. `<|tool_calls_section_end|>`: DeepSeek's shape (`SepJsonSyntax`) with a head
that names the tool and is the call's id (`functions.get_weather:0`, as vLLM returns it)."""
from __future__ import annotations

from .deepseek_v3 import SepJsonSyntax

_PREFIX = "functions."


class KimiK2Syntax(SepJsonSyntax):
    tool_format = "kimi_k2"

    def _head_end(self, head: str, sep: str) -> None:
        ident = head.strip()
        name = ident.removeprefix(_PREFIX)
        base, colon, index = name.rpartition(":")
        if colon and base and index.isascii() and index.isdigit():
            name = base
        self._start(head, "", sep, name, ident if name != ident else None)
