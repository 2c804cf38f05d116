"""Qwen3-Coder / Qwen3.5: ChatML, optional `<think>`, XML tool calls
`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>` whose values are typed by
the tool's JSON schema. `<tool_call>`/`</tool_call>` are single tokens; the XML tags are text."""
from __future__ import annotations

from .base import (BAD_CALL, CONTENT, FN_BODY, PARAM_KEY, PARAM_SKIP, PARAM_VALUE, TOOL_BETWEEN, TOOL_NAME,
                   TOOL_PREAMBLE, Profile, ReasoningSpec, Rule, end_of_turn_rules, reasoning_rules)
from .hermes import EOT

TERMINALS = {
    "think_open": "<think>",
    "think_close": "</think>",
    "tool_open": "<tool_call>",
    "tool_close": "</tool_call>",
    "function_open": "<function=",
    "function_close": "</function>",
    "parameter_open": "<parameter=",
    "parameter_close": "</parameter>",
    "tag_end": ">",
    "eot_im_end": "<|im_end|>",
    "eot_endoftext": "<|endoftext|>",
}

XML_TOOL_RULES = {
    (CONTENT, "tool_open"): Rule("tool_open"),
    (TOOL_PREAMBLE, "function_open"): Rule("name_start"),
    (TOOL_PREAMBLE, "tool_close"): Rule("tool_close"),
    (TOOL_NAME, "tag_end"): Rule("name_end"),
    (TOOL_NAME, "function_close"): Rule("cut_short"),
    (TOOL_NAME, "parameter_open"): Rule("cut_short"),
    (TOOL_NAME, "parameter_close"): Rule("cut_short"),
    (TOOL_NAME, "tool_close"): Rule("tool_close"),
    (FN_BODY, "parameter_open"): Rule("key_start"),
    (FN_BODY, "function_close"): Rule("function_end"),
    (FN_BODY, "tool_close"): Rule("tool_close"),
    (PARAM_KEY, "tag_end"): Rule("key_end"),
    (PARAM_KEY, "parameter_close"): Rule("cut_short"),
    (PARAM_KEY, "parameter_open"): Rule("cut_short"),
    (PARAM_KEY, "function_close"): Rule("cut_short"),
    (PARAM_KEY, "tool_close"): Rule("tool_close"),
    (PARAM_VALUE, "parameter_close"): Rule("value_end"),
    (PARAM_VALUE, "tool_close"): Rule("tool_close"),
    (PARAM_SKIP, "parameter_close"): Rule("skip_end"),
    (PARAM_SKIP, "tool_close"): Rule("tool_close"),
    (TOOL_BETWEEN, "tool_close"): Rule("tool_close"),
    (TOOL_BETWEEN, "tool_open"): Rule("tool_open"),
    (TOOL_BETWEEN, "function_open"): Rule("name_start"),
    (BAD_CALL, "tool_close"): Rule("tool_close"),
}

PROFILE = Profile(
    name="qwen3_coder",
    reasoning=ReasoningSpec(open="<think>", close="</think>", start_mode="prompt_tail"),
    tool_format="qwen3_coder",
    terminals=TERMINALS,
    token_id_terminals=frozenset({"think_open", "think_close", "tool_open", "tool_close", *EOT}),
    generation_headers=("<|im_start|>assistant\n",),
    end_of_turn=("<|im_end|>", "<|endoftext|>"),
    transitions={**reasoning_rules(tool_open_ends_reasoning=True), **XML_TOOL_RULES, **end_of_turn_rules(EOT)},
    strip_value_newlines=True,
)
