"""Anthropic conversation turns as the Messages API reads them: consecutive messages of one role are one turn, and
every `tool_use` of an assistant turn is answered by a `tool_result` in the next turn (results matched to calls by
id, so they reach the template in call order: templates that print no ids pair them by position)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from . import protocol_anthropic as pa
from .errors import bad_request


@dataclass
class Turn:
    """One role's consecutive messages: each content block with the request field it came from, or ``text``, the
    string content of a turn that is one message sent as a string (given to the template as it is)."""

    role: str
    index: int  # the request index of its first message
    blocks: list[tuple[str, Any]] = field(default_factory=list)
    text: str | None = None


def turns(messages: Sequence[pa.Message]) -> list[Turn]:
    """``messages`` combined into turns, each turn's tool results in the order of the calls they answer; a 400
    naming the message when a call has no result in the next turn, or a result answers no call of the turn before
    (Anthropic's rules and wording)."""
    out: list[Turn] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if out and out[-1].role == m.role:
            turn = out[-1]
            if turn.text is not None:
                turn.blocks, turn.text = [(f"messages[{turn.index}].content", _text(turn.text))], None
        else:
            turn = Turn(m.role, i)
            out.append(turn)
            if isinstance(m.content, str):
                turn.text = m.content
                continue
        if isinstance(m.content, str):
            turn.blocks.append((where, _text(m.content)))
        else:
            turn.blocks.extend((f"{where}[{j}]", b) for j, b in enumerate(m.content))
    for t, turn in enumerate(out):
        if turn.role == "assistant" and t + 1 < len(out):
            _answered(turn, out[t + 1])
        if turn.role == "user":
            _in_call_order(turn, out[t - 1] if t else None)
    return out


def _text(text: str) -> pa.TextBlock:
    return pa.TextBlock(type="text", text=text)


def _calls(turn: Turn) -> list[str]:
    return [b.id for _, b in turn.blocks if getattr(b, "type", None) == "tool_use"]


def _results(turn: Turn) -> list[int]:
    return [k for k, (_, b) in enumerate(turn.blocks) if getattr(b, "type", None) == "tool_result"]


def _answered(assistant: Turn, after: Turn) -> None:
    answered = {after.blocks[k][1].tool_use_id for k in _results(after)}
    missing = [c for c in _calls(assistant) if c not in answered]
    if missing:
        raise bad_request(f"`tool_use` ids were found without `tool_result` blocks immediately after: "
                          f"{', '.join(missing)}. Each `tool_use` block must have a corresponding `tool_result` block "
                          "in the next message.", param=f"messages[{assistant.index}].content")


def _in_call_order(user: Turn, before: Turn | None) -> None:
    """The turn's tool results rearranged among their own positions into the order of the calls they answer."""
    positions = _results(user)
    if not positions:
        return
    order = {c: n for n, c in enumerate(_calls(before) if before is not None else [])}
    for k in positions:
        where, block = user.blocks[k]
        if block.tool_use_id not in order:
            raise bad_request(f"unexpected `tool_use_id` found in `tool_result` blocks: {block.tool_use_id}. Each "
                              "`tool_result` block must have a corresponding `tool_use` block in the previous "
                              "message.", param=f"{where}.tool_use_id")
    ranked = sorted((user.blocks[k] for k in positions), key=lambda fb: order[fb[1].tool_use_id])
    for k, item in zip(positions, ranked):
        user.blocks[k] = item
