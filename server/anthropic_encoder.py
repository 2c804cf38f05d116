"""Pipeline events -> Anthropic Messages stream events, and their fold into the non-streaming `message` body.

Per design A.13: `message_start`, then a content block per channel run (`thinking` with `thinking_delta`s and a
`signature_delta` before its stop; `text` with `text_delta`s; `tool_use` with `input_json_delta`s carrying the same
fragments as OpenAI `arguments`, as far as they stay a prefix of a valid JSON object (`JsonObjectPrefix`: the
`anthropic` SDK parses every prefix and raises on one no object can continue); stray text inside a call follows its
block, which is never split), then `message_delta` (stop_reason, stop_sequence, usage) and `message_stop`. Usage follows
Anthropic's buckets: `input_tokens` are the prompt tokens not read from the prefix cache, `cache_read_input_tokens`
those that were; the cache hit is known only at the end, so `message_start` counts the whole prompt and `message_delta`
corrects it. With `omit_thinking` (``thinking.display: "omitted"``) thinking blocks carry no text, only their signature.
The non-streaming `message` is built from the one fold of the parser events (`parsers.result.fold`): its content blocks
are the fold's ordered runs, which are exactly the blocks the stream opens and closes.
"""
from __future__ import annotations

import base64
import hashlib
import json
import math
from typing import Any, Iterable

from ember.parsers.events import (ContentDelta, Dropped, Event, Malformed, ReasoningDelta, ToolCallArguments,
                                  ToolCallEnd, ToolCallStart)
from ember.parsers.json_prefix import JsonObjectPrefix
from ember.parsers.result import fold

from .choice import ChoiceEnd, ChoiceStep


class MessageEncoder:
    """One response's events -> Anthropic stream events; blocks open and close as the channel changes."""

    def __init__(self, message_id: str, model: str, input_tokens: int, cached_tokens: int | None = None,
                 omit_thinking: bool = False, window_bound: bool = False):
        """``window_bound``: the request's max_tokens was cut to what the context window leaves, so a reply that
        reaches it stops for the window (`model_context_window_exceeded`), not for max_tokens."""
        self.message_id = message_id
        self.window_bound = window_bound
        self.model = model
        self.input_tokens = input_tokens
        self.cached_tokens = cached_tokens
        self.omit_thinking = omit_thinking
        self.output_tokens = 0
        self.block_index = -1
        self.block_kind: str | None = None  # "thinking" | "text" | "tool_use"
        self.block_tool: int | None = None  # the tool-call index of an open tool_use block
        self._input = JsonObjectPrefix()  # the open tool_use block's arguments so far
        self._sig = hashlib.sha256()
        self.completed_calls = 0
        self._held: list[tuple[str, str]] = []  # (block kind, text) that arrived inside the open tool_use block

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self._head()}, {"type": "ping"}]

    def _head(self) -> dict[str, Any]:
        usage: dict[str, Any] = {"input_tokens": self.input_tokens - (self.cached_tokens or 0), "output_tokens": 0}
        if self.cached_tokens is not None:
            usage["cache_read_input_tokens"] = self.cached_tokens
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage}

    def _close(self) -> list[dict[str, Any]]:
        if self.block_kind is None:
            return []
        out = []
        if self.block_kind == "thinking":
            out.append({"type": "content_block_delta", "index": self.block_index,
                        "delta": {"type": "signature_delta", "signature": self._signature()}})
        out.append({"type": "content_block_stop", "index": self.block_index})
        self.block_kind = None
        self.block_tool = None
        return out

    def _signature(self) -> str:
        sig = base64.b64encode(self._sig.digest()).decode()
        self._sig = hashlib.sha256()
        return sig

    def _open(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.block_index += 1
        self.block_kind = kind
        out.append({"type": "content_block_start", "index": self.block_index, "content_block": block})
        return out

    def events(self, events: Iterable[Event], num_tokens: int = 0) -> list[dict[str, Any]]:
        self.output_tokens += num_tokens
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, (ReasoningDelta, ContentDelta, Malformed)):
                if not ev.text:
                    continue
                kind = "thinking" if isinstance(ev, ReasoningDelta) else "text"
                if self.block_kind == "tool_use":  # a tool_use block is never split: the text follows it
                    self._held.append((kind, ev.text))
                else:
                    out += self._text(kind, ev.text)
            elif isinstance(ev, ToolCallStart):
                out += self._close() + self._release()
                out += self._open("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
                self.block_tool = ev.index
                self._input = JsonObjectPrefix()
            elif isinstance(ev, ToolCallArguments):
                if not ev.fragment or self.block_kind != "tool_use" or self.block_tool != ev.index:
                    continue
                valid = ev.fragment[:self._input.feed(ev.fragment)]
                if valid:
                    out.append({"type": "content_block_delta", "index": self.block_index,
                                "delta": {"type": "input_json_delta", "partial_json": valid}})
            elif isinstance(ev, ToolCallEnd):
                self.completed_calls += 1
                if self.block_kind == "tool_use" and self.block_tool == ev.index:
                    out += self._close() + self._release()
            elif isinstance(ev, Dropped):
                continue
        return out

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """A thinking or text delta, in a block of its kind (opened when another kind is open)."""
        out = []
        if self.block_kind != kind:
            out += self._open(kind, {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                              else {"type": "text", "text": ""})
        if kind == "thinking":
            self._sig.update(text.encode())
            if not self.omit_thinking:
                out.append({"type": "content_block_delta", "index": self.block_index,
                            "delta": {"type": "thinking_delta", "thinking": text}})
        else:
            out.append({"type": "content_block_delta", "index": self.block_index,
                        "delta": {"type": "text_delta", "text": text}})
        return out

    def _release(self) -> list[dict[str, Any]]:
        """The text held while a tool_use block was open, now that it has closed."""
        out = [ev for kind, text in self._held for ev in self._text(kind, text)]
        self._held.clear()
        return out

    def stop_reason(self, end: ChoiceEnd) -> str:
        if end.reason == "length" and self.window_bound:
            return "model_context_window_exceeded"
        return stop_reason(end, self.completed_calls)

    def finish(self, end: ChoiceEnd) -> list[dict[str, Any]]:
        out = self._close() + self._release() + self._close()
        out.append(self._message_delta(end))
        out.append({"type": "message_stop"})
        return out

    def _message_delta(self, end: ChoiceEnd) -> dict[str, Any]:
        usage: dict[str, Any] = {"output_tokens": self.output_tokens}
        if end.cached_tokens is not None:
            usage["input_tokens"] = self.input_tokens - end.cached_tokens
            usage["cache_read_input_tokens"] = end.cached_tokens
        return {"type": "message_delta",
                "delta": {"stop_reason": self.stop_reason(end),
                          "stop_sequence": end.stop_string if end.reason == "stop_string" else None},
                "usage": usage}

    def body(self, steps: Iterable[ChoiceStep]) -> dict[str, Any]:
        """The non-streaming `message` from the response's steps: content blocks from the fold of their events
        (`parsers.result.fold`), usage and stop reason as `finish` would send them. A tool call whose arguments are
        not valid JSON (cut by max_tokens) gets `input: {}` and its raw text in the `partial_input` extension."""
        events: list[Event] = []
        end: ChoiceEnd | None = None
        for step in steps:
            events += step.events
            self.output_tokens += len(step.tokens)
            end = step.end or end
        out = fold(events)
        self.completed_calls = out.completed_calls
        calls = {c.index: c for c in out.tool_calls}
        message = self._head()
        for b in out.blocks:
            if b.kind == "reasoning":
                sig = base64.b64encode(hashlib.sha256(b.text.encode()).digest()).decode()
                message["content"].append({"type": "thinking", "thinking": "" if self.omit_thinking else b.text,
                                           "signature": sig})
            elif b.kind == "content":
                message["content"].append({"type": "text", "text": b.text})
            else:
                call = calls[b.index]
                message["content"].append({"type": "tool_use", "id": call.id, "name": call.name,
                                           **_tool_input(b.text)})
        if end is not None:
            delta = self._message_delta(end)
            message.update(delta["delta"])
            message["usage"].update(delta["usage"])
        return message


def stop_reason(end: ChoiceEnd, completed_calls: int) -> str:
    """`max_tokens`, `stop_sequence`, `tool_use` (the turn ended after complete calls) or `end_turn`."""
    if end.reason == "length":
        return "max_tokens"
    if end.reason == "stop_string":
        return "stop_sequence"
    if end.reason == "eos" and completed_calls:
        return "tool_use"
    return "end_turn"


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is beyond a double's range")
    return value


def _tool_input(raw: str) -> dict[str, Any]:
    """A tool_use block's ``input`` and, when the arguments are not a JSON object a body can hold (cut short, or a
    number beyond a double's range or Python's digit limit, which JSON can spell but the body cannot carry),
    ``partial_input`` (raw text)."""
    if not raw.strip():
        return {"input": {}}
    try:
        value = json.loads(raw, parse_float=_finite)
    except ValueError:  # JSONDecodeError included
        value = None
    return {"input": value} if isinstance(value, dict) else {"input": {}, "partial_input": raw}
