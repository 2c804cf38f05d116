"""Pipeline events -> OpenAI Responses API stream events, and the response object they build.

One output item per run of the reply, in order: a `reasoning` item (`reasoning_text` part) for thought, a `message`
item (`output_text` part) for the answer, a `function_call` item per tool call. Each item is announced
(`response.output_item.added`, then `response.content_part.added` for text), grows by deltas and is closed with its
full text (`....done`, `response.content_part.done`, `response.output_item.done`) when the channel changes, a call
ends or the response finishes. The stream opens with `response.created` and `response.in_progress` (a background
response: `response.created` and `response.queued`, both `queued`, then `response.in_progress` with its first step)
and ends with `response.completed`, `response.incomplete` (max_output_tokens) or `response.failed`, carrying the whole
response.
Every event has the next `sequence_number`. The non-streaming body is the same encoder's final response, so it equals
what the stream ends with.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from ember.parsers.events import (CHANNEL_ENDS, ContentDelta, Dropped, Malformed, ReasoningDelta, ToolCallArguments,
                                  ToolCallEnd, ToolCallStart)

from .choice import ChoiceEnd, ChoiceStep
from .openai_encoder import TokenBytesFn, logprob_entry
from .responses_input import new_item_id



@dataclass
class _TextItem:
    """The open reasoning or message item."""

    kind: str  # "reasoning" | "message"
    output_index: int
    id: str
    parts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    ended: bool = False  # a delimiter left its channel: a cut after it does not make it incomplete

    def part(self, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": status}
        return {"id": self.id, "type": "message", "role": "assistant", "status": status, "content": content}


@dataclass
class _CallItem:
    output_index: int
    id: str
    call_id: str
    name: str
    fragments: list[str] = field(default_factory=list)

    def item(self, status: str) -> dict[str, Any]:
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": "".join(self.fragments), "status": status}


class ResponseEncoder:
    """One response's steps -> stream events; `response()` is the response object those events built."""

    def __init__(self, head: dict[str, Any], token_bytes: TokenBytesFn, input_tokens: int,
                 top_logprobs: int | None = None, queued: bool = False):
        self.head = head  # the response's constant fields (id, created_at, model, the echoed request settings)
        self.tb = token_bytes
        self.top_logprobs = top_logprobs  # None: the request did not ask for logprobs
        self.input_tokens = input_tokens
        self.output_tokens = 0
        self.reasoning_tokens = 0
        self.cached_tokens = 0
        self.seq = 0
        self.output: list[dict[str, Any] | None] = []  # closed items (never changed again); None where still open
        self.text: _TextItem | None = None
        self.calls: dict[int, _CallItem] = {}  # open calls by their index among this response's calls
        self.pending_logprobs: list[dict[str, Any]] = []  # content tokens whose text has not been streamed yet
        self.status = "queued" if queued else "in_progress"  # queued: a background response before its first step
        self.incomplete_details: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.completed_at: int | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def response(self) -> dict[str, Any]:
        """The response object as it stands (items still open are left out)."""
        usage = None
        if self.status not in ("queued", "in_progress"):
            usage = {"input_tokens": self.input_tokens,
                     "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
                     "output_tokens": self.output_tokens,
                     "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                     "total_tokens": self.input_tokens + self.output_tokens}
        return {**self.head, "status": self.status, "completed_at": self.completed_at, "error": self.error,
                "incomplete_details": self.incomplete_details,
                "output": [item for item in self.output if item is not None], "usage": usage}

    def start(self) -> list[dict[str, Any]]:
        nxt = "response.queued" if self.status == "queued" else "response.in_progress"
        return [self._event("response.created", response=self.response()), self._event(nxt, response=self.response())]

    # ------------------------------------------------------------------------------------------------ text items

    def _open_text(self, kind: str) -> list[dict[str, Any]]:
        out = self._close_text("completed")
        item = _TextItem(kind, len(self.output), new_item_id(kind))
        self.output.append(None)
        self.text = item
        out.append(self._event("response.output_item.added", output_index=item.output_index,
                               item=item.item("in_progress", [])))
        out.append(self._event("response.content_part.added", item_id=item.id, output_index=item.output_index,
                               content_index=0, part=item.part("", [])))
        return out

    def _close_text(self, status: str) -> list[dict[str, Any]]:
        item = self.text
        if item is None:
            return []
        self.text = None
        text = "".join(item.parts)
        where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0}
        if item.kind == "reasoning":
            done = self._event("response.reasoning_text.done", **where, text=text)
        else:
            item.logprobs += self.pending_logprobs
            self.pending_logprobs = []
            done = self._event("response.output_text.done", **where, text=text, logprobs=item.logprobs)
        part = item.part(text, item.logprobs)
        final = self.output[item.output_index] = item.item(status, [part])
        return [done, self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=item.output_index, item=final)]

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        out = [] if self.text is not None and self.text.kind == kind else self._open_text(kind)
        item = self.text
        assert item is not None
        item.parts.append(text)
        item.ended = False
        where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0}
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", **where, delta=text))
        else:
            lps, self.pending_logprobs = self.pending_logprobs, []
            item.logprobs += lps
            out.append(self._event("response.output_text.delta", **where, delta=text, logprobs=lps))
        return out

    # ------------------------------------------------------------------------------------------------ call items

    def _open_call(self, ev: ToolCallStart) -> list[dict[str, Any]]:
        out = self._close_text("completed")
        call = _CallItem(len(self.output), new_item_id("function_call"), ev.id, ev.name)
        self.output.append(None)
        self.calls[ev.index] = call
        out.append(self._event("response.output_item.added", output_index=call.output_index,
                               item=call.item("in_progress")))
        return out

    def _close_call(self, index: int, status: str) -> list[dict[str, Any]]:
        call = self.calls.pop(index)
        final = self.output[call.output_index] = call.item(status)
        return [self._event("response.function_call_arguments.done", item_id=call.id,
                            output_index=call.output_index, name=call.name, arguments=final["arguments"]),
                self._event("response.output_item.done", output_index=call.output_index, item=final)]

    # ----------------------------------------------------------------------------------------------------- steps

    def events(self, step: ChoiceStep) -> list[dict[str, Any]]:
        """The stream events of one step (and, on its last, the closing ones)."""
        self.output_tokens += len(step.tokens)
        for t in step.tokens:
            if t.channel == "reasoning":
                self.reasoning_tokens += 1
            elif t.channel == "content" and self.top_logprobs is not None and t.logprob is not None:
                self.pending_logprobs.append(logprob_entry(self.tb, t, self.top_logprobs))
        out: list[dict[str, Any]] = []
        if self.status == "queued":
            self.status = "in_progress"
            out.append(self._event("response.in_progress", response=self.response()))
        cut_from = step.finish_at if step.end is not None and step.end.reason == "length" else None
        text: list[str] = []  # a run of the step's answer text: one delta, carrying the run's tokens' logprobs
        for k, ev in enumerate(step.events):
            if isinstance(ev, (ContentDelta, Malformed)):
                text.append(ev.text)
                continue
            if any(text):
                out += self._text_delta("message", "".join(text))
            text = []
            if isinstance(ev, Dropped):
                if self.text is not None and ev.reason in CHANNEL_ENDS:
                    self.text.ended = True
            elif isinstance(ev, ReasoningDelta):
                if ev.text:
                    out += self._text_delta("reasoning", ev.text)
            elif isinstance(ev, ToolCallStart):
                out += self._open_call(ev)
            elif isinstance(ev, ToolCallArguments):
                call = self.calls.get(ev.index)
                if call is not None and ev.fragment:
                    call.fragments.append(ev.fragment)
                    out.append(self._event("response.function_call_arguments.delta", item_id=call.id,
                                           output_index=call.output_index, delta=ev.fragment))
            elif isinstance(ev, ToolCallEnd):
                if ev.index in self.calls:  # a call the end-of-output flush closed was cut by max_output_tokens
                    cut = cut_from is not None and k >= cut_from
                    out += self._close_call(ev.index, "incomplete" if cut else "completed")
        if any(text):
            out += self._text_delta("message", "".join(text))
        if step.end is not None:
            out += self.finish(step.end)
        return out

    def finish(self, end: ChoiceEnd) -> list[dict[str, Any]]:
        """Close what is open, settle the status and send the final lifecycle event."""
        if end.cached_tokens is not None:
            self.cached_tokens = end.cached_tokens
        cut = end.reason == "length" and self.text is not None and not self.text.ended
        out = self._close_text("incomplete" if cut else "completed")
        for index in sorted(self.calls):
            out += self._close_call(index, "incomplete")
        if end.reason == "length":
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
        elif end.reason in ("error", "abort"):
            message = end.error or "the request was aborted"
            code = "invalid_prompt" if end.rejected else "server_error"  # the request's own settings failed it
            self.status, self.error = "failed", {"code": code, "message": message}
        else:
            self.status = "completed"
            self.completed_at = int(time.time())
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(self.status,
                                                                                            "response.failed")
        out.append(self._event(kind, response=self.response()))
        return out

    def body(self, steps: Iterable[ChoiceStep]) -> dict[str, Any]:
        """The non-streaming response: the final response of the same events."""
        for step in steps:
            self.events(step)
        return self.response()
