"""`parallel_tool_calls: false` (Anthropic: `disable_parallel_tool_use`) enforced on the output, also where no
grammar constrains the calls: only a choice's first tool call is surfaced; later calls' events are dropped, the same
way in a stream and in its fold."""
from __future__ import annotations

import dataclasses

from ember.parsers.events import ToolCallArguments, ToolCallEnd, ToolCallStart

from .choice import ChoiceStep

_CALL_EVENTS = (ToolCallStart, ToolCallArguments, ToolCallEnd)


def first_call_only(step: ChoiceStep) -> ChoiceStep:
    """`step` without the events of the choice's second and later tool calls (its tokens are kept)."""
    kept = [e for e in step.events if not (isinstance(e, _CALL_EVENTS) and e.index > 0)]
    return step if len(kept) == len(step.events) else dataclasses.replace(step, events=kept)
