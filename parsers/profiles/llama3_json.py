"""Llama 3.1 / 3.2 / 3.3 (and Llama 4) JSON tool calls (vLLM's `llama3_json`, `llama4_json`): `{"name": "f",
"parameters": {...}}` (or ``"arguments"``), either after `<|python_tag|>` (one token in Llama 3's vocabulary) or as a
bare JSON object at the very start of the reply; several calls are separated by `; `. A reply that starts with other
text is content. No reasoning; the turn ends with `<|eot_id|>` (or `<|eom_id|>` after a `<|python_tag|>` call; Llama 4:
`<|eot|>`, `<|eom|>`)."""
from __future__ import annotations

from .base import BAD_CALL, CONTENT, TOOL_BETWEEN, TOOL_JSON, TOOL_PREAMBLE, Profile, Rule, end_of_turn_rules

TERMINALS = {
    "tool_open": "<|python_tag|>",
    "eot_eot": "<|eot_id|>",
    "eot_eom": "<|eom_id|>",
    "eot_end": "<|end_of_text|>",
    "eot_eot4": "<|eot|>",
    "eot_eom4": "<|eom|>",
}
EOT = ("eot_eot", "eot_eom", "eot_end", "eot_eot4", "eot_eom4")
GENERATION_HEADERS = ("<|start_header_id|>assistant<|end_header_id|>\n\n",
                      "<|header_start|>assistant<|header_end|>\n\n")
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|eot|>", "<|eom|>")

PROFILE = Profile(
    name="llama3_json",
    reasoning=None,
    tool_format="llama3_json",
    terminals=TERMINALS,
    token_id_terminals=frozenset(TERMINALS),
    generation_headers=GENERATION_HEADERS,
    end_of_turn=END_OF_TURN,
    transitions={
        (CONTENT, "tool_open"): Rule("tool_open"),
        (TOOL_PREAMBLE, "tool_open"): Rule("tool_open"),
        (TOOL_JSON, "tool_open"): Rule("tool_open", id_only=True),
        (TOOL_BETWEEN, "tool_open"): Rule("tool_open"),
        (BAD_CALL, "tool_open"): Rule("tool_open"),
        **end_of_turn_rules(EOT),
    },
)
