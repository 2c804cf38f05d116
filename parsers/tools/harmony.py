"""gpt-oss harmony: messages `<|start|>ROLE<|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>json]<|message|>BODY<|end|>`.

The header is buffered (bounded) and decides the body: analysis -> reasoning, a recipient other than the assistant or
the user (``to=functions.NAME``) -> a tool call whose body is the arguments JSON verbatim ("{}" for a body of only
whitespace), anything else -> content. A recipient with an empty name makes the header and the body Malformed. When
the request parses no tools (no tools, tool_choice none), a message addressed to a tool is content, as a commentary
preamble is: design A.8 keeps tool markup as content, and harmony's markup is its header, Dropped for every message,
so the body is what surfaces. Headers are Dropped; `<|end|>`, `<|call|>`, `<|return|>` end a message.

The reply starts where the prompt left it (`parsers.initial`): in a header after `<|start|>assistant` (CONTENT), after
the prompt's `<|channel|>` (HARMONY_CHANNEL: the header is read as if it began with `<|channel|>`, which is prompt, so
never an event), or inside a message body the prompt opened (a continued message): REASONING -> analysis,
HARMONY_CONTENT -> final.
"""
from __future__ import annotations

from ..profiles.base import H_ANALYSIS, H_BETWEEN, H_FINAL, H_HEADER, H_TOOL
from .base import MAX_NAME, WHITESPACE, Action, Handler, ToolSyntax


class HarmonySyntax(ToolSyntax):
    tool_format = "harmony"
    channels = {H_ANALYSIS: "reasoning", H_FINAL: "content", H_HEADER: "content", H_BETWEEN: "content"}
    initial_state = H_HEADER       # the prompt ends with `<|start|>assistant` (see __init__ for the other starts)

    def __init__(self, machine, tools) -> None:
        super().__init__(machine, tools)
        self._header = ""
        self._body_ws: list[str] | None = None   # a call's body while it is only whitespace
        start = getattr(machine, "initial", None)
        start = getattr(start, "name", start)
        self.initial_state = {"REASONING": H_ANALYSIS, "HARMONY_CONTENT": H_FINAL}.get(start, H_HEADER)
        # the part of the first header that the prompt holds: read with the header, never emitted
        self._prompt_header = machine.profile.terminals["channel"] if start == "HARMONY_CHANNEL" else ""

    def handlers(self) -> dict[str, Handler]:
        m = self.m
        return {H_HEADER: self._header_text, H_ANALYSIS: m.reasoning_text, H_FINAL: m.content_text,
                H_TOOL: self._body_text, H_BETWEEN: m.between_text}

    def actions(self) -> dict[str, Action]:
        return {"header_part": self._do_header_part, "header_start": self._do_header_start,
                "header_start_channel": self._do_header_start_channel, "header_end": self._do_header_end,
                "message_end": self._do_message_end}

    def close(self, state: str, at_finish: bool) -> None:
        if state == H_TOOL:
            self._end_body(at_finish)
        if state in (H_TOOL, H_ANALYSIS, H_FINAL):
            self.m.end_call()
        elif state == H_HEADER and self._header:
            header, self._header = self._header, ""
            self.m.malformed(header, "harmony header cut short")

    def _header_text(self, s: str) -> int:
        self._header += s
        if len(self._header) > MAX_NAME:
            self.m.malformed(self._header, "harmony header too long")
            self._header = ""
            self.m.state = H_BETWEEN
        return len(s)

    def _body_text(self, s: str) -> int:
        m = self.m
        if not m.call_open:
            m.malformed(s, "malformed tool call")
            return len(s)
        held = self._body_ws
        if held is not None:
            if not s.strip(WHITESPACE):
                held.append(s)
                return len(s)
            self._body_ws = None
            s = "".join(held) + s
        m.args(s)
        return len(s)

    def _end_body(self, at_finish: bool) -> None:
        """A body of only whitespace is the arguments "{}" (withheld as it streamed; left as it is when cut short)."""
        held, self._body_ws = self._body_ws, None
        if held is None or not self.m.call_open:
            return
        if at_finish:
            self.m.args("".join(held))
        else:
            self.m.drop("".join(held), "template whitespace")
            self.m.args("{}")

    def _do_header_part(self, text: str) -> None:
        self._header += text

    def _do_header_start(self, text: str) -> None:
        m = self.m
        m.close_body(at_finish=False)
        m.drop(text, "harmony start")
        self._header = self._prompt_header = ""
        m.state = H_HEADER

    def _do_header_start_channel(self, text: str) -> None:
        m = self.m
        m.close_body(at_finish=False)
        self._header = text
        self._prompt_header = ""
        m.state = H_HEADER

    def _do_header_end(self, text: str) -> None:
        m = self.m
        header, self._header = self._header, ""
        prompt_part, self._prompt_header = self._prompt_header, ""
        terms = m.profile.terminals
        before, _, after = (prompt_part + header).partition(terms["channel"])
        chan_part = after.partition(terms["constrain"])[0]
        words = (before + " " + chan_part).split()
        chan_words = chan_part.split()
        channel = chan_words[0] if chan_words else ""
        recipient = next((w[3:] for w in words if w.startswith("to=")), "")
        if recipient and recipient not in ("assistant", "user") and m.parse_tools:
            name = recipient.removeprefix("functions.")
            m.state = H_TOOL
            if not name:
                m.malformed(header + text, "empty tool name")
                return
            at = header.find(name, header.find("to=" + recipient))
            m.drop(header[:at], "harmony header")
            m.start_call(name)
            m.drop(header[at + len(name):] + text, "harmony header")
            self._body_ws = []
            return
        m.drop(header + text, "harmony header")
        m.state = H_ANALYSIS if channel == "analysis" else H_FINAL

    def _do_message_end(self, text: str) -> None:
        self.close(self.m.state, at_finish=False)
        self.m.drop(text, "harmony end")
        self.m.state = H_BETWEEN
