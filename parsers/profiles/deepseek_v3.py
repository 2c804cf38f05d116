"""DeepSeek-V3 / R1-0528 / V3.1 tool calls, one syntax for both spellings of a call:

V3 and R1-0528 write
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{args}\n```<｜tool▁call▁end｜>`
(a type word, then the name and fenced JSON); V3.1 writes `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}<｜tool▁call▁end｜>`
(the name before the separator, bare JSON). Calls follow each other until `<｜tool▁calls▁end｜>`. Reasoning is
`<think>`/`</think>` (V3.1 thinking mode, R1-0528); the prompt tail decides where the reply starts (V3.1's template
ends with `<think>` or `</think>`, V3's with neither: the answer). All tool markers are single tokens in DeepSeek-V3's
vocabulary; `<think>`/`</think>` are not (matched on text there).
"""
from __future__ import annotations

from .base import (BAD_CALL, CONTENT, STATES, TOOL_PREAMBLE, Profile, ReasoningSpec, Rule, end_of_turn_rules,
                   reasoning_rules)

SJ_HEAD = "sj_head"        # after the call opener, before the separator: the type word (V3) or the name (V3.1)
SJ_NAME = "sj_name"        # V3: after `function<｜tool▁sep｜>`, the name up to its newline
SJ_PRE = "sj_pre"          # before the arguments JSON: whitespace and V3's "```json" fence
SJ_ARGS = "sj_args"        # the arguments JSON, passed through verbatim
SJ_POST = "sj_post"        # after the JSON, before the call closer: whitespace and V3's closing fence
SJ_STATES = (SJ_HEAD, SJ_NAME, SJ_PRE, SJ_ARGS, SJ_POST)

TERMINALS = {
    "think_open": "<think>",
    "think_close": "</think>",
    "tool_open": "<｜tool▁calls▁begin｜>",
    "call_open": "<｜tool▁call▁begin｜>",
    "call_sep": "<｜tool▁sep｜>",
    "call_close": "<｜tool▁call▁end｜>",
    "tool_close": "<｜tool▁calls▁end｜>",
    "eot_eos": "<｜end▁of▁sentence｜>",
}


def sep_json_rules() -> dict[tuple[str, str], Rule]:
    """Rules of a section of calls `tool_open (call_open HEAD call_sep JSON call_close)* tool_close` (DeepSeek, Kimi
    K2). Inside the JSON the markers count only as token IDs, so their spelling inside a string is data."""
    rules = {
        (CONTENT, "tool_open"): Rule("tool_open"),
        (TOOL_PREAMBLE, "call_open"): Rule("call_open"),
        (TOOL_PREAMBLE, "tool_close"): Rule("tool_close"),
        (SJ_HEAD, "call_sep"): Rule("call_sep"),
    }
    for s in (*SJ_STATES, BAD_CALL):
        id_only = s == SJ_ARGS
        rules[(s, "call_close")] = Rule("call_close", id_only=id_only)
        rules[(s, "call_open")] = Rule("call_open", id_only=id_only)
        rules[(s, "tool_close")] = Rule("tool_close", id_only=id_only)
    return rules


PROFILE = Profile(
    name="deepseek_v3",
    reasoning=ReasoningSpec(open="<think>", close="</think>", start_mode="prompt_tail"),
    tool_format="deepseek_v3",
    terminals=TERMINALS,
    token_id_terminals=frozenset(TERMINALS),
    generation_headers=("<｜Assistant｜>",),
    end_of_turn=("<｜end▁of▁sentence｜>",),
    transitions={**reasoning_rules(tool_open_ends_reasoning=True), **sep_json_rules(),
                 **end_of_turn_rules(("eot_eos",), STATES + SJ_STATES)},
)
