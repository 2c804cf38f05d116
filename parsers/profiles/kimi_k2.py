"""Kimi K2 / K2-Thinking: tool calls `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{args}<|tool_call_end|>...<|tool_calls_section_end|>` (the shape of DeepSeek's, read by
the same `SepJsonSyntax`); `functions.NAME:IDX` is the call's id, as Kimi writes it. K2-Thinking opens its thought
itself with `<think>` after `<|im_assistant|>assistant<|im_middle|>`; the markers are single tokens in Kimi's
vocabulary."""
from __future__ import annotations

from .base import STATES, Profile, ReasoningSpec, end_of_turn_rules, reasoning_rules
from .deepseek_v3 import SJ_STATES, sep_json_rules

TERMINALS = {
    "think_open": "<think>",
    "think_close": "</think>",
    "tool_open": "<|tool_calls_section_begin|>",
    "call_open": "<|tool_call_begin|>",
    "call_sep": "<|tool_call_argument_begin|>",
    "call_close": "<|tool_call_end|>",
    "tool_close": "<|tool_calls_section_end|>",
    "eot_im_end": "<|im_end|>",
}

PROFILE = Profile(
    name="kimi_k2",
    reasoning=ReasoningSpec(open="<think>", close="</think>", start_mode="prompt_tail"),
    tool_format="kimi_k2",
    terminals=TERMINALS,
    token_id_terminals=frozenset(TERMINALS),
    generation_headers=("<|im_assistant|>assistant<|im_middle|>",),
    end_of_turn=("<|im_end|>",),
    transitions={**reasoning_rules(tool_open_ends_reasoning=True), **sep_json_rules(),
                 **end_of_turn_rules(("eot_im_end",), STATES + SJ_STATES)},
)
