"""DeepSeek-R1 (and its Distill models, V3.1 in thinking mode): the template opens the thought, `</think>` ends it.

In the DeepSeek-V3 vocabulary `<think>`/`</think>` are not single tokens, so they are matched as text there. Tool
calls in DeepSeek's own `<｜tool▁calls▁begin｜>` syntax are not parsed (content)."""
from __future__ import annotations

from .base import Profile, ReasoningSpec, end_of_turn_rules, reasoning_rules

TERMINALS = {
    "think_open": "<think>",
    "think_close": "</think>",
    "eot_eos": "<｜end▁of▁sentence｜>",
}

PROFILE = Profile(
    name="deepseek_r1",
    reasoning=ReasoningSpec(open="<think>", close="</think>", start_mode="always"),
    tool_format=None,
    terminals=TERMINALS,
    token_id_terminals=frozenset(TERMINALS),
    generation_headers=("<｜Assistant｜>",),
    end_of_turn=("<｜end▁of▁sentence｜>",),
    transitions={**reasoning_rules(tool_open_ends_reasoning=False), **end_of_turn_rules(("eot_eos",))},
)
