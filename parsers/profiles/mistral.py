"""Mistral tool calls (vLLM's `mistral`), both generations, after a `[TOOL_CALLS]` token:

* older models (Mistral 7B v0.3, Nemo, Small 3.1): a JSON list `[TOOL_CALLS] [{"name": "f", "arguments": {...},
  "id": "a1b2c3d4e"}, ...]` (the ``id`` is optional);
* tokenizers v11+ (Small 3.2, Devstral, Magistral, Ministral 3): `[TOOL_CALLS]NAME[ARGS]{json}` per call, with
  `[CALL_ID]ID` before `[ARGS]` where the model writes an id (Small 3.2).

Magistral / Ministral reasoning models open their thought themselves with `[THINK]` and end it with `[/THINK]`. The
reply starts after the last `[/INST]`; the turn ends with `</s>`. All markers are control tokens in Mistral's
vocabularies."""
from __future__ import annotations

from .base import (BAD_CALL, CONTENT, STATES, TOOL_BETWEEN, TOOL_JSON, TOOL_PREAMBLE, Profile, ReasoningSpec, Rule,
                   end_of_turn_rules, reasoning_rules)

M_LIST = "m_list"          # inside the `[...]` list, between call objects (each object is Hermes' TOOL_JSON)
M_NAME = "m_name"          # after `[TOOL_CALLS]`, the name up to `[ARGS]` or `[CALL_ID]`
M_ID = "m_id"              # after `[CALL_ID]`, the model's call id up to `[ARGS]`
M_ARGS = "m_args"          # after `[ARGS]`: the arguments JSON, passed through verbatim
M_STATES = (M_LIST, M_NAME, M_ID, M_ARGS)

TERMINALS = {
    "think_open": "[THINK]",
    "think_close": "[/THINK]",
    "tool_open": "[TOOL_CALLS]",
    "args": "[ARGS]",
    "call_id": "[CALL_ID]",
    "eot_eos": "</s>",
}

_RULES = {
    (CONTENT, "tool_open"): Rule("tool_open"),
    (TOOL_PREAMBLE, "args"): Rule("m_args"),
    (M_NAME, "args"): Rule("m_args"),
    (M_NAME, "call_id"): Rule("m_call_id"),
    (M_ID, "args"): Rule("m_args"),
    **{(s, "tool_open"): Rule("tool_open", id_only=s in (TOOL_JSON, M_ARGS))
       for s in (TOOL_PREAMBLE, TOOL_JSON, TOOL_BETWEEN, BAD_CALL, *M_STATES)},
}

PROFILE = Profile(
    name="mistral",
    reasoning=ReasoningSpec(open="[THINK]", close="[/THINK]", start_mode="prompt_tail"),
    tool_format="mistral",
    terminals=TERMINALS,
    token_id_terminals=frozenset(TERMINALS),
    generation_headers=("[/INST]",),
    end_of_turn=("</s>",),
    transitions={**reasoning_rules(tool_open_ends_reasoning=True), **_RULES,
                 **end_of_turn_rules(("eot_eos",), STATES + M_STATES)},
)
