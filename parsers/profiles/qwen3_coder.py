"""Qwen3-Coder / Qwen3.5: ChatML, optional `<think>`, XML tool calls
`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>` whose values are typed by
the tool's JSON schema. `<tool_call>`/`</tool_call>` are single tokens; the XML tags are text."""
from __future__ import annotations

from .base import (BAD_CALL, CONTENT, FN_BODY, PARAM_KEY, PARAM_SKIP, PARAM_VALUE, TOOL_BETWEEN, TOOL_NAME,
                   TOOL_PREAMBLE, Profile, ReasoningSpec, Rule, end_of_turn_rules, reasoning_rules)

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
    (PARAM_VALUE, "parameter_open"): Rule("value_cut"),  # a value the model left open ends at the next tag, as
    (PARAM_VALUE, "function_close"): Rule("value_cut"),  # vLLM's parameter pattern reads it
    (PARAM_VALUE, "tool_close"): Rule("tool_close"),
    (PARAM_SKIP, "parameter_close"): Rule("skip_end"),
    (PARAM_SKIP, "tool_close"): Rule("tool_close"),
    (TOOL_BETWEEN, "tool_close"): Rule("tool_close"),
    (TOOL_BETWEEN, "tool_open"): Rule("tool_open"),
    (TOOL_BETWEEN, "function_open"): Rule("name_start"),
    (BAD_CALL, "tool_close"): Rule("tool_close"),
}



def xml_tool_profile(name: str, terminals: dict[str, str], generation_header: str, **options: bool) -> Profile:
    """A family that thinks in ``think_open`` .. ``think_close`` (the prompt's tail says where the reply starts) and
    writes Qwen3-Coder's XML calls spelled by ``terminals`` (its tags, and its end-of-turn specials under ``eot_*``
    names); a tool-call opener inside the thought ends it. ``options``: `Profile`'s flags (value padding, shared
    blocks)."""
    eot = tuple(n for n in terminals if n.startswith("eot_"))
    return Profile(
        name=name,
        reasoning=ReasoningSpec(open=terminals["think_open"], close=terminals["think_close"],
                                start_mode="prompt_tail"),
        tool_format="qwen3_coder",
        terminals=terminals,
        token_id_terminals=frozenset({"think_open", "think_close", "tool_open", "tool_close", *eot}),
        generation_headers=(generation_header,),
        end_of_turn=tuple(terminals[n] for n in eot),
        transitions={**reasoning_rules(tool_open_ends_reasoning=True), **XML_TOOL_RULES, **end_of_turn_rules(eot)},
        **options,
    )


PROFILE = xml_tool_profile("qwen3_coder", TERMINALS, "<|im_start|>assistant\n", strip_value_newlines=True)
