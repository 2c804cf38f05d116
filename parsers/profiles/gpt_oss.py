"""gpt-oss harmony: `<|channel|>analysis<|message|>..<|end|><|start|>assistant<|channel|>final<|message|>..<|return|>`.

analysis -> reasoning, final -> content, commentary with `to=functions.X` -> a tool call whose body is the arguments
JSON verbatim (ended by `<|call|>`), commentary without a recipient -> content. Headers (role, channel, recipient,
`<|constrain|>json`) are Dropped. The generation prompt ends with `<|start|>assistant`, so the reply begins inside a
header; a continued message (`...<|channel|>final<|message|>Hello`) begins in its body. Reasoning lives in the channel
structure, so ``reasoning`` is None: `parsers.initial` reads the prompt's harmony tail and the harmony syntax picks
its start state from that (`parsers.tools.harmony`).
"""
from __future__ import annotations

from .base import (H_ANALYSIS, H_BETWEEN, H_FINAL, H_HEADER, H_TOOL, Profile, Rule)

TERMINALS = {
    "start": "<|start|>",
    "channel": "<|channel|>",
    "constrain": "<|constrain|>",
    "message": "<|message|>",
    "end": "<|end|>",
    "call": "<|call|>",
    "return": "<|return|>",
    "eot_endoftext": "<|endoftext|>",
}

_BODIES = (H_ANALYSIS, H_FINAL, H_TOOL)
RULES: dict = {
    (H_HEADER, "channel"): Rule("header_part"),
    (H_HEADER, "constrain"): Rule("header_part"),
    (H_HEADER, "message"): Rule("header_end"),
    (H_HEADER, "start"): Rule("header_start"),
    (H_BETWEEN, "start"): Rule("header_start"),
    (H_BETWEEN, "channel"): Rule("header_start_channel"),
}
for _s in _BODIES:
    RULES[(_s, "end")] = Rule("message_end")
    RULES[(_s, "call")] = Rule("message_end")
    RULES[(_s, "return")] = Rule("message_end")
    RULES[(_s, "start")] = Rule("header_start")          # a missing <|end|>
    RULES[(_s, "channel")] = Rule("header_start_channel")  # a missing <|end|><|start|>assistant
for _s in (H_HEADER, H_BETWEEN, *_BODIES):
    RULES[(_s, "eot_endoftext")] = Rule("end_of_turn", id_only=True)
for _t in ("end", "call", "return"):
    RULES[(H_BETWEEN, _t)] = Rule("end_of_turn", id_only=True)
    RULES[(H_HEADER, _t)] = Rule("message_end", id_only=True)  # the header it cuts short is content before it

PROFILE = Profile(
    name="gpt_oss",
    reasoning=None,
    tool_format="harmony",
    terminals=TERMINALS,
    token_id_terminals=frozenset(TERMINALS),
    generation_headers=("<|start|>assistant",),
    end_of_turn=("<|return|>", "<|call|>", "<|endoftext|>"),
    transitions=RULES,
    hold_boundary_whitespace=False,
)
