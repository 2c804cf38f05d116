"""Pythonic tool calls (vLLM's `pythonic`; Llama 3.2 / Llama 4 / Gemma 3 templates that ask for them): the reply is a
Python list of calls with literal keyword arguments, `[get_weather(city="Paris"), f(a=[1, 2], b={"k": None})]`, at the
very start of the reply, wrapped in Llama 4's `<|python_start|>` ... `<|python_end|>`, or after Llama 3's
`<|python_tag|>`. A reply that starts with other
text is content. No reasoning."""
from __future__ import annotations

from .base import BAD_CALL, CONTENT, STATES, TOOL_BETWEEN, TOOL_PREAMBLE, Profile, Rule, end_of_turn_rules

P_HEAD = "p_head"          # `[` and a call's name up to its `(` (withheld: at the reply's start it may be content)
P_ARGS = "p_args"          # a call's keyword arguments up to its `)`, converted to JSON as they stream
P_AFTER = "p_after"        # after a call's `)`: `,` and the next call, or the list's `]`
P_STATES = (P_HEAD, P_ARGS, P_AFTER)

TERMINALS = {
    "tool_open": "<|python_start|>",
    "tool_open_tag": "<|python_tag|>",
    "tool_close": "<|python_end|>",
    "eot_eot_id": "<|eot_id|>",
    "eot_eom_id": "<|eom_id|>",
    "eot_end_of_text": "<|end_of_text|>",
    "eot_eot": "<|eot|>",
    "eot_eom": "<|eom|>",
    "eot_end_of_turn": "<end_of_turn>",
}
EOT = ("eot_eot_id", "eot_eom_id", "eot_end_of_text", "eot_eot", "eot_eom", "eot_end_of_turn")

PROFILE = Profile(
    name="pythonic",
    reasoning=None,
    tool_format="pythonic",
    terminals=TERMINALS,
    token_id_terminals=frozenset(TERMINALS),
    generation_headers=("<|start_header_id|>assistant<|end_header_id|>\n\n",
                        "<|header_start|>assistant<|header_end|>\n\n", "<start_of_turn>model\n"),
    end_of_turn=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|eot|>", "<|eom|>", "<end_of_turn>"),
    transitions={
        (CONTENT, "tool_open"): Rule("tool_open"),
        (CONTENT, "tool_open_tag"): Rule("tool_open"),
        **{(s, "tool_close"): Rule("tool_close", id_only=s == P_ARGS)
           for s in (TOOL_PREAMBLE, TOOL_BETWEEN, BAD_CALL, *P_STATES)},
        **end_of_turn_rules(EOT, STATES + P_STATES),
    },
)
