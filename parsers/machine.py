"""The one interpreter of every model-family profile: generated tokens in, events out.

`ParserMachine` is a pure synchronous state machine. Terminals that resolved to a single token count only as that
token (the same characters spelled by other tokens are ordinary text of the current channel); the other terminals are
matched on text with a holdback bounded by the longest terminal, and only in states that have a rule for them. Tool
bodies are scanned incrementally (Hermes JSON passes through verbatim, Qwen3-Coder XML becomes JSON as it streams,
harmony bodies are the arguments), so per-token work never depends on the length of the output.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from .events import (ContentDelta, Dropped, Event, Malformed, ReasoningDelta, ToolCallArguments, ToolCallEnd,
                     ToolCallStart)
from .json_stream import HermesWrapper
from .profiles.base import (BAD_CALL, CONTENT, FN_BODY, H_ANALYSIS, H_BETWEEN, H_FINAL, H_HEADER, H_TOOL, PARAM_KEY,
                            PARAM_SKIP, PARAM_VALUE, REASONING, TOOL_BETWEEN, TOOL_JSON, TOOL_NAME, TOOL_PREAMBLE,
                            Profile, Rule)
from .xml_values import escape, parameter_types, streams_as_string, typed_json

if TYPE_CHECKING:
    from .initial import InitialState

_WS = " \t\r\n"
_NOT_WS = re.compile(r"[^ \t\r\n]")
_WS_RE = re.compile(r"[ \t\r\n]")
_MAX_NAME = 512          # a tool / parameter name or harmony header longer than this is Malformed
_TOOL_ACTIONS = frozenset({"tool_open", "name_start"})
_CHANNELS = {REASONING: "reasoning", H_ANALYSIS: "reasoning", CONTENT: "content", H_FINAL: "content",
             H_HEADER: "content", H_BETWEEN: "content"}


def _default_call_id(index: int) -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ParserMachine:
    """Reasoning, content and tool calls of one choice, from its generated tokens.

    ``delimiter_ids``: terminal text -> its single token ID, for the profile's token-ID terminals that resolved to one
    token (the others are matched as text). ``initial``: where the reply starts (`InitialState.REASONING` or
    `.CONTENT`, from the prompt tail). ``tools``: the request's OpenAI-style tools (Qwen3-Coder values are typed by
    their JSON schemas). ``call_id(index)`` names tool calls. ``parse_tools=False`` (tool_choice none, no tools) leaves
    tool markup as text of the channel it appears in.
    """

    def __init__(self, profile: Profile, delimiter_ids: Mapping[str, int], initial: "InitialState",
                 tools: Sequence[dict] | None = None, call_id: Callable[[int], str] | None = None,
                 *, parse_tools: bool = True) -> None:
        p = self.profile = profile
        id_of = {name: delimiter_ids[text] for name, text in p.terminals.items()
                 if name in p.token_id_terminals and delimiter_ids.get(text) is not None}
        self._delimiter_id_set = frozenset(id_of.values())
        self._id_rules: dict[str, dict[int, Rule]] = {}
        text_rules: dict[str, list[tuple[str, Rule]]] = {}
        for (state, name), rule in p.transitions.items():
            if not parse_tools and rule.action in _TOOL_ACTIONS:
                continue
            if name in id_of:
                self._id_rules.setdefault(state, {})[id_of[name]] = rule
            elif not rule.id_only:
                text_rules.setdefault(state, []).append((p.terminals[name], rule))
        self._text_rules = {s: tuple(v) for s, v in text_rules.items()}
        self._firsts = {s: re.compile("[" + re.escape("".join({t[0] for t, _ in v})) + "]")
                        for s, v in self._text_rules.items()}
        self._text_rule_at = {(s, p.terminals[n]): r for (s, n), r in p.transitions.items() if not r.id_only}
        self._actions = {r.action: getattr(self, "_do_" + r.action) for r in p.transitions.values()}
        self._handlers = {
            REASONING: self._reasoning_text, CONTENT: self._content_text, TOOL_PREAMBLE: self._preamble_text,
            TOOL_JSON: self._json_text, TOOL_BETWEEN: self._between_text, BAD_CALL: self._bad_text,
            TOOL_NAME: self._name_text, FN_BODY: self._fn_body_text, PARAM_KEY: self._key_text,
            PARAM_VALUE: self._value_text, PARAM_SKIP: self._bad_text, H_HEADER: self._header_text,
            H_ANALYSIS: self._reasoning_text, H_FINAL: self._content_text, H_TOOL: self._args_text,
            H_BETWEEN: self._between_text,
        }
        self._types = parameter_types(tools)
        self._call_id = call_id or _default_call_id
        self._hermes = p.tool_format == "hermes"
        self._out: list[Event] = []
        self._pending = ""            # text withheld as a possible prefix of a text terminal
        self._final = False
        self._finished = False
        self._bad_run = False         # inside a line of Malformed text between tags
        # reasoning
        self._thinking_allowed = p.reasoning is not None and p.reasoning.open is not None
        self._closed_once = False
        # content whitespace next to tool calls (design A.6): None, or the whitespace held since a boundary
        self._ws_hold: str | None = None
        # tool calls
        self._n_calls = 0
        self._call_open = False
        self._call_name = ""
        self._wrapper: HermesWrapper | None = None
        self._pre: list[tuple[str, str]] = []     # Hermes pieces before the name is known
        self._opener = ""                         # `<function=` / `<parameter=` text, withheld with the name
        self._name_buf = ""
        self._n_params = 0
        self._val_types: tuple[str, ...] = ()
        self._val_str = True
        self._val_start = False
        self._val_nl = False
        self._val_buf = ""
        self._header = ""
        if p.tool_format == "harmony":
            self.state = H_HEADER
        elif p.reasoning is not None and getattr(initial, "name", initial) == "REASONING":
            self.state = REASONING
        else:
            self.state = CONTENT
            self._boundary()

    # ----------------------------------------------------------------------------------------------- public
    @property
    def channel(self) -> str:
        """Where the next byte would go: "reasoning", "content" or "tool"."""
        return _CHANNELS.get(self.state, "tool")

    def feed(self, token_id: int | None, text: str) -> list[Event]:
        """One generated token (its ID and complete characters); the events it completes."""
        out = self._out = []
        if self._finished:
            return out
        if token_id is not None and token_id in self._delimiter_id_set:
            self._flush_pending()
            rule = self._id_rules.get(self.state, {}).get(token_id)
            if rule is not None:
                self._apply(rule, text)
            else:
                self._atomic(text)
            return out
        if text:
            self._text(text)
        return out

    def finish(self) -> list[Event]:
        """Flush everything withheld into its channel and close an open tool call."""
        out = self._out = []
        if self._finished:
            return out
        self._final = True
        if self._pending:
            pending, self._pending = self._pending, ""
            self._text(pending)
        self._close_body(at_finish=True)
        if self.state == CONTENT:
            self._release_ws(drop=self._n_calls > 0)
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
            self._apply(rule, t)
            s = s[cut + len(t):]

    def _atomic(self, s: str) -> None:
        """Text of the current state, never matched against terminals (a delimiter token without a rule here)."""
        while s:
            s = s[self._handlers[self.state](s):]

    def _flush_pending(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, ""
            self._atomic(pending)

    def _apply(self, rule: Rule, text: str) -> None:
        self._bad_run = False
        self._actions[rule.action](text)

    # ----------------------------------------------------------------------------------------------- emitting
    def _drop(self, text: str, reason: str) -> None:
        if text:
            self._out.append(Dropped(text, reason))

    def _malformed(self, text: str, reason: str) -> None:
        if text:
            self._out.append(Malformed(text, reason))

    def _args(self, fragment: str) -> None:
        if fragment:
            self._out.append(ToolCallArguments(self._n_calls - 1, fragment))

    def _start_call(self, name: str) -> None:
        index = self._n_calls
        self._n_calls += 1
        self._call_open = True
        self._call_name = name
        self._out.append(ToolCallStart(index, self._call_id(index), name))

    def _end_call(self) -> None:
        if self._call_open:
            self._call_open = False
            self._out.append(ToolCallEnd(self._n_calls - 1))

    def _boundary(self) -> None:
        if self.profile.hold_boundary_whitespace:
            self._ws_hold = ""

    def _release_ws(self, drop: bool) -> None:
        held, self._ws_hold = self._ws_hold, None
        if held:
            if drop:
                self._drop(held, "whitespace around tool call")
            else:
                self._out.append(ContentDelta(held))

    # ----------------------------------------------------------------------------------------------- text handlers
    # Each takes a non-empty text of its state and returns how much it consumed (less than all once it changed state).
    def _reasoning_text(self, s: str) -> int:
        self._out.append(ReasoningDelta(s))
        return len(s)

    def _content_text(self, s: str) -> int:
        if self._ws_hold is not None:
            if s.isspace():
                self._ws_hold += s
                return len(s)
            s, self._ws_hold = self._ws_hold + s, None
        self._out.append(ContentDelta(s))
        return len(s)

    def _args_text(self, s: str) -> int:
        self._args(s)
        return len(s)

    def _bad_text(self, s: str) -> int:
        self._malformed(s, "malformed tool call")
        return len(s)

    def _structural_ws(self, s: str, reason: str, stop: str = "") -> int:
        """Whitespace Dropped; other text Malformed up to the end of its line. Stops before the first character in
        ``stop`` and returns where it stopped."""
        i, n = 0, len(s)
        while i < n:
            c = s[i]
            if c in stop:
                return i
            if self._bad_run:
                j = i
                while j < n and s[j] != "\n" and s[j] not in stop:
                    j += 1
                self._malformed(s[i:j], reason)
                if j < n and s[j] == "\n":
                    self._bad_run = False
                i = j
            elif c in _WS:
                m = _NOT_WS.search(s, i)
                j = m.start() if m else n
                self._drop(s[i:j], "template whitespace")
                i = j
            else:
                self._bad_run = True
        return n

    def _preamble_text(self, s: str) -> int:
        i = self._structural_ws(s, "text before tool call body", "{" if self._hermes else "")
        if i < len(s):
            self._bad_run = False
            self._wrapper = HermesWrapper()
            self._pre = []
            self.state = TOOL_JSON
        return i

    def _between_text(self, s: str) -> int:
        return self._structural_ws(s, "text after tool call")

    def _fn_body_text(self, s: str) -> int:
        return self._structural_ws(s, "text between parameters")

    def _json_text(self, s: str) -> int:
        w = self._wrapper
        n, pieces = w.feed(s)
        for kind, text in pieces:
            if self._call_open:
                if kind == "args":
                    self._args(text)
                else:
                    self._drop(text, "tool call wrapper")
            elif kind == "name":
                self._start_named(text)
            else:
                self._pre.append((kind, text))
        if w.error is not None:
            if not self._call_open:
                self._malformed(self._pre_raw(), w.error)
            self.state = BAD_CALL
        elif w.done:
            if self._call_open:
                if not w.has_args:
                    self._args("{}")
                self._end_call()
            else:
                self._malformed(self._pre_raw(), "tool call without a name")
            self.state = TOOL_BETWEEN
        return n

    def _start_named(self, name: str) -> None:
        pre, self._pre = self._pre, []
        k = 0
        while k < len(pre) and pre[k][0] == "drop":
            self._drop(pre[k][1], "tool call wrapper")
            k += 1
        self._start_call(name)
        for kind, text in pre[k:]:
            if kind == "args":
                self._args(text)
            else:
                self._drop(text, "tool call wrapper")

    def _pre_raw(self) -> str:
        raw = "".join(t for _, t in self._pre) + (self._wrapper.pending_raw if self._wrapper else "")
        self._pre = []
        return raw

    def _name_text(self, s: str) -> int:
        self._name_buf += s
        if len(self._name_buf) > _MAX_NAME:
            self._malformed(self._opener + self._name_buf, "tool name too long")
            self.state = BAD_CALL
        return len(s)

    def _key_text(self, s: str) -> int:
        self._name_buf += s
        if len(self._name_buf) > _MAX_NAME:
            self._malformed(self._opener + self._name_buf, "parameter name too long")
            self.state = PARAM_SKIP
        return len(s)

    def _value_text(self, s: str) -> int:
        n = len(s)
        strip = self.profile.strip_value_newlines
        if self._val_start:
            self._val_start = False
            if strip and s[0] == "\n":
                self._drop("\n", "template newline")
                s = s[1:]
        if self._val_nl:
            s = "\n" + s
            self._val_nl = False
        if strip and s.endswith("\n"):
            self._val_nl = True
            s = s[:-1]
        if s:
            if self._val_str:
                self._args(escape(s))
            else:
                self._val_buf += s
        return n

    def _header_text(self, s: str) -> int:
        self._header += s
        if len(self._header) > _MAX_NAME:
            self._malformed(self._header, "harmony header too long")
            self._header = ""
            self.state = H_BETWEEN
        return len(s)

    # ----------------------------------------------------------------------------------------------- actions
    def _do_absorb_open(self, text: str) -> None:
        self._drop(text, "reasoning open inside the thought")

    def _do_reasoning_end(self, text: str) -> None:
        self._drop(text, "reasoning close")
        self._closed_once = True
        self.state = CONTENT
        self._boundary()

    def _do_think_open(self, text: str) -> None:
        if not self._thinking_allowed:
            self._atomic(text)
            return
        self._release_ws(drop=False)
        self._drop(text, "reasoning open")
        self.state = REASONING

    def _do_content_close(self, text: str) -> None:
        if self._closed_once and self.profile.reasoning.absorb_duplicate_close:
            self._drop(text, "duplicate reasoning close")
            return
        self._thinking_allowed = False
        self._atomic(text)

    def _do_tool_open(self, text: str) -> None:
        if self.state == REASONING:
            self._closed_once = True
        elif self.state == CONTENT:
            self._release_ws(drop=True)
        else:
            self._close_body(at_finish=False)
        self._drop(text, "tool call open")
        self.state = TOOL_PREAMBLE

    def _do_tool_close(self, text: str) -> None:
        self._close_body(at_finish=False)
        self._drop(text, "tool call close")
        self.state = CONTENT
        self._boundary()

    def _do_end_of_turn(self, text: str) -> None:
        self._flush_pending()
        if self.state == CONTENT:
            self._release_ws(drop=self._n_calls > 0)
        self._drop(text, "end of turn")

    def _do_name_start(self, text: str) -> None:
        self._opener, self._name_buf = text, ""
        self.state = TOOL_NAME

    def _do_name_end(self, text: str) -> None:
        name, self._name_buf = self._name_buf, ""
        if not name.strip():
            self._malformed(self._opener + name + text, "empty tool name")
            self.state = BAD_CALL
            return
        self._drop(self._opener, "function tag")
        self._start_call(name)
        self._drop(text, "function tag")
        self._n_params = 0
        self.state = FN_BODY

    def _do_cut_short(self, text: str) -> None:
        name, self._name_buf = self._name_buf, ""
        if self.state == TOOL_NAME:
            self._malformed(self._opener + name + text, "tag cuts the tool name short")
            self.state = BAD_CALL
            return
        self._malformed(self._opener + name, "tag cuts the parameter name short")
        self.state = FN_BODY
        rule = self._text_rule_at.get((FN_BODY, text))
        if rule is not None:
            self._apply(rule, text)
        else:
            self._malformed(text, "tag out of place")

    def _do_function_end(self, text: str) -> None:
        self._args("}" if self._n_params else "{}")
        self._end_call()
        self._drop(text, "function tag")
        self.state = TOOL_BETWEEN

    def _do_key_start(self, text: str) -> None:
        self._opener, self._name_buf = text, ""
        self.state = PARAM_KEY

    def _do_key_end(self, text: str) -> None:
        key, self._name_buf = self._name_buf, ""
        if not key.strip():
            self._malformed(self._opener + key + text, "empty parameter name")
            self.state = PARAM_SKIP
            return
        self._drop(self._opener + key + text, "parameter tag")
        self._val_types = self._types.get(self._call_name, {}).get(key, ())
        self._val_str = streams_as_string(self._val_types)
        self._args(("{" if self._n_params == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": "
                   + ('"' if self._val_str else ""))
        self._n_params += 1
        self._val_start, self._val_nl, self._val_buf = True, False, ""
        self.state = PARAM_VALUE

    def _do_value_end(self, text: str) -> None:
        self._end_value(at_finish=False)
        self._drop(text, "parameter tag")
        self.state = FN_BODY

    def _do_skip_end(self, text: str) -> None:
        self._malformed(text, "malformed parameter")
        self.state = FN_BODY

    def _end_value(self, at_finish: bool) -> None:
        if self._val_nl:
            self._val_nl = False
            if at_finish:
                if self._val_str:
                    self._args(escape("\n"))
                else:
                    self._val_buf += "\n"
            else:
                self._drop("\n", "template newline")
        if self._val_str:
            if not at_finish:
                self._args('"')
        else:
            self._args(typed_json(self._val_buf, self._val_types))
            self._val_buf = ""

    # harmony
    def _do_header_part(self, text: str) -> None:
        self._header += text

    def _do_header_start(self, text: str) -> None:
        self._close_body(at_finish=False)
        self._drop(text, "harmony start")
        self._header = ""
        self.state = H_HEADER

    def _do_header_start_channel(self, text: str) -> None:
        self._close_body(at_finish=False)
        self._header = text
        self.state = H_HEADER

    def _do_header_end(self, text: str) -> None:
        header, self._header = self._header, ""
        terms = self.profile.terminals
        before, _, after = header.partition(terms["channel"])
        chan_part = after.partition(terms["constrain"])[0]
        words = (before + " " + chan_part).split()
        chan_words = chan_part.split()
        channel = chan_words[0] if chan_words else ""
        recipient = next((w[3:] for w in words if w.startswith("to=")), "")
        if recipient and recipient not in ("assistant", "user"):
            name = recipient.removeprefix("functions.")
            at = header.find(name, header.find("to=" + recipient))
            self._drop(header[:at], "harmony header")
            self._start_call(name)
            self._drop(header[at + len(name):] + text, "harmony header")
            self.state = H_TOOL
            return
        self._drop(header + text, "harmony header")
        if channel == "analysis":
            self.state = H_ANALYSIS
        else:
            self.state = H_FINAL

    def _do_message_end(self, text: str) -> None:
        self._end_call()
        self._drop(text, "harmony end")
        self.state = H_BETWEEN

    # ----------------------------------------------------------------------------------------------- closing
    def _close_body(self, at_finish: bool) -> None:
        """Close whatever tool-call or harmony construct is open (a closer arrived, another began, or finish)."""
        st = self.state
        if st == TOOL_JSON:
            if self._call_open:
                self._drop(self._wrapper.pending_raw, "tool call wrapper")
                self._end_call()
            else:
                self._malformed(self._pre_raw(), "tool call cut short")
        elif st == TOOL_NAME:
            name, self._name_buf = self._name_buf, ""
            self._malformed(self._opener + name, "tool call cut short")
        elif st in (FN_BODY, PARAM_KEY, PARAM_VALUE, PARAM_SKIP):
            if st == PARAM_KEY:
                key, self._name_buf = self._name_buf, ""
                self._malformed(self._opener + key, "parameter cut short")
            elif st == PARAM_VALUE:
                self._end_value(at_finish)
            if not at_finish and self._call_open:
                self._args("}" if self._n_params else "{}")
            self._end_call()
        elif st in (BAD_CALL, H_TOOL, H_ANALYSIS, H_FINAL):
            self._end_call()
        elif st == H_HEADER and self._header:
            header, self._header = self._header, ""
            self._malformed(header, "harmony header cut short")
