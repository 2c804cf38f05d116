"""GLM-4.5 / 4.6 / 4.7: `<think>..</think>` reasoning and tool calls
`<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>` (4.7 writes them without the
newlines), values stripped and typed by the tool's JSON schema as Qwen3-Coder's (one of no declared type read as
JSON or a Python literal, as vLLM's glm4_moe parser reads it). Every tag is a single token in GLM's vocabulary.
The reply starts after `<|assistant|>`; GLM-4.5/4.6 open their thought themselves (`\n<think>`), GLM-4.7's template
opens it, and thinking off renders an empty `<think></think>`: the prompt tail decides."""
from __future__ import annotations

from .base import (BAD_CALL, CONTENT, STATES, TOOL_PREAMBLE, Profile, ReasoningSpec, Rule, end_of_turn_rules,
                   reasoning_rules)

GLM_BODY = "glm_body"        # between arguments (after the name's newline or an `</arg_value>`)
GLM_KEY = "glm_key"          # after `<arg_key>`: the argument's name
GLM_KEYED = "glm_keyed"      # after `</arg_key>`, before `<arg_value>`
GLM_VALUE = "glm_value"      # after `<arg_value>`: the value
GLM_STATES = (GLM_BODY, GLM_KEY, GLM_KEYED, GLM_VALUE)
# TOOL_PREAMBLE (after `<tool_call>`) holds the tool's name.

TERMINALS = {
    "think_open": "<think>",
    "think_close": "</think>",
    "tool_open": "<tool_call>",
    "tool_close": "</tool_call>",
    "key_open": "<arg_key>",
    "key_close": "</arg_key>",
    "value_open": "<arg_value>",
    "value_close": "</arg_value>",
    "eot_user": "<|user|>",
    "eot_observation": "<|observation|>",
    "eot_endoftext": "<|endoftext|>",
}
EOT = ("eot_user", "eot_observation", "eot_endoftext")

RULES = {
    (CONTENT, "tool_open"): Rule("tool_open"),
    (TOOL_PREAMBLE, "key_open"): Rule("glm_key_open"),
    (GLM_BODY, "key_open"): Rule("glm_key_open"),
    (GLM_KEY, "key_close"): Rule("glm_key_close"),
    (GLM_KEYED, "value_open"): Rule("glm_value_open"),
    (GLM_VALUE, "value_close"): Rule("glm_value_close"),
}
for _s in (TOOL_PREAMBLE, *GLM_STATES, BAD_CALL):
    RULES[(_s, "tool_close")] = Rule("tool_close")
    RULES[(_s, "tool_open")] = Rule("tool_open")          # a missing `</tool_call>`

PROFILE = Profile(
    name="glm45",
    reasoning=ReasoningSpec(open="<think>", close="</think>", start_mode="prompt_tail"),
    tool_format="glm45",
    terminals=TERMINALS,
    token_id_terminals=frozenset(TERMINALS),
    generation_headers=("<|assistant|>",),
    end_of_turn=("<|user|>", "<|observation|>", "<|endoftext|>"),
    transitions={**reasoning_rules(tool_open_ends_reasoning=True), **RULES,
                 **end_of_turn_rules(EOT, STATES + GLM_STATES)},
    strip_values=True,
    type_untyped_values=True,
)
