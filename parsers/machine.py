"""The driver that interprets every model-family profile: generated tokens in, events out.

`ParserMachine` is a pure synchronous state machine. Terminals that resolved to a single token count only as that
token (the same characters spelled by other tokens are ordinary text of the current channel); the other terminals are
matched on text with a holdback bounded by the longest terminal, and only in states that have a rule for them. The
driver owns that gating, the pending partial-tag buffer, reasoning vs content, whitespace held next to tool calls and
end of turn; the states of a call's body belong to the profile's tool syntax (`parsers.tools`: Hermes JSON,
Qwen3-Coder XML, harmony), which scans incrementally, so per-token work never depends on the length of the output.
"""
from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from .events import (ContentDelta, Dropped, Event, Malformed, ReasoningDelta, ToolCallArguments, ToolCallEnd,
                     ToolCallStart)
from .profiles.base import BAD_CALL, CONTENT, REASONING, TOOL_BETWEEN, TOOL_PREAMBLE, Profile, Rule
from .tools import syntax_for
from .tools.base import Action, Handler

if TYPE_CHECKING:
    from .initial import InitialState

_WS = " \t\r\n"
_NOT_WS = re.compile(r"[^ \t\r\n]")
_TOOL_START = "tool_open"


def _default_call_id(index: int) -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ParserMachine:
    """Reasoning, content and tool calls of one choice, from its generated tokens.

    ``delimiter_ids``: terminal text -> its single token ID, for the profile's token-ID terminals that resolved to one
    token (the others are matched as text). ``initial``: where the reply starts (`InitialState.REASONING` or
    `.CONTENT`, from the prompt tail). ``tools``: the request's OpenAI-style tools (Qwen3-Coder values are typed by
    their JSON schemas). ``call_id(index)`` names tool calls. ``parse_tools=False`` (tool_choice none, no tools) leaves
    tool markup as text of the channel it appears in; so does a profile without a tool syntax (``tool_format`` None).

    The public attributes and methods below ``state`` are the helpers a `parsers.tools.base.ToolSyntax` uses.
    """

    def __init__(self, profile: Profile, delimiter_ids: Mapping[str, int], initial: "InitialState",
                 tools: Sequence[dict] | None = None, call_id: Callable[[int], str] | None = None,
                 *, parse_tools: bool = True) -> None:
        p = self.profile = profile
        self.initial = initial            # read by a syntax that decides the start state itself (harmony)
        self.parse_tools = parse_tools    # read by syntaxes whose calls start without an opener (bare JSON, harmony)
        syntax_cls = syntax_for(p.tool_format)
        self.syntax = syntax = syntax_cls(self, tools) if syntax_cls is not None else None
        actions: dict[str, Action] = {
            "absorb_open": self._do_absorb_open, "reasoning_end": self._do_reasoning_end,
            "think_open": self._do_think_open, "content_close": self._do_content_close,
            "end_of_turn": self._do_end_of_turn, "tool_open": self._do_tool_open, "tool_close": self._do_tool_close}
        self._handlers: dict[str, Handler] = {
            REASONING: self.reasoning_text, CONTENT: self.content_text, TOOL_PREAMBLE: self.preamble_text,
            TOOL_BETWEEN: self.between_text, BAD_CALL: self.bad_text}
        self._channels = {REASONING: "reasoning", CONTENT: "content"}
        self._thought_kept = p.reasoning is not None and p.reasoning.in_content
        if self._thought_kept:
            self._handlers[REASONING] = self.content_text
            self._channels[REASONING] = "content"
        skip = set()
        if syntax is not None:
            actions.update(syntax.actions())
            self._handlers.update(syntax.handlers())
            self._channels.update(syntax.channels)
            if not parse_tools:
                skip = {_TOOL_START, *syntax_cls.start_actions}
        else:
            skip = {_TOOL_START}
        rules = {}
        for key, rule in p.transitions.items():
            if rule.action in skip:
                continue
            if rule.action not in actions:
                if syntax is not None:
                    raise ValueError(f"profile {p.name!r}: no action {rule.action!r} for rule {key}")
                continue          # a rule of the family's tool syntax, which is switched off
            rules[key] = rule
        id_of = {name: delimiter_ids[text] for name, text in p.terminals.items()
                 if name in p.token_id_terminals and delimiter_ids.get(text) is not None}
        self._delimiter_id_set = frozenset(id_of.values())
        self._id_rules: dict[str, dict[int, Rule]] = {}
        text_rules: dict[str, list[tuple[str, Rule]]] = {}
        for (state, name), rule in rules.items():
            if name in id_of:
                self._id_rules.setdefault(state, {})[id_of[name]] = rule
            elif not rule.id_only:
                text_rules.setdefault(state, []).append((p.terminals[name], rule))
        self._text_rules = {s: tuple(v) for s, v in text_rules.items()}
        self._firsts = {s: re.compile("[" + re.escape("".join({t[0] for t, _ in v})) + "]")
                        for s, v in self._text_rules.items()}
        self._text_rule_at = {(s, p.terminals[n]): r for (s, n), r in rules.items() if not r.id_only}
        self._actions = actions
        self._call_id = call_id or _default_call_id
        self._out: list[Event] = []
        self._pending = ""            # text withheld as a possible prefix of a text terminal
        self._final = False
        self._cut = False  # finish() of an output cut by a length limit
        self._finished = False
        self.bad_run = False          # inside a line of Malformed text between tags
        # reasoning
        self._thinking_allowed = p.reasoning is not None and p.reasoning.open is not None
        self._closed_once = False
        # content whitespace next to tool calls (design A.6): None, or the whitespace held since a boundary
        self._ws_hold: list[str] | None = None
        # tool calls
        self.n_calls = 0
        self.call_open = False
        self.call_name = ""
        if syntax is not None and syntax.initial_state is not None:
            self.state = syntax.initial_state
        elif p.reasoning is not None and getattr(initial, "name", initial) == "REASONING":
            self.state = REASONING
        else:
            self.state = CONTENT
            self.boundary()
        # a thought kept in the content starts with the `<think>` the prompt opened it with
        self._lead = (p.reasoning.open or "") if self._thought_kept and self.state == REASONING else ""

    # ----------------------------------------------------------------------------------------------- public
    @property
    def channel(self) -> str:
        """Where the next byte would go: "reasoning", "content" or "tool"."""
        return self._channels.get(self.state, "tool")

    def feed(self, token_id: int | None, text: str) -> list[Event]:
        """One generated token (its ID and complete characters); the events it completes."""
        out = self._out = []
        if self._finished:
            return out
        if self._lead:
            out.append(ContentDelta(self._lead))
            self._lead = ""
        if token_id is not None and token_id in self._delimiter_id_set:
            self._flush_pending()
            rule = self._id_rules.get(self.state, {}).get(token_id)
            if rule is not None:
                self.apply(rule, text)
            else:
                self.atomic(text)
            return out
        if text:
            self._text(text)
        return out

    def finish(self, cut: bool = False) -> list[Event]:
        """Flush everything withheld into its channel and close an open tool call. ``cut``: the output was cut by a
        length limit, so structure it leaves unfinished (a call before its name) is Dropped, never content."""
        out = self._out = []
        if self._finished:
            return out
        if self._lead:
            out.append(ContentDelta(self._lead))
            self._lead = ""
        self._final = True
        self._cut = cut
        if self._pending:
            pending, self._pending = self._pending, ""
            self._text(pending)
        self.close_body(at_finish=True)
        if self.state == CONTENT:
            self._release_ws(drop=self.n_calls > 0)
        self._finished = True
        return out

    # ----------------------------------------------------------------------------------------------- lexing
    def _text(self, s: str) -> None:
        if self._pending:
            s = self._pending + s
            self._pending = ""
        while s:
            state = self.state
            terms = self._text_rules.get(state)
            if not terms:
                s = s[self._handlers[state](s):]
                continue
            find = self._firsts[state].search
            pos, cut, hold, best = 0, -1, False, None
            while True:
                m = find(s, pos)
                if m is None:
                    break
                i = m.start()
                for t, rule in terms:
                    if s.startswith(t, i):
                        if best is None or len(t) > len(best[0]):
                            best = (t, rule)
                    elif not self._final and len(s) - i < len(t) and t.startswith(s[i:]):
                        hold = True
                if hold or best is not None:
                    cut = i
                    break
                pos = i + 1
            if cut < 0:
                s = s[self._handlers[state](s):]
                continue
            if cut > 0:
                n = self._handlers[state](s[:cut])
                if self.state != state or n < cut:
                    s = s[n:]
                    continue
            if hold:
                self._pending = s[cut:]
                return
            t, rule = best
            self.apply(rule, t)
            s = s[cut + len(t):]

    def atomic(self, s: str) -> None:
        """Text of the current state, never matched against terminals (a delimiter token without a rule here)."""
        while s:
            s = s[self._handlers[self.state](s):]

    def _flush_pending(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, ""
            self.atomic(pending)

    def apply(self, rule: Rule, text: str) -> None:
        """Run ``rule``'s action on the terminal ``text``."""
        self.bad_run = False
        self._actions[rule.action](text)

    def text_rule(self, state: str, text: str) -> Rule | None:
        """The rule the text terminal ``text`` has in ``state`` (None when it has none there)."""
        return self._text_rule_at.get((state, text))

    # ----------------------------------------------------------------------------------------------- emitting
    def drop(self, text: str, reason: str) -> None:
        """``text`` consumed as structure (a Dropped event)."""
        if text:
            self._out.append(Dropped(text, reason))

    def malformed(self, text: str, reason: str) -> None:
        """``text`` broke the syntax: surfaced as content (a Malformed event), unless a length limit cut it short
        (Dropped: a call cut by max_tokens is never turned into content)."""
        if text:
            self._out.append(Dropped(text, f"{reason} (output cut by its length limit)") if self._cut
                             else Malformed(text, reason))

    def args(self, fragment: str) -> None:
        """An arguments fragment of the open call."""
        if fragment:
            self._out.append(ToolCallArguments(self.n_calls - 1, fragment))

    def start_call(self, name: str, call_id: str | None = None) -> None:
        """A call named ``name`` begins (its index is the machine's; its id too unless the model wrote one, as Kimi
        K2's `functions.NAME:IDX`)."""
        index = self.n_calls
        self.n_calls += 1
        self.call_open = True
        self.call_name = name
        if call_id is None:
            call_id = self._call_id(index)
            if self.syntax is not None:
                call_id = self.syntax.call_id(call_id)
        self._out.append(ToolCallStart(index, call_id, name))

    def end_call(self) -> None:
        """The open call (if any) is complete."""
        if self.call_open:
            self.call_open = False
            self._out.append(ToolCallEnd(self.n_calls - 1))

    def boundary(self) -> None:
        """Content starts (the reply, or after a thought or a call): whitespace-only content is held from here (design
        A.6); a thought opening next drops it, as a tool call does."""
        if self.profile.hold_boundary_whitespace:
            self._ws_hold = []

    def _release_ws(self, drop: bool, reason: str = "whitespace around tool call") -> None:
        held = "".join(self._ws_hold or ())
        self._ws_hold = None
        if held:
            if drop:
                self.drop(held, reason)
            else:
                self._out.append(ContentDelta(held))

    def output_cut(self, at_finish: bool) -> bool:
        """Whether a construct closed ``at_finish`` was cut (by a length limit or a stop string: left as it streamed)
        rather than ended by the model's end of turn (closed as its end tags would have closed it, as vLLM's XML
        parsers read a call whose tags the model left open)."""
        return at_finish and self._cut

    def close_body(self, at_finish: bool) -> None:
        """Close whatever call or construct is open (a closer arrived, another began, or finish)."""
        if self.state == BAD_CALL:
            self.end_call()
        elif self.syntax is not None:
            self.syntax.close(self.state, at_finish)

    # ----------------------------------------------------------------------------------------------- text handlers
    # Each takes a non-empty text of its state and returns how much it consumed (less than all once it changed state).
    def reasoning_text(self, s: str) -> int:
        self._out.append(ReasoningDelta(s))
        return len(s)

    def content_text(self, s: str) -> int:
        if self._ws_hold is not None:
            if s.isspace():
                self._ws_hold.append(s)
                return len(s)
            s, self._ws_hold = "".join(self._ws_hold) + s, None
        self._out.append(ContentDelta(s))
        return len(s)

    def args_text(self, s: str) -> int:
        self.args(s)
        return len(s)

    def bad_text(self, s: str) -> int:
        self.malformed(s, "malformed tool call")
        return len(s)

    def structural_ws(self, s: str, reason: str, stop: str = "") -> int:
        """Whitespace Dropped; other text Malformed up to the end of its line. Stops before the first character in
        ``stop`` and returns where it stopped."""
        i, n = 0, len(s)
        while i < n:
            c = s[i]
            if c in stop:
                return i
            if self.bad_run:
                j = i
                while j < n and s[j] != "\n" and s[j] not in stop:
                    j += 1
                self.malformed(s[i:j], reason)
                if j < n and s[j] == "\n":
                    self.bad_run = False
                i = j
            elif c in _WS:
                m = _NOT_WS.search(s, i)
                j = m.start() if m else n
                self.drop(s[i:j], "template whitespace")
                i = j
            else:
                self.bad_run = True
        return n

    def preamble_text(self, s: str) -> int:
        return self.structural_ws(s, "text before tool call body")

    def between_text(self, s: str) -> int:
        return self.structural_ws(s, "text after tool call")

    # ----------------------------------------------------------------------------------------------- actions
    def _thought_tag(self, text: str, reason: str) -> None:
        """A `<think>` / `</think>` consumed as structure: Dropped, or content where the thought is kept there."""
        if self._thought_kept:
            self._out.append(ContentDelta(text))
        else:
            self.drop(text, reason)

    def _do_absorb_open(self, text: str) -> None:
        self._thought_tag(text, "reasoning open inside the thought")

    def _do_reasoning_end(self, text: str) -> None:
        self._thought_tag(text, "reasoning close")
        self._closed_once = True
        self.state = CONTENT
        self.boundary()

    def _do_think_open(self, text: str) -> None:
        if not self._thinking_allowed:
            self.atomic(text)
            return
        self._release_ws(drop=not self._thought_kept, reason="whitespace before reasoning open")
        self._thought_tag(text, "reasoning open")
        self.state = REASONING

    def _do_content_close(self, text: str) -> None:
        if self._closed_once and self.profile.reasoning.absorb_duplicate_close:
            self.drop(text, "duplicate reasoning close")
            return
        self._thinking_allowed = False
        self.atomic(text)

    def _do_tool_open(self, text: str) -> None:
        if self.state == REASONING:
            self._closed_once = True
        elif self.state == CONTENT:
            self._release_ws(drop=True)
        else:
            self.close_body(at_finish=False)
        self.drop(text, "tool call open")
        self.state = TOOL_PREAMBLE

    def _do_tool_close(self, text: str) -> None:
        self.close_body(at_finish=False)
        self.drop(text, "tool call close")
        self.state = CONTENT
        self.boundary()

    def _do_end_of_turn(self, text: str) -> None:
        self._flush_pending()
        if self.state == CONTENT:
            self._release_ws(drop=self.n_calls > 0)
        self.drop(text, "end of turn")
