"""Tool-call syntaxes, one module each, behind `parsers.tools.base.ToolSyntax`; `syntax_for(tool_format)` finds one.

To add a syntax: a module here with a `ToolSyntax` subclass, its profile under `parsers/profiles/`, and one entry in
`SYNTAXES` below (see docs/parsers.md, "How to add a tool syntax").
"""
from __future__ import annotations

from .base import ToolSyntax
from .deepseek_v3 import DeepSeekV3Syntax
from .glm45 import Glm45Syntax
from .harmony import HarmonySyntax
from .kimi_k2 import KimiK2Syntax
from .llama3_json import Llama3JsonSyntax
from .mistral import MistralSyntax
from .pythonic import PythonicSyntax
from .hermes import HermesSyntax
from .qwen3_coder import Qwen3CoderSyntax

__all__ = ["ToolSyntax", "SYNTAXES", "syntax_for"]

SYNTAXES: dict[str, type[ToolSyntax]] = {s.tool_format: s for s in (
    HermesSyntax,
    Qwen3CoderSyntax,
    HarmonySyntax,
    DeepSeekV3Syntax,
    Glm45Syntax,
    KimiK2Syntax,
    Llama3JsonSyntax,
    MistralSyntax,
    PythonicSyntax,
)}


def syntax_for(tool_format: str | None) -> type[ToolSyntax] | None:
    """The syntax class of a profile's ``tool_format`` (None for no tool syntax); ValueError for an unknown one."""
    if tool_format is None:
        return None
    try:
        return SYNTAXES[tool_format]
    except KeyError:
        raise ValueError(f"unknown tool syntax {tool_format!r}; known: {', '.join(SYNTAXES)}") from None
