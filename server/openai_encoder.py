"""Pipeline events -> OpenAI `chat.completion.chunk`s / `text_completion` chunks, and the non-streaming bodies.

A non-streaming `chat.completion` is built from the one fold of the parser events (`parsers.result.fold`) plus each
choice's tokens (logprobs, token IDs) and end, with the same per-token and finish-reason rules as the chunks, so it
equals what a client rebuilds from the stream.

Per design A.11-A.12: one channel per chunk, order preserved; reasoning under `reasoning_content` and `reasoning`;
a tool call's first delta has id, type, name and `arguments` "", later ones index + argument fragments; every
generated token ID rides in exactly one chunk (a token-only chunk when its text is withheld; one whose text the parser
holds, in the chunk that surfaces it: `ChoiceStep`), with its logprobs.
"""
from __future__ import annotations

import codecs
import json
from collections import deque
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any, Callable, Collection, Iterable, Sequence

from ember.engine.params import TokenLogprob
from ember.parsers.events import (ContentDelta, Event, Malformed, ReasoningDelta, ToolCallArguments, ToolCallEnd,
                                  ToolCallStart)
from ember.parsers.pipeline import DROPPED
from ember.parsers.result import fold
from ember.parsers.tokens import PromptContext, TokenBytes

from .choice import ChoiceEnd, ChoiceStep, TokenInfo

TokenBytesFn = Callable[[int], bytes]
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_dumps = _JSON.encode


def sse_line(obj: Any) -> str:
    """One SSE event of compact JSON, non-ASCII kept: ``data: {...}`` and a blank line."""
    return "data: " + _dumps(obj) + "\n\n"


def sse_event(event: dict[str, Any]) -> str:
    """One named SSE event (Anthropic's and the Responses API's streams): ``event: <type>`` and the event as compact
    JSON."""
    return "event: " + event["type"] + "\ndata: " + _dumps(event) + "\n\n"


def _delta_json(delta: dict[str, Any]) -> str:
    if len(delta) == 1 and "content" in delta:
        return '{"content":' + encode_basestring(delta["content"]) + "}"
    return _dumps(delta)


@dataclass
class ChunkMeta:
    """Per-response constants of every chunk, and which optional parts the request asked for."""

    id: str
    created: int
    model: str
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's `continuous_usage_stats`: every chunk carries its choice's usage so far
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs`: alternatives per prompt token (None: not asked)
    tokens_as_ids: bool = False  # vLLM's `return_tokens_as_token_ids`: logprobs name tokens `token_id:N`
    role: str = "assistant"  # the chat message's role (`--response-role`, or the last message's; see app)
    echo: str = ""  # vLLM's chat `echo`: the text of the last message, which each reply's content starts with
    named_tool: bool = False  # `tool_choice` named one function: its call ends the choice with `stop`, as OpenAI's


def event_deltas(events: Iterable[Event]) -> list[dict[str, Any]]:
    """Group events into chat deltas, one channel per delta, in order. `Malformed` text is content;
    `Dropped` and `ToolCallEnd` surface nothing. Linear in the events' text: an open delta's pieces are joined once."""
    deltas: list[dict[str, Any]] = []
    kind: str | None = None
    target: dict[str, Any] | None = None  # where the open text goes: a delta, or a tool call entry's `function`
    key = ""  # its field ("reasoning" fills both reasoning fields)
    call = -1  # the open tool call entry's index
    parts: list[str] = []
    for ev in events:
        if isinstance(ev, ReasoningDelta):
            if not ev.text:
                continue
            if kind == "reasoning":
                parts.append(ev.text)
                continue
            _close(target, key, parts)
            target, key, parts = {"reasoning_content": "", "reasoning": ""}, "reasoning", [ev.text]
            deltas.append(target)
            kind = "reasoning"
        elif isinstance(ev, (ContentDelta, Malformed)):
            if not ev.text:
                continue
            if kind == "content":
                parts.append(ev.text)
                continue
            _close(target, key, parts)
            target, key, parts = {"content": ""}, "content", [ev.text]
            deltas.append(target)
            kind = "content"
        elif isinstance(ev, ToolCallStart):
            _close(target, key, parts)
            target, key, parts, call = {"name": ev.name, "arguments": ""}, "arguments", [], ev.index
            entry = {"index": ev.index, "id": ev.id, "type": "function", "function": target}
            if kind == "tool":
                deltas[-1]["tool_calls"].append(entry)
            else:
                deltas.append({"tool_calls": [entry]})
                kind = "tool"
        elif isinstance(ev, ToolCallArguments):
            if not ev.fragment:
                continue
            if kind == "tool" and call == ev.index:
                parts.append(ev.fragment)
                continue
            _close(target, key, parts)
            target, key, parts, call = {"arguments": ""}, "arguments", [ev.fragment], ev.index
            entry = {"index": ev.index, "function": target}
            if kind == "tool":
                deltas[-1]["tool_calls"].append(entry)
            else:
                deltas.append({"tool_calls": [entry]})
                kind = "tool"
    _close(target, key, parts)
    return deltas


def _close(target: dict[str, Any] | None, key: str, parts: list[str]) -> None:
    """Set ``target``'s ``key`` field to the joined ``parts`` (both reasoning fields for "reasoning")."""
    if target is None or not parts:
        return
    text = "".join(parts)
    if key == "reasoning":
        target["reasoning_content"] = target["reasoning"] = text
    else:
        target[key] = text


class TokenIdNames:
    """A `TokenBytesFn` whose tokens are named ``token_id:N`` in logprobs (vLLM's ``return_tokens_as_token_ids``:
    a token that is not valid UTF-8 on its own stays identifiable); their ``bytes`` are unchanged."""

    __slots__ = ("tb",)

    def __init__(self, tb: TokenBytesFn) -> None:
        self.tb = tb

    def __call__(self, token_id: int) -> bytes:
        return self.tb(token_id)


def token_names(tb: TokenBytesFn, meta: "ChunkMeta") -> TokenBytesFn:
    """``tb``, naming tokens by ID when the request asked for it."""
    return TokenIdNames(tb) if meta.tokens_as_ids else tb


def _token_str(tb: TokenBytesFn, token_id: int) -> tuple[str, list[int]]:
    b = tb(token_id)
    if isinstance(tb, TokenIdNames):
        return f"token_id:{token_id}", list(b)
    return b.decode("utf-8", errors="replace"), list(b)


def logprob_entry(tb: TokenBytesFn, tok: TokenInfo, top_n: int) -> dict[str, Any]:
    text, raw = _token_str(tb, tok.token_id)
    top = []
    for tid, lp in (tok.top or [])[:top_n]:
        t, r = _token_str(tb, tid)
        top.append({"token": t, "logprob": lp, "bytes": r})
    return {"token": text, "logprob": tok.logprob, "bytes": raw, "top_logprobs": top}


def vllm_prompt_logprobs(tb: TokenBytesFn, prompt_ids: Sequence[int], scored: Sequence[TokenLogprob],
                         top_n: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first (nothing precedes it), else a map from token ID
    (a string key) to ``{"logprob", "rank", "decoded_token"}`` holding the prompt's token and the ``top_n`` best."""
    out: list[dict[str, dict[str, Any]] | None] = [None] if prompt_ids else []
    if isinstance(tb, TokenIdNames):  # decoded_token stays the text, as in vLLM
        tb = tb.tb
    for info in scored[:max(0, len(prompt_ids) - 1)]:
        entry = {str(info.token_id): {"logprob": info.logprob, "rank": info.rank,
                                      "decoded_token": _token_str(tb, info.token_id)[0]}}
        for rank, (tid, lp) in enumerate(info.top[:top_n], 1):
            entry.setdefault(str(tid), {"logprob": lp, "rank": rank, "decoded_token": _token_str(tb, tid)[0]})
        out.append(entry)
    return out


def _chat_logprobs(tb: TokenBytesFn, tokens: Sequence[TokenInfo], top_n: int) -> dict[str, Any]:
    """`content` holds tokens that went to content; reasoning tokens go to the `reasoning_content` extension;
    delimiter, tool and dropped tokens are omitted (design decision 9)."""
    content, reasoning = [], []
    for t in tokens:
        if t.logprob is None:
            continue
        if t.channel == "content":
            content.append(logprob_entry(tb, t, top_n))
        elif t.channel == "reasoning":
            reasoning.append(logprob_entry(tb, t, top_n))
    out: dict[str, Any] = {"content": content}
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


class ChatChoiceEncoder:
    """Turns one choice's steps into `chat.completion.chunk` dicts."""

    def __init__(self, meta: ChunkMeta, index: int, token_bytes: TokenBytesFn, prompt_tokens: int = 0):
        self.meta = meta
        self.index = index
        self.tb = token_bytes
        self.prompt_tokens = prompt_tokens
        self.completed_calls = 0
        self.num_tokens = 0
        # the constant text around a chunk's delta, for `step_sse` (the same bytes as `sse_line(chunk)`)
        self._head = ('data: {"id":' + encode_basestring(meta.id) + ',"object":"chat.completion.chunk","created":'
                      + _dumps(meta.created) + ',"model":' + encode_basestring(meta.model) + ',"choices":[{"index":'
                      + _dumps(index) + ',"delta":')
        self._tail = "}]" + (',"usage":null' if meta.include_usage else "") + "}\n\n"

    def _chunk(self, delta: dict[str, Any], *, tokens: Sequence[TokenInfo] = (), finish_reason: str | None = None,
               stop_reason: str | int | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """One chunk; the one that finishes the choice also holds `stop_reason` (vLLM's chat chunks hold it there
        only)."""
        choice: dict[str, Any] = {"index": self.index, "delta": delta, "logprobs": None,
                                  "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        if tokens and self.meta.logprobs:
            choice["logprobs"] = _chat_logprobs(self.tb, tokens, self.meta.top_logprobs)
        if self.meta.return_token_ids:
            choice["token_ids"] = [t.token_id for t in tokens]
        chunk: dict[str, Any] = {"id": self.meta.id, "object": "chat.completion.chunk", "created": self.meta.created,
                                 "model": self.meta.model, "choices": [choice]}
        if self.meta.include_usage:
            chunk["usage"] = usage(self.prompt_tokens, self.num_tokens) if self.meta.continuous_usage else None
        if extra:
            chunk.update(extra)
        return chunk

    def start(self, prompt_token_ids: Sequence[int] | None = None) -> dict[str, Any]:
        """The role chunk that opens the choice (with `prompt_token_ids` when asked for)."""
        extra = {"prompt_token_ids": list(prompt_token_ids)} if (self.meta.return_token_ids
                                                                  and prompt_token_ids is not None) else None
        return self._chunk({"role": self.meta.role, "content": ""}, extra=extra)

    def echo(self) -> list[dict[str, Any]]:
        """The chunk of the echoed last message (vLLM's chat `echo`), sent after every choice's role chunk."""
        return [self._chunk({"content": self.meta.echo})] if self.meta.echo else []

    def step(self, step: ChoiceStep) -> list[dict[str, Any]]:
        self.completed_calls += sum(isinstance(e, ToolCallEnd) for e in step.events)
        self.num_tokens += len(step.tokens)
        deltas = event_deltas(step.events)
        chunks = []
        carries_tokens = bool(step.tokens) and (self.meta.return_token_ids or self.meta.logprobs)
        if not deltas and carries_tokens:
            deltas = [{}]
        for i, d in enumerate(deltas):
            chunks.append(self._chunk(d, tokens=step.tokens if i == 0 else ()))
        if step.end is not None:
            chunks.append(self._chunk({}, finish_reason=self.finish_reason(step.end),
                                      stop_reason=step.end.stop_reason))
        return chunks

    def step_sse(self, step: ChoiceStep) -> str:
        """`step`'s chunks as SSE text, equal to joining `sse_line` over `step(step)`, without building the chunk
        dicts: the id/created/model text is fixed per choice, only the delta and the per-token parts are encoded."""
        self.completed_calls += sum(isinstance(e, ToolCallEnd) for e in step.events)
        self.num_tokens += len(step.tokens)
        deltas = event_deltas(step.events)
        meta = self.meta
        carries_tokens = bool(step.tokens) and (meta.return_token_ids or meta.logprobs)
        if not deltas and carries_tokens:
            deltas = [{}]
        parts = []
        for i, d in enumerate(deltas):
            parts.append(self._chunk_sse(_delta_json(d), step.tokens if i == 0 else (), "null"))
        if step.end is not None:
            parts.append(self._chunk_sse("{}", (), encode_basestring(self.finish_reason(step.end))
                                         + ',"stop_reason":' + _dumps(step.end.stop_reason)))
        return "".join(parts)

    def _chunk_sse(self, delta_json: str, tokens: Sequence[TokenInfo], finish_json: str) -> str:
        """``finish_json``: the JSON text after ``"finish_reason":`` (with the `stop_reason` member, on the last)."""
        meta = self.meta
        lp = "null"
        if tokens and meta.logprobs:
            lp = _dumps(_chat_logprobs(self.tb, tokens, meta.top_logprobs))
        ids = ""
        if meta.return_token_ids:
            ids = ',"token_ids":[' + ",".join([str(t.token_id) for t in tokens]) + "]"
        tail = self._tail
        if meta.continuous_usage:
            tail = '}],"usage":' + _dumps(usage(self.prompt_tokens, self.num_tokens)) + "}\n\n"
        return (self._head + delta_json + ',"logprobs":' + lp + ',"finish_reason":' + finish_json + ids
                + tail)

    def finish_reason(self, end: ChoiceEnd) -> str:
        return finish_reason(end, self.completed_calls, self.meta.named_tool)


def finish_reason(end: ChoiceEnd, completed_calls: int, named_tool: bool = False) -> str:
    """`length` wins; a turn that ended after complete tool calls is `tool_calls`, except where the request named the
    function (`stop`, as OpenAI and vLLM answer a named `tool_choice`); a stop string is `stop`."""
    if end.reason == "length":
        return "length"
    if end.reason == "eos" and completed_calls and not named_tool:
        return "tool_calls"
    if end.reason == "error":
        return "error"
    return "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    """An OpenAI `usage` object; the details appear where their count is known."""
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return u


def usage_chunk(meta: ChunkMeta, u: dict[str, Any], object_name: str = "chat.completion.chunk") -> dict[str, Any]:
    return {"id": meta.id, "object": object_name, "created": meta.created, "model": meta.model, "choices": [],
            "usage": u}


def chat_body(meta: ChunkMeta, steps: Iterable[ChoiceStep], token_bytes: TokenBytesFn, *, n: int,
              prompt_token_ids: Sequence[int] | None, usage_body: dict[str, Any] | None) -> dict[str, Any]:
    """The non-streaming `chat.completion` body of ``n`` choices from their steps: each message is the fold
    (`parsers.result.fold`) of its choice's events; logprobs, token IDs, finish_reason and stop_reason follow the
    chunks' rules."""
    events: list[list[Event]] = [[] for _ in range(n)]
    tokens: list[list[TokenInfo]] = [[] for _ in range(n)]
    ends: list[ChoiceEnd | None] = [None] * n
    scored: list[TokenLogprob] = []
    for step in steps:
        events[step.index] += step.events
        tokens[step.index] += step.tokens
        if step.end is not None:
            ends[step.index] = step.end
        if step.prompt_logprobs is not None and step.index == 0:
            scored = step.prompt_logprobs
    choices = []
    for idx in range(n):
        out = fold(events[idx])
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in out.tool_calls]
        content = meta.echo + out.content
        said = bool(content) or not (calls or out.reasoning)  # a reply of only calls or only a thought: null
        msg: dict[str, Any] = {"role": meta.role, "content": content if said else None}
        if out.reasoning:
            msg["reasoning_content"] = out.reasoning
            msg["reasoning"] = out.reasoning
        if calls:
            msg["tool_calls"] = calls
        end = ends[idx]
        reason = finish_reason(end, out.completed_calls, meta.named_tool) if end else None
        choice: dict[str, Any] = {"index": idx, "message": msg, "finish_reason": reason,
                                  "stop_reason": end.stop_reason if end else None, "logprobs": None}
        if meta.logprobs and tokens[idx]:
            choice["logprobs"] = _chat_logprobs(token_bytes, tokens[idx], meta.top_logprobs)
        if meta.return_token_ids:
            choice["token_ids"] = [t.token_id for t in tokens[idx]]
        choices.append(choice)
    body: dict[str, Any] = {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
                            "choices": choices, "usage": usage_body}
    if meta.return_token_ids and prompt_token_ids is not None:
        body["prompt_token_ids"] = list(prompt_token_ids)
    if meta.prompt_logprobs is not None and prompt_token_ids is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(token_bytes, prompt_token_ids, scored, meta.prompt_logprobs)
    return body


class CompletionChoiceEncoder:
    """Turns one choice's steps into `text_completion` chunks (the legacy completions API: all text is `text`)."""

    def __init__(self, meta: ChunkMeta, index: int, token_bytes: TokenBytesFn, *, echo: str | None = None,
                 prompt_tokens: int = 0, echo_offsets: Sequence[int] | None = None,
                 prompt: PromptContext = PromptContext()):
        """``echo_offsets``: the prompt tokens' ``text_offset``s in ``echo`` (`prompt_text_offsets`), for an echo
        with logprobs. ``prompt``: the context the choice's pipeline continued (its ``prompt_context``), which the
        generated tokens' offsets follow. An echo is the prompt's text as it reads alone, the output's as it continues
        it (vLLM's concatenation): a character the prompt left unfinished is U+FFFD in the echo and whole in the
        output when the output finishes it."""
        self.meta = meta
        self.index = index
        self.tb = token_bytes
        self.prompt_tokens = prompt_tokens
        self.echo = echo
        self.echo_offsets = list(echo_offsets) if echo_offsets is not None else None
        self.prompt_ids: list[int] = []
        self.pending_echo: dict[str, Any] | None = None  # with logprobs, the echo waits for the prompt's scores
        self.offsets = TextOffsets(len(echo or ""), prompt)  # the generated tokens' `text_offset`s, after the echo
        self.text_len = 0  # characters of `text` sent so far (the echo's included)
        self.waiting: deque[tuple[TokenInfo, int]] = deque()  # with logprobs: tokens starting past the text sent
        self.num_tokens = 0

    def _add_logprob(self, lp: dict[str, list], token_id: int, logprob: float | None,
                     top: Sequence[tuple[int, float]] | None, offset: int) -> None:
        """Append one token at ``offset`` to a legacy ``logprobs`` object (``top`` None: no alternatives, as for the
        prompt's first token); its ``top_logprobs`` hold the token itself and the best ``top_logprobs`` others, as
        vLLM's."""
        s, _ = _token_str(self.tb, token_id)
        lp["tokens"].append(s)
        lp["token_logprobs"].append(logprob)
        alternatives = None
        if top is not None:
            alternatives = {} if logprob is None else {s: logprob}
            for tid, v in top[:self.meta.top_logprobs]:
                alternatives.setdefault(_token_str(self.tb, tid)[0], v)
        lp["top_logprobs"].append(alternatives)
        lp["text_offset"].append(offset)

    def _chunk(self, text: str, tokens: Sequence[TokenInfo], finish_reason: str | None,
               extra: dict[str, Any] | None = None, *, offsets: Sequence[int] = (),
               stop_reason: str | int | None = None) -> dict[str, Any]:
        """``offsets``: the ``tokens``' `text_offset`s, with logprobs. Every chunk holds `stop_reason`, as vLLM's."""
        choice: dict[str, Any] = {"index": self.index, "text": text, "logprobs": None, "finish_reason": finish_reason,
                                  "stop_reason": stop_reason}
        self.text_len += len(text)
        if self.meta.logprobs and tokens:
            lp = _legacy_logprobs()
            for t, at in zip(tokens, offsets):
                self._add_logprob(lp, t.token_id, t.logprob, t.top or [], at)
            choice["logprobs"] = lp
        if self.meta.return_token_ids:
            choice["token_ids"] = [t.token_id for t in tokens]
        if extra:  # vLLM's stream choice holds `prompt_token_ids` (chat's chunk holds it at the top)
            choice.update(extra)
        chunk: dict[str, Any] = {"id": self.meta.id, "object": "text_completion", "created": self.meta.created,
                                 "model": self.meta.model, "choices": [choice]}
        if self.meta.include_usage:
            chunk["usage"] = usage(self.prompt_tokens, self.num_tokens) if self.meta.continuous_usage else None
        return chunk

    def start(self, prompt_token_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:
        self.prompt_ids = list(prompt_token_ids or ())
        extra = {"prompt_token_ids": list(prompt_token_ids)} if (self.meta.return_token_ids
                                                                  and prompt_token_ids is not None) else None
        if self.echo is not None and self.meta.logprobs:
            self.pending_echo = extra or {}
            return []
        if self.echo or extra:
            return [self._chunk(self.echo or "", (), None, extra)]
        return []

    def _echo_chunk(self, scored: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        """The echoed prompt with its tokens' logprobs (the first token has none: nothing precedes it)."""
        extra, self.pending_echo = self.pending_echo, None
        chunk = self._chunk(self.echo or "", (), None, extra or None)
        if scored is not None and self.prompt_ids:
            lp = _legacy_logprobs()
            offsets = self.echo_offsets or [0] * len(self.prompt_ids)
            end, at = len(self.echo or ""), 0
            for k, tid in enumerate(self.prompt_ids):
                info = scored[k - 1] if 0 < k <= len(scored) else None
                at = min(max(at, offsets[k] if k < len(offsets) else end), end)  # within the echo, never back
                self._add_logprob(lp, tid, None if info is None else info.logprob,
                                  None if info is None else info.top or [], at)
            chunk["choices"][0]["logprobs"] = lp
        return chunk

    def step(self, step: ChoiceStep) -> list[dict[str, Any]]:
        text = "".join(d.get("content", "") + d.get("reasoning_content", "") for d in event_deltas(step.events))
        chunks = []
        if self.pending_echo is not None and (step.prompt_logprobs is not None or step.end is not None):
            chunks.append(self._echo_chunk(step.prompt_logprobs))  # its usage: none of this step's tokens yet
        self.num_tokens += len(step.tokens)
        if self.meta.prompt_logprobs is not None and step.prompt_logprobs is not None:
            chunk = self._chunk("", (), None)
            chunk["choices"][0]["prompt_logprobs"] = vllm_prompt_logprobs(
                self.tb, self.prompt_ids, step.prompt_logprobs, self.meta.prompt_logprobs)
            chunks.append(chunk)
        tokens, offsets = self._released(step, self.text_len + len(text))
        if text or (tokens and (self.meta.return_token_ids or self.meta.logprobs)):
            chunks.append(self._chunk(text, tokens, None, offsets=offsets))
        if step.end is not None:
            reason = "length" if step.end.reason == "length" else ("error" if step.end.reason == "error" else "stop")
            chunks.append(self._chunk("", (), reason, stop_reason=step.end.stop_reason))
        return chunks

    def _released(self, step: ChoiceStep, text_len: int) -> tuple[Sequence[TokenInfo], list[int]]:
        """The tokens to send with ``step``'s text (which makes the text ``text_len`` long), and with logprobs their
        `text_offset`s. A token whose text starts past it (text held back for a stop string) waits, its ID and
        logprob with it, until the text reaches its offset; at the end the rest go, at most at the text's end (the
        stop string cut their text), so each offset is the one in the whole text."""
        if not self.meta.logprobs:
            return step.tokens, []
        waiting = self.waiting
        for t in step.tokens:
            # a token whose text the pipeline dropped (EOS under ignore_eos, a skipped special) adds no text
            waiting.append((t, self.offsets.next(b"" if t.channel == DROPPED else self.tb(t.token_id))))
        out = []  # the released tokens leave from the front: held text must not cost a copy of the rest per step
        while waiting and (step.end is not None or waiting[0][1] <= text_len):
            out.append(waiting.popleft())
        return [t for t, _ in out], [min(at, text_len) for _, at in out]


def prompt_text_offsets(tb: TokenBytes, ids: Sequence[int], drop: Collection[int] = ()) -> tuple[str, list[int]]:
    """The text a prompt of token ``ids`` reads as, and each token's ``text_offset`` in it: the tokens' bytes as UTF-8
    (U+FFFD for broken sequences), a token of ``drop`` (BOS, EOS, pad: what the output pipeline drops) adding none,
    less the one leading space a SentencePiece decoder drops, as ``tokenizer.decode`` gives it. A token that adds no
    text has the offset where the next text starts."""
    offsets = TextOffsets()
    at: list[int] = []
    parts: list[bytes] = []
    for tid in ids:
        raw = b"" if tid in drop else tb.token_bytes(tid)
        at.append(offsets.next(raw))
        parts.append(raw)
    text = b"".join(parts).decode("utf-8", "replace")
    if tb.strips_leading_space and text.startswith(" "):
        text = text[1:]
        at = [max(0, o - 1) for o in at]
    return text, at


def literal_prompt_offsets(tb: TokenBytes, ids: Sequence[int], plain: Sequence[int]
                           ) -> tuple[str, list[int]] | None:
    """`prompt_text_offsets` for prompt text the tokenizer encoded as ``ids``, ``plain`` without the special tokens it
    adds: each token of ``plain`` keeps its text (a special token's, such as ``<|im_end|>``, when the text spelled
    it) and the tokens added around it (BOS, EOS) add none. None when ``plain`` is not a run of ``ids``."""
    for k in range(len(ids) - len(plain) + 1):
        if list(ids[k:k + len(plain)]) == list(plain):
            text, at = prompt_text_offsets(tb, plain)
            return text, [0] * k + at + [len(text)] * (len(ids) - k - len(plain))
    return None


def given_text_offsets(tokenizer: Any, text: str, ids: Sequence[int]) -> list[int] | None:
    """Each token's ``text_offset`` in prompt ``text`` as the client sent it, where the tokenizer normalises it (NFC:
    the tokens' own text is not ``text``): a fast tokenizer's offset mapping into the original string, a token with
    no span of its own (an added BOS or EOS) at the offset where the next text starts. None when the tokenizer maps
    no offsets or its encoding is not ``ids``."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    try:
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    except (NotImplementedError, ValueError):
        return None
    if list(enc["input_ids"]) != list(ids):
        return None
    at, following = [0] * len(ids), len(text)
    for i in range(len(ids) - 1, -1, -1):
        start, end = enc["offset_mapping"][i]
        if end > start:
            following = start
        at[i] = following
    return at


class TextOffsets:
    """Legacy ``text_offset``s: where, in the text that tokens' bytes decode to (after ``length`` characters already
    there), each token's text starts, i.e. the character holding its first byte; a token inside a character split
    across tokens shares that character's offset, and a token that completes no character advances nothing. The text
    continues ``prompt`` as the output pipeline's does: its first bytes may finish the prompt's unfinished character
    (which starts at ``length``), and its leading space may be dropped."""

    __slots__ = ("_decoder", "length", "_strip")

    def __init__(self, length: int = 0, prompt: PromptContext = PromptContext()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._decoder.decode(prompt.tail)
        self._strip = prompt.strip_space
        self.length = length

    def next(self, raw: bytes) -> int:
        """The offset of the token of bytes ``raw``, which comes after those already given."""
        held = self._decoder.getstate()[0]
        at = self.length
        if held and raw and not _continues(held, raw[0]):
            at += len(held.decode("utf-8", "replace"))  # the held bytes end as U+FFFD before this token's text
        text = self._decoder.decode(raw)
        if self._strip and text:
            self._strip = False
            text = text[1:] if text[0] == " " else text
        self.length += len(text)
        return at


def _continues(held: bytes, byte: int) -> bool:
    """Whether ``byte`` extends the incomplete UTF-8 sequence ``held``."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(held + bytes((byte,)))
    except UnicodeDecodeError:
        return False
    return True


def _legacy_logprobs() -> dict[str, list]:
    """An empty legacy (`text_completion`) ``logprobs`` object."""
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def fold_completion(chunks: Iterable[dict[str, Any]], *, usage_body: dict[str, Any] | None) -> dict[str, Any]:
    """The non-streaming `text_completion` body: the fold of its chunks."""
    head = None
    prompt_ids: dict[int, list[int]] = {}
    texts: dict[int, list[str]] = {}
    lps: dict[int, dict[str, list]] = {}
    tids: dict[int, list[int]] = {}
    scored: dict[int, list] = {}
    reasons: dict[int, str | None] = {}
    stops: dict[int, str | int | None] = {}
    for ch in chunks:
        head = head or ch
        for c in ch["choices"]:
            i = c["index"]
            texts.setdefault(i, []).append(c["text"])
            reasons.setdefault(i, None)
            if "prompt_token_ids" in c:
                prompt_ids[i] = c["prompt_token_ids"]
            if c.get("logprobs"):
                acc = lps.setdefault(i, _legacy_logprobs())
                for k in acc:
                    acc[k].extend(c["logprobs"][k])
            if "token_ids" in c:
                tids.setdefault(i, []).extend(c["token_ids"])
            if "prompt_logprobs" in c:
                scored[i] = c["prompt_logprobs"]
            if c.get("finish_reason") is not None:
                reasons[i] = c["finish_reason"]
                stops[i] = c.get("stop_reason")
    assert head is not None
    out = []
    for i in sorted(texts):
        text = "".join(texts[i])
        choice: dict[str, Any] = {"index": i, "text": text, "logprobs": lps.get(i),
                                  "finish_reason": reasons[i], "stop_reason": stops.get(i)}
        if i in tids or i in prompt_ids:
            choice["token_ids"] = tids.get(i, [])
            choice["prompt_token_ids"] = prompt_ids.get(i)
        if i in scored:
            choice["prompt_logprobs"] = scored[i]
        out.append(choice)
    return {"id": head["id"], "object": "text_completion", "created": head["created"], "model": head["model"],
            "choices": out, "usage": usage_body}
