"""Pipeline events -> Anthropic Messages stream events, and their fold into the non-streaming `message` body.

Per design A.13: `message_start`, then a content block per channel run (`thinking` with `thinking_delta`s and a
`signature_delta` before its stop; `text` with `text_delta`s; `tool_use` with `input_json_delta`s carrying the same
fragments as OpenAI `arguments`), then `message_delta` (stop_reason, stop_sequence, usage) and `message_stop`.
"""
from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, Iterable

from ember.parsers.events import (ContentDelta, Dropped, Event, Malformed, ReasoningDelta, ToolCallArguments,
                                  ToolCallEnd, ToolCallStart)

from .choice import ChoiceEnd


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class MessageEncoder:
    """One response's events -> Anthropic stream events; blocks open and close as the channel changes."""

    def __init__(self, message_id: str, model: str, input_tokens: int, cached_tokens: int | None = None):
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.cached_tokens = cached_tokens
        self.output_tokens = 0
        self.block_index = -1
        self.block_kind: str | None = None  # "thinking" | "text" | "tool_use"
        self.block_tool: int | None = None  # the tool-call index of an open tool_use block
        self._sig = hashlib.sha256()
        self.completed_calls = 0

    def start(self) -> list[dict[str, Any]]:
        usage: dict[str, Any] = {"input_tokens": self.input_tokens, "output_tokens": 0}
        if self.cached_tokens is not None:
            usage["cache_read_input_tokens"] = self.cached_tokens
        return [
            {"type": "message_start", "message": {
                "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage}},
            {"type": "ping"},
        ]

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
            if isinstance(ev, ReasoningDelta):
                if not ev.text:
                    continue
                if self.block_kind != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self._sig.update(ev.text.encode())
                out.append({"type": "content_block_delta", "index": self.block_index,
                            "delta": {"type": "thinking_delta", "thinking": ev.text}})
            elif isinstance(ev, (ContentDelta, Malformed)):
                if not ev.text:
                    continue
                if self.block_kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append({"type": "content_block_delta", "index": self.block_index,
                            "delta": {"type": "text_delta", "text": ev.text}})
            elif isinstance(ev, ToolCallStart):
                out += self._open("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
                self.block_tool = ev.index
            elif isinstance(ev, ToolCallArguments):
                if not ev.fragment or self.block_kind != "tool_use" or self.block_tool != ev.index:
                    continue
                out.append({"type": "content_block_delta", "index": self.block_index,
                            "delta": {"type": "input_json_delta", "partial_json": ev.fragment}})
            elif isinstance(ev, ToolCallEnd):
                if self.block_kind == "tool_use" and self.block_tool == ev.index:
                    self.completed_calls += 1
                    out += self._close()
            elif isinstance(ev, Dropped):
                continue
        return out

    def stop_reason(self, end: ChoiceEnd) -> str:
        if end.reason == "length":
            return "max_tokens"
        if end.reason == "stop_string":
            return "stop_sequence"
        if end.reason == "eos" and self.completed_calls:
            return "tool_use"
        return "end_turn"

    def finish(self, end: ChoiceEnd) -> list[dict[str, Any]]:
        out = self._close()
        out.append({"type": "message_delta",
                    "delta": {"stop_reason": self.stop_reason(end),
                              "stop_sequence": end.stop_string if end.reason == "stop_string" else None},
                    "usage": {"output_tokens": self.output_tokens}})
        out.append({"type": "message_stop"})
        return out


def fold_message(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The non-streaming `message` body: the fold of the stream events. A tool call whose arguments are not valid
    JSON (cut by max_tokens) gets `input: {}` and its raw text in the `partial_input` extension."""
    message: dict[str, Any] | None = None
    raw_json: dict[int, list[str]] = {}
    for ev in events:
        t = ev["type"]
        if t == "message_start":
            message = json.loads(json.dumps(ev["message"]))
        elif message is None:
            continue
        elif t == "content_block_start":
            message["content"].append(dict(ev["content_block"]))
        elif t == "content_block_delta":
            block = message["content"][ev["index"]]
            d = ev["delta"]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                block["signature"] = d["signature"]
            elif d["type"] == "input_json_delta":
                raw_json.setdefault(ev["index"], []).append(d["partial_json"])
        elif t == "message_delta":
            message["stop_reason"] = ev["delta"]["stop_reason"]
            message["stop_sequence"] = ev["delta"]["stop_sequence"]
            message["usage"]["output_tokens"] = ev["usage"]["output_tokens"]
    assert message is not None, "a stream starts with message_start"
    for i, block in enumerate(message["content"]):
        if block["type"] != "tool_use":
            continue
        raw = "".join(raw_json.get(i, ()))
        if not raw.strip():
            block["input"] = {}
            continue
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            block["input"] = value
        else:
            block["input"] = {}
            block["partial_input"] = raw
    return message
