"""`POST /v1/embeddings`, in the OpenAI API's request and response shapes (what `client.embeddings.create` sends
and reads, ``encoding_format: "base64"`` included), with vLLM's `truncate_prompt_tokens` and `add_special_tokens`,
and vLLM's chat form: ``messages`` instead of ``input``, rendered by the chat template into one input (no generation
prompt unless ``add_generation_prompt``; no special tokens beyond the template's unless ``add_special_tokens``).

Each input is one engine pooling request (`ember.engine.pooling`), run next to generation in the same steps; the
pooled vector is cut to ``dimensions`` (Matryoshka models only) and then normalized as the model's `PoolingSpec`
says. A client that hangs up aborts every input still running.
"""
from __future__ import annotations

import asyncio
import base64
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Literal

import numpy as np
from fastapi import Request
from pydantic import Field

from ember.engine.client import EngineDeadError
from ember.engine.params import SamplingParams

from . import chat
from . import protocol_openai as po
from .admission import (check_capacity, check_model, check_token_ids, client_request_id, collect, model_label,
                        request_names, state, tokens_to_keep)
from .errors import ApiError, bad_request
from .generation import ModelRuntime
from .metrics import Metrics

MAX_INPUTS = 2048
"""Inputs one request may carry (the OpenAI API's limit)."""


def check_count(n: int, most: int, what: str, param: str) -> None:
    """A 400 naming ``param`` when the request sent more than ``most`` of ``what`` (it sent ``n``)."""
    if n > most:
        raise bad_request(f"at most {most} {what} per request, got {n}", param=param)


class PoolingInputs(po._Lenient):
    """The inputs of a pooling route (embeddings, classify): ``input``, or vLLM's chat form ``messages``."""

    model: str | None = None
    input: po.Prompt | None = None
    messages: list[po.ChatMessage] | None = Field(default=None, min_length=1)
    user: str | None = None
    truncate_prompt_tokens: po.TruncatePromptTokens = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused, as on chat

    def check_form(self) -> None:
        """Exactly one of ``input`` and ``messages``, with only the options that form takes (400 naming the field)."""
        if (self.input is None) == (self.messages is None):
            raise bad_request("send exactly one of input (texts or token IDs) and messages (a conversation)",
                              param="input")
        if self.chat_template is not None:
            raise bad_request(f"Invalid value for 'chat_template': {po.REQUEST_TEMPLATE_REFUSED}",
                              param="chat_template")
        if self.messages is None:
            for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
                if getattr(self, name) not in (None, False):
                    raise bad_request(f"{name} applies to messages only", param=name)
        elif self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt exclude each other",
                              param="continue_final_message")

    @property
    def single(self) -> bool:
        """One input (a string, one token-ID list or a conversation), answered as ``data[0]``."""
        x = self.input
        return x is None or isinstance(x, str) or (bool(x) and isinstance(x[0], int))

    def inputs(self) -> list[str | list[int]]:
        """The ``input`` inputs as a list: texts, or token-ID lists."""
        x = self.input
        assert x is not None
        return [x] if self.single else list(x)

    async def resolved(self, rt: ModelRuntime) -> tuple[list[str | list[int]], list[str], bool]:
        """``(inputs, the field naming each, add_special_tokens)``: the ``input`` items, or the conversation
        rendered into token IDs."""
        self.check_form()
        if self.messages is not None:
            return [await asyncio.to_thread(_conversation_ids, rt, self)], ["messages"], False
        inputs = self.inputs()
        check_count(len(inputs), MAX_INPUTS, "inputs", "input")
        params = ["input"] if self.single else [f"input[{i}]" for i in range(len(inputs))]
        return inputs, params, self.add_special_tokens is not False


class ActivationSwitch(po._Lenient):
    """vLLM's switch of a classifier's or cross-encoder's activation: ``use_activation`` (``activation``, its older
    spelling); false returns the raw logits."""

    use_activation: bool | None = None
    activation: bool | None = None

    @property
    def activates(self) -> bool:
        return self.use_activation if self.use_activation is not None else self.activation is not False


class EmbeddingRequest(PoolingInputs):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM's; unset: as the model's pooling says
    use_activation: bool | None = None  # vLLM's newer spelling of normalize

    @property
    def normalized(self) -> bool | None:
        """Whether the request asks for unit vectors (`normalize`, else `use_activation`); None: the model's way."""
        return self.normalize if self.normalize is not None else self.use_activation


def _conversation_ids(rt: ModelRuntime, body: PoolingInputs) -> list[int]:
    """``messages`` rendered by the chat template, as one prompt's token IDs."""
    assert body.messages is not None
    return rt.prompt_ids(chat.openai_messages(body.messages), add_generation_prompt=body.add_generation_prompt,
                         continue_final_message=body.continue_final_message,
                         kwargs=rt.template_kwargs(body.chat_template_kwargs),
                         add_special_tokens=bool(body.add_special_tokens),
                         size_param="messages" if body.truncate_prompt_tokens is None else None)


def prompt_limit(rt: ModelRuntime) -> int:
    """The most tokens one pooled prompt may have: the context, or the whole KV cache where that is smaller."""
    return min(rt.max_model_len, rt.model_info.kv_capacity_tokens)


def align(full: list[int], parts: list[list[int]]) -> list[int] | None:
    """Where each of ``parts`` (texts' tokens without special tokens, in order) starts in ``full`` (their encoding
    with the special tokens a tokenizer adds before, between and after them); None where ``full`` does not hold the
    parts in that order."""
    after = [sum(map(len, parts[i + 1:])) for i in range(len(parts))]

    def place(i: int, at: int) -> list[int] | None:
        if i == len(parts):
            return []
        n = len(parts[i])
        for s in range(at, len(full) - n - after[i] + 1):
            if full[s:s + n] == parts[i] and (tail := place(i + 1, s + n)) is not None:
                return [s, *tail]
        return None

    return place(0, 0)


def too_few(keep: int, specials: int) -> ApiError:
    """The 400 for a `truncate_prompt_tokens` that leaves no room for the tokenizer's own special tokens."""
    return bad_request(f"truncate_prompt_tokens ({keep}) is less than the {specials} special tokens the tokenizer "
                       f"adds to each input", param="truncate_prompt_tokens")


def too_long(n: int, rt: ModelRuntime, param: str) -> ApiError:
    """The 400 naming ``param`` for an input of ``n`` tokens, over `prompt_limit`, the most one pooled prompt may
    have: the model's context length, or the KV cache's size where that is smaller (named as such)."""
    limit = prompt_limit(rt)
    what = (f"this model's maximum context length is {limit} tokens" if limit >= rt.max_model_len
            else f"the server's KV cache holds {limit} tokens in all")
    return ApiError(400, f"The input has {n} tokens, but {what} (send truncate_prompt_tokens to keep the last ones)",
                    param=param, code="context_length_exceeded")


def keep_last(full: list[int], content: list[int], keep: int) -> list[int]:
    """``full`` (``content`` encoded with special tokens) cut to its last ``keep`` tokens, keeping the special tokens
    the tokenizer added around the content: those and the content's last tokens (``full``'s plain last ``keep``
    tokens where the special tokens cannot be told apart from the content)."""
    if len(full) <= keep:
        return full
    at = align(full, [content])
    if at is None:
        return full[-keep:]
    specials = len(full) - len(content)
    if keep < specials:
        raise too_few(keep, specials)
    start, end = at[0], at[0] + len(content)
    return full[:start] + content[len(content) - (keep - specials):] + full[end:]


def _token_lists(rt: ModelRuntime, st: Any, inputs: list[str | list[int]], params: list[str],
                 truncate: int | None, add_special_tokens: bool,
                 type_starts: list[int | None] | None = None) -> list[tuple[list[int], int | None]]:
    """Each input's token IDs, truncated to the last ``truncate`` tokens (-1: as many as fit; a text keeps the special
    tokens its encoding adds, as `keep_last` cuts it) and checked against the context and the KV cache (a problem is
    a 400 naming ``params[i]``), with its first position of token type 1: ``type_starts[i]`` for a pair's token list
    (None: the model finds it), else past the end (one segment: a text, or token IDs as transformers reads them)."""
    limit = prompt_limit(rt)
    keep = tokens_to_keep(truncate, limit)
    texts = [x for x in inputs if isinstance(x, str)]
    if not keep:
        for x, param in zip(inputs, params):
            if isinstance(x, str):
                rt.check_text_size(x, param)
    encoded: list[list[int]] = []
    if texts:  # batched calls: the tokenizer's Rust side runs the texts in parallel
        encoded = [list(x) for x in rt.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]
    if keep and (long := [j for j, x in enumerate(encoded) if len(x) > keep]):
        contents = (rt.tokenizer([texts[j] for j in long], add_special_tokens=False)["input_ids"]
                    if add_special_tokens else [encoded[j] for j in long])
        for j, content in zip(long, contents):
            encoded[j] = keep_last(encoded[j], list(content), keep)
    next_text = iter(encoded)
    out = []
    for i, (x, param) in enumerate(zip(inputs, params)):
        if isinstance(x, str):
            ids = next(next_text)
            start = len(ids)
        else:
            ids = list(x)
            check_token_ids(st, ids, param)
            start = type_starts[i] if type_starts is not None else len(ids)  # a token list alone is one segment
            if keep and len(ids) > keep:
                start = None if start is None else max(0, start - (len(ids) - keep))
                ids = ids[-keep:]
        if not ids:
            raise bad_request("an input must have at least one token", param=param)
        if len(ids) > limit:
            raise too_long(len(ids), rt, param)
        out.append((ids, start))
    return out


def _encode(vec: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


def _finish(pooled: list[float], dimensions: int | None, normalize: bool) -> np.ndarray:
    """The embedding a client gets: cut to ``dimensions``, then scaled to unit length when ``normalize``."""
    vec = np.asarray(pooled, dtype=np.float32)
    if dimensions is not None:
        vec = vec[:dimensions]
    if normalize:
        vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    return vec


def _observe_pooled(metrics: Metrics, prompt_len: int, arrival: float, out: Any) -> None:
    """vLLM's per-request histograms for one pooled input, as vLLM observes a pooling request: its result is its
    first and last output (time to first token, end to end), with no token generated."""
    now = time.monotonic()
    if out.queue_seconds is not None:
        metrics.queue_time.observe(out.queue_seconds)
    metrics.ttft.observe(now - arrival)
    metrics.e2e.observe(now - arrival)
    metrics.choice_ran(prompt_len, 0, None, now, now, out.scheduled_at)
    metrics.prompt_done(1, 0)


async def _pooled(rt: ModelRuntime, typed: list[tuple[list[int], int | None]], request_id: str,
                  lora: str | None, metrics: Metrics) -> AsyncIterator[dict]:
    """``{"index", "pooled"}`` for each (prompt, token type start) as it finishes, the prompts running as concurrent
    engine requests, each counted in ``metrics`` as it ends (a refused one is a 400, not a finished request).
    Closing the iterator aborts those still running; a refusal or failure raises (400 or 500)."""
    prompts = [p for p, _ in typed]

    async def one(i: int) -> dict:
        params = SamplingParams(pooling=rt.pooling.kind, lora=lora, token_type_start=typed[i][1])
        rid, arrival, reason = f"{request_id}-{i}", time.monotonic(), "cancelled"
        if rt.request_log is not None:
            rt.request_log.received(rid, prompts[i], params, rt.tokenizer.decode)
        try:
            async with aclosing(rt.engine.generate(prompts[i], params, request_id=rid)) as gen:
                async for out in gen:
                    if out.finished:
                        if out.embedding is None:
                            reason = out.finish_reason or "error"
                            raise ApiError(500, f"embedding failed: {out.error or out.finish_reason}")
                        reason = "pooled"
                        _observe_pooled(metrics, len(prompts[i]), arrival, out)
                        return {"index": i, "pooled": out.embedding}
            raise ApiError(500, "embedding failed: the engine ended the request without a result")
        except ValueError:
            reason = "rejected"
            raise
        finally:
            if reason != "rejected":
                metrics.finished(reason)
            if rt.request_log is not None:
                rt.request_log.finished(rid, reason, len(prompts[i]), 0, arrival)

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
    try:
        for done in asyncio.as_completed(tasks):
            try:
                yield await done
            except ValueError as e:  # the engine refused the request at admission
                raise bad_request(f"the engine cannot serve this input: {e}", param="input") from None
            except EngineDeadError as e:
                raise ApiError(500, f"embedding failed: {e}") from None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def pool(request: Request, inputs: list[str | list[int]], params: list[str], *, truncate: int | None,
               add_special_tokens: bool = True, lora: str | None = None,
               type_starts: list[int | None] | None = None) -> tuple[list[list[float]], int, str]:
    """What the engine pools for each of ``inputs`` (in order: an embedding, or a classifier's logits), their total
    token count and the request id: each input checked (errors name ``params[i]``) and run as an engine pooling
    request (under LoRA adapter ``lora`` when given). What the embedding, classify and score routes share; a token
    list's ``type_starts[i]`` is where its second segment begins (a pair encoding's token type 1)."""
    st = state(request)
    rt = st.runtime
    if not inputs:
        raise bad_request(f"{params[0] if params else 'input'} must not be empty", param="input")
    prompts = await asyncio.to_thread(_token_lists, rt, st, inputs, params, truncate, add_special_tokens,
                                      type_starts)
    check_capacity(st)
    total = sum(len(p) for p, _ in prompts)
    st.metrics.prompt_tokens.inc(total)
    rid, engine_id = request_names(client_request_id(request))
    results = await collect(request, _pooled(rt, prompts, engine_id, lora, st.metrics))
    out: list[list[float]] = [[] for _ in prompts]
    for r in results:
        out[r["index"]] = r["pooled"]
    return out, total, rid


async def embed(request: Request, inputs: list[str | list[int]], params: list[str], *, truncate: int | None,
                add_special_tokens: bool = True, dimensions: int | None = None, normalize: bool | None = None,
                lora: str | None = None) -> tuple[list[np.ndarray], int, str]:
    """The embeddings of ``inputs`` (in order), their total token count and the request id: `pool`, then each cut
    to ``dimensions`` and normalized as ``normalize`` says, else as the model's pooling says."""
    rt = state(request).runtime
    spec = rt.pooling
    if rt.model_info.labels:
        raise bad_request(f"this model is a classifier ({rt.model_info.architecture}): it serves /classify, /score "
                          f"and /rerank, not embeddings", param="model")
    if spec.refused:
        raise bad_request(f"this model's embeddings are not served: {spec.refused}; start the server with "
                          f"--pooler-config to choose a pooling", param="model")
    pooled, total, rid = await pool(request, inputs, params, truncate=truncate, add_special_tokens=add_special_tokens,
                                    lora=lora)
    unit = spec.normalize if normalize is None else normalize
    return [_finish(p, dimensions, unit) for p in pooled], total, rid


async def create_embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    st = state(request)
    rt = st.runtime
    lora = check_model(st, body.model)
    inputs, params, add_special = await body.resolved(rt)
    if body.dimensions is not None and (why := rt.pooling.check_dimensions(body.dimensions)):
        raise bad_request(why, param="dimensions")
    vectors, total, rid = await embed(request, inputs, params, truncate=body.truncate_prompt_tokens,
                                      add_special_tokens=add_special, dimensions=body.dimensions,
                                      normalize=body.normalized, lora=lora)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"id": f"embd-{rid}", "object": "list", "created": int(time.time()), "model": model_label(st, lora),
            "data": data,
            "usage": {"prompt_tokens": total, "total_tokens": total}}


def add_routes(app: Any, dependencies: list[Any]) -> None:
    """Serve the route on `app`, behind `dependencies` (the app's API-key check)."""
    app.add_api_route("/v1/embeddings", create_embeddings, methods=["POST"], dependencies=dependencies)
