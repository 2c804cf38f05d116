"""Qwen3 / Qwen3 Thinking-2507 / QwQ: ChatML, `<think>..</think>`, Hermes JSON `<tool_call>`."""
from __future__ import annotations

from .base import Profile, ReasoningSpec, end_of_turn_rules, reasoning_rules
from .hermes import EOT, json_tool_rules

TERMINALS = {
    "think_open": "<think>",
    "think_close": "</think>",
    "tool_open": "<tool_call>",
    "tool_close": "</tool_call>",
    "eot_im_end": "<|im_end|>",
    "eot_endoftext": "<|endoftext|>",
}

PROFILE = Profile(
    name="qwen3",
    reasoning=ReasoningSpec(open="<think>", close="</think>", start_mode="prompt_tail"),
    tool_format="hermes",
    terminals=TERMINALS,
    token_id_terminals=frozenset(TERMINALS),
    generation_headers=("<|im_start|>assistant\n",),
    end_of_turn=("<|im_end|>", "<|endoftext|>"),
    transitions={**reasoning_rules(tool_open_ends_reasoning=True), **json_tool_rules(), **end_of_turn_rules(EOT)},
)
