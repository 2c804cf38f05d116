"""Hermes / Qwen2.5: ChatML, `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>`, no reasoning."""
from __future__ import annotations

from .base import BAD_CALL, CONTENT, TOOL_BETWEEN, TOOL_JSON, TOOL_PREAMBLE, Profile, Rule, end_of_turn_rules

TERMINALS = {
    "tool_open": "<tool_call>",
    "tool_close": "</tool_call>",
    "eot_im_end": "<|im_end|>",
    "eot_endoftext": "<|endoftext|>",
}
EOT = ("eot_im_end", "eot_endoftext")


def json_tool_rules() -> dict:
    """Rules of the Hermes JSON tool call. The body ends when its JSON object closes; a closer inside the body counts
    only as a token ID, so `</tool_call>` spelled inside a JSON string is data."""
    return {
        (CONTENT, "tool_open"): Rule("tool_open"),
        (TOOL_PREAMBLE, "tool_close"): Rule("tool_close"),
        (TOOL_JSON, "tool_close"): Rule("tool_close", id_only=True),
        (TOOL_BETWEEN, "tool_close"): Rule("tool_close"),
        (TOOL_BETWEEN, "tool_open"): Rule("tool_open"),
        (BAD_CALL, "tool_close"): Rule("tool_close"),
    }


PROFILE = Profile(
    name="hermes",
    reasoning=None,
    tool_format="hermes",
    terminals=TERMINALS,
    token_id_terminals=frozenset(TERMINALS),
    generation_headers=("<|im_start|>assistant\n",),
    end_of_turn=("<|im_end|>", "<|endoftext|>"),
    transitions={**json_tool_rules(), **end_of_turn_rules(EOT)},
)
