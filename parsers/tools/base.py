"""The interface between the parser driver (`parsers.machine.ParserMachine`) and one tool-call syntax.

The driver owns everything a tool syntax does not: delimiter token-ID gating, the pending partial-tag buffer, the
reasoning and content channels, whitespace held next to calls, end of turn, and the generic `<tool_call>` wrapper
actions (``tool_open`` / ``tool_close``). A `ToolSyntax` owns the states of its call bodies: for each it gives a text
handler, for each rule action its profile names it gives an action, and it closes whatever it has open when a closer
arrives, another call begins, or the output ends. Its rules stay data in the profile (`parsers.profiles`).

A text handler takes a non-empty text of its state and returns how many characters it consumed; it consumes less
than all only after it changed ``machine.state`` (the driver feeds the rest to the new state's handler). An action
takes the terminal's text (its bytes must land in some event: Dropped, Malformed, arguments...).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from ..machine import ParserMachine

__all__ = ["ToolSyntax", "Handler", "Action", "MAX_NAME", "WHITESPACE"]

Handler = Callable[[str], int]
Action = Callable[[str], None]

MAX_NAME = 512
"""A tool name, parameter name or header longer than this is Malformed (bounds what a syntax buffers)."""

WHITESPACE = " \t\r\n"


class ToolSyntax:
    """One tool-call syntax, driven by a `ParserMachine` (one instance per machine, so per choice).

    Class attributes (data):
      ``tool_format``: the `Profile.tool_format` value that selects this syntax.
      ``channels``: state -> "reasoning" | "content" for this syntax's states whose text is not tool text (harmony's
      analysis and final channels); every other state of the syntax is "tool".
      ``start_actions``: rule actions of this syntax that start a call without the driver's ``tool_open`` (a
      Qwen3-Coder ``<function=`` after a call); rules with them are skipped when the request parses no tools.
      ``initial_state``: the state the reply starts in, when the syntax decides it (harmony: a header), else None.

    Hooks (override what you use): `handlers`, `actions`, `close`. Use the machine's emitting helpers
    (`ParserMachine.drop`, ``malformed``, ``start_call``, ``args``, ``end_call``, ``structural_ws`` ...) and set
    ``self.m.state`` to move between states.
    """

    tool_format: ClassVar[str] = ""
    channels: ClassVar[Mapping[str, str]] = {}
    start_actions: ClassVar[frozenset[str]] = frozenset()
    initial_state: ClassVar[str | None] = None

    def __init__(self, machine: "ParserMachine", tools: Sequence[dict] | None) -> None:
        self.m = machine
        self.at_reply_start = True  # only whitespace so far (see `bare_start_text`)

    def bare_start_text(self, s: str, opener: str, begin: Callable[[], None]) -> int:
        """A ``CONTENT`` handler for a syntax whose call may open bare at the very start of the reply, with no
        delimiter token (Llama 3 JSON's ``{``, pythonic's ``[``): leading whitespace is held as content; when the
        first other character is ``opener`` and the request parses tools, ``begin()`` moves to the call's state
        (which then reads from ``opener`` on); otherwise the rest of the reply is content."""
        m = self.m
        if not self.at_reply_start:
            return m.content_text(s)
        j = len(s) - len(s.lstrip(WHITESPACE))
        if j == len(s):
            return m.content_text(s)  # held: may precede a bare call
        self.at_reply_start = False
        if s[j] != opener or not m.parse_tools:
            return m.content_text(s)
        if j:
            m.content_text(s[:j])
        begin()
        return j

    def handlers(self) -> dict[str, Handler]:
        """State -> text handler, for this syntax's states (may replace the driver's default for a shared state such
        as ``TOOL_PREAMBLE`` or even ``CONTENT``, delegating to ``self.m.content_text`` where it does not apply)."""
        return {}

    def actions(self) -> dict[str, Action]:
        """Rule action name (as the profile's `Rule`s name it) -> action."""
        return {}

    def call_id(self, generated: str) -> str:
        """The id of a call whose model wrote none, from the server's ``generated`` one (a family whose templates check
        ids reshapes it: Mistral's 9 alphanumerics)."""
        return generated

    def close(self, state: str, at_finish: bool) -> None:
        """Close whatever this syntax has open in ``state``: a closer arrived, another call began (``at_finish``
        False), or the output ended (True: surface what was withheld, leave a cut call as it streamed)."""
