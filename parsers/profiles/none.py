"""No reasoning, no tools: every byte is content."""
from __future__ import annotations

from .base import Profile

PROFILE = Profile(
    name="none",
    reasoning=None,
    tool_format=None,
    terminals={},
    token_id_terminals=frozenset(),
    generation_headers=(),
    end_of_turn=(),
    transitions={},
    hold_boundary_whitespace=False,
)
