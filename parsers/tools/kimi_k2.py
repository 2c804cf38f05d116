"""Kimi K2 tool calls: `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{args}<|tool_call_end|>`
inside `<|tool_calls_section_begin|>` .. `<|tool_calls_section_end|>`: DeepSeek's shape (`SepJsonSyntax`) with a head
that names the tool and is the call's id (`functions.get_weather:0`, as vLLM returns it)."""
from __future__ import annotations

from .deepseek_v3 import SepJsonSyntax

_PREFIX = "functions."


class KimiK2Syntax(SepJsonSyntax):
    """Calls' ids are unique within the reply: a head the reply already used (a model repeating `:0`) gets the index
    past the largest one so far, as the clients that match results to calls by id need."""
    tool_format = "kimi_k2"

    def __init__(self, machine, tools) -> None:
        super().__init__(machine, tools)
        self._ids: set[str] = set()
        self._next_index = 0

    def _head_end(self, head: str, sep: str) -> None:
        ident = head.strip()
        name = ident.removeprefix(_PREFIX)
        base, colon, index = name.rpartition(":")
        if colon and base and _is_index(index):
            name = base
        self._start(head, "", sep, name, self._unique(ident, name) if name != ident else None)

    def _unique(self, ident: str, name: str) -> str:
        if ident in self._ids:
            ident = f"{_PREFIX}{name}:{self._next_index}"
        self._ids.add(ident)
        index = ident.rpartition(":")[2]
        if _is_index(index):
            self._next_index = max(self._next_index, int(index) + 1)
        return ident


def _is_index(text: str) -> bool:
    return text.isascii() and text.isdigit()
