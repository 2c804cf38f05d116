"""The data a model-family profile is made of; `parsers.machine.ParserMachine` interprets it, with the tool syntax
(`parsers.tools`) that ``Profile.tool_format`` names."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

# Machine states named by profiles' transition tables.
REASONING = "reasoning"
CONTENT = "content"
TOOL_PREAMBLE = "tool_preamble"      # after the tool-call opener, before the body
TOOL_JSON = "tool_json"              # Hermes: inside the {"name": .., "arguments": ..} wrapper
TOOL_BETWEEN = "tool_between"        # a call's body is complete, its closer is expected
TOOL_NAME = "tool_name"              # Qwen3-Coder: after `<function=`, before `>`
FN_BODY = "fn_body"                  # Qwen3-Coder: between parameters
PARAM_KEY = "param_key"              # Qwen3-Coder: after `<parameter=`, before `>`
PARAM_VALUE = "param_value"          # Qwen3-Coder: a parameter's value
PARAM_SKIP = "param_skip"            # Qwen3-Coder: a malformed parameter, Malformed until `</parameter>`
BAD_CALL = "bad_call"                # a call that broke early: Malformed until its closer
H_HEADER = "h_header"                # harmony: message header (role, channel, recipient, constrain)
H_ANALYSIS = "h_analysis"            # harmony: analysis channel body (reasoning)
H_FINAL = "h_final"                  # harmony: final (or plain commentary) body (content)
H_TOOL = "h_tool"                    # harmony: commentary body addressed to functions.X (arguments)
H_BETWEEN = "h_between"              # harmony: after `<|end|>`, before the next `<|start|>`

STATES = (REASONING, CONTENT, TOOL_PREAMBLE, TOOL_JSON, TOOL_BETWEEN, TOOL_NAME, FN_BODY, PARAM_KEY, PARAM_VALUE,
          PARAM_SKIP, BAD_CALL, H_HEADER, H_ANALYSIS, H_FINAL, H_TOOL, H_BETWEEN)


@dataclass(frozen=True)
class ReasoningSpec:
    """How a family delimits its thought."""

    open: str | None          # "<think>" (None when only a close exists)
    close: str                # "</think>"
    start_mode: Literal["prompt_tail", "always", "never"]   # used when the prompt tail says nothing
    absorb_duplicate_close: bool = True   # a second close after an explicit open..close in this output is Dropped
    in_content: bool = False  # the thought stays in the content, tags and all (vLLM's minimax_m2_append_think)


@dataclass(frozen=True)
class Rule:
    """What a terminal does in a state: a named machine action.

    ``id_only``: the rule applies only when the terminal arrived as its single token ID, never to its spelling (used
    where prose lookalikes must stay text, e.g. `<tool_call>` written inside a thought).
    """

    action: str
    id_only: bool = False


@dataclass(frozen=True)
class Profile:
    """One model family's output syntax, as data."""

    name: str
    reasoning: ReasoningSpec | None
    tool_format: str | None                    # a key of `parsers.tools.SYNTAXES` ("hermes", ...), None: no tool calls
    terminals: Mapping[str, str]               # terminal name -> literal text
    token_id_terminals: frozenset[str]         # names of terminals that must be single tokens (demoted to text if not)
    generation_headers: tuple[str, ...]        # prompt text that starts the reply
    end_of_turn: tuple[str, ...]               # generated specials that end the turn and are Dropped
    transitions: Mapping[tuple[str, str], Rule] = field(default_factory=dict)   # (state, terminal name) -> rule
    hold_boundary_whitespace: bool = True      # A.6: whitespace-only content next to a tool call is Dropped
    strip_value_newlines: bool = False         # Qwen3-Coder: one "\n" after `<parameter=K>` and before `</parameter>`
    strip_values: bool = False                 # MiniMax-M2, GLM: whitespace around a parameter value is Dropped
    type_untyped_values: bool = False          # GLM: a value of no declared type is read as JSON or a Python literal
    calls_share_block: bool = False            # MiniMax-M2: the calls of one reply go in one tool-call block

    def terminal_names_in(self, state: str) -> tuple[str, ...]:
        """Names of the terminals that have a rule in ``state``."""
        return tuple(t for (s, t) in self.transitions if s == state)


def reasoning_rules(tool_open_ends_reasoning: bool) -> dict[tuple[str, str], Rule]:
    """Rules of the `<think>`/`</think>` pair shared by the think-tag families (design A.5, A.15)."""
    rules = {
        (REASONING, "think_open"): Rule("absorb_open"),
        (REASONING, "think_close"): Rule("reasoning_end"),
        (CONTENT, "think_open"): Rule("think_open"),
        (CONTENT, "think_close"): Rule("content_close"),
    }
    if tool_open_ends_reasoning:
        rules[(REASONING, "tool_open")] = Rule("tool_open", id_only=True)
    return rules


def end_of_turn_rules(names: tuple[str, ...], states: tuple[str, ...] = STATES) -> dict[tuple[str, str], Rule]:
    """End-of-turn specials are Dropped wherever they appear, by token ID only."""
    return {(s, n): Rule("end_of_turn", id_only=True) for s in states for n in names}
