"""What every generation endpoint shares: the app's state, the API-key check, admission (model, token limits,
capacity, token IDs, grammar constraints) and the run of a request's steps (usage counts, errors, client hang-ups).
"""
from __future__ import annotations

import asyncio
import hmac
import secrets
import time
import weakref
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request

from ember.engine.client import UnknownAdapterError
from ember.grammar import answer_field
from ember.parsers.pipeline import ParserSetup

from .call_limit import first_call_only
from .choice import ChoiceStep
from .config import ServeConfig
from .errors import ApiError, bad_request, openai_error_body, prompt_too_long
from .generation import ChoiceSpec, GenRequest, ModelRuntime, run_choices
from .metrics import Metrics
from .openai_encoder import sse_line
from .reasoning_filter import without_reasoning
from .background_responses import BackgroundResponses
from .response_store import ResponseStore

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class AdmittedChoices:
    """Choices the front end admitted that have not ended. The engine's own counts arrive with its steps, so a burst
    of requests between two steps would all see the same number waiting; admission counts what it let in itself."""

    def __init__(self) -> None:
        self.count = 0

    def hold(self, req: GenRequest) -> None:
        """Count ``req``'s choices until each one's run ends, or all of them when ``req`` is dropped unrun (a client
        that left before its stream started)."""
        left = [len(req.choices)]
        self.count += left[0]

        def end_one() -> None:
            if left[0]:
                left[0] -= 1
                self.count -= 1

        def end_all() -> None:
            self.count -= left[0]
            left[0] = 0

        req.choice_ended = end_one
        weakref.finalize(req, end_all)


@dataclass
class ServerState:
    """The app's state: the one place mutable server-wide data lives."""

    config: ServeConfig
    runtime: ModelRuntime
    metrics: Metrics
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0))  # stored /v1/responses results
    background: BackgroundResponses = field(default_factory=BackgroundResponses)  # /v1/responses still running
    started: int = field(default_factory=lambda: int(time.time()))
    engine_dead: str | None = None  # why the engine stopped, once it died
    admitted: AdmittedChoices = field(default_factory=AdmittedChoices)
    lora_updates: asyncio.Lock = field(default_factory=asyncio.Lock)  # one runtime LoRA load/unload at a time
    server_load: int = 0  # requests being served on /load's routes (counted with --enable-server-load-tracking)


def state(request: Request) -> ServerState:
    return request.app.state.ember


# ---------------------------------------------------------------------------------------------------------- admission

_KEY_CHECKED = "ember.api_key_checked"


async def require_api_key(request: Request) -> None:
    """401 unless the request carries one of the server's API keys (none configured: every request passes); checked
    once per request: `ember.server.body_check.CheckedRoute` checks it before the body is read and marks the scope."""
    if request.scope.get(_KEY_CHECKED):
        return
    keys = state(request).config.api_key
    if isinstance(keys, str):
        keys = (keys,)
    if not keys:
        return
    auth = request.headers.get("authorization", "")
    bearer = auth[7:] if auth[:7].lower() == "bearer " else ""
    given = [g.encode() for g in (request.headers.get("x-api-key"), bearer) if g]
    if not any([hmac.compare_digest(g, k.encode()) for g in given for k in keys]):
        raise ApiError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                       code="invalid_api_key")
    request.scope[_KEY_CHECKED] = True


def check_model(st: ServerState, model: str | None) -> str | None:
    """The LoRA adapter a request's ``model`` names, or None for the base model (also when ``model`` is absent or
    empty, as vLLM reads it); a 404 naming what this server serves otherwise."""
    return resolve_model(st.runtime, model)


def resolve_model(rt: Any, model: str | None) -> str | None:
    """`check_model` for a runtime (`ember.server.generation.ModelRuntime`)."""
    if not model or model == rt.model_name or model in rt.model_aliases:
        return None
    adapters = [name for name, _ in rt.model_info.lora_adapters]
    if model in adapters:
        return model
    served = ", ".join(f"'{n}'" for n in [rt.model_name, *rt.model_aliases, *adapters])
    raise model_not_found(f"The model '{model}' does not exist; this server serves {served}")


def model_not_found(message: str) -> ApiError:
    """The 404 of a request whose ``model`` names nothing this server serves."""
    return ApiError(404, message, param="model", code="model_not_found")


def check_logprobs(st: ServerState, **asked: int | None) -> None:
    """A 400 naming the field when a request asks for more alternatives per token than ``--max-logprobs`` (-1 asks
    for the whole vocabulary)."""
    most = st.config.max_logprobs
    if most < 0:
        return
    for name, value in asked.items():
        if value == -1:
            raise bad_request(f"{name} -1 (the whole vocabulary) needs the server's --max-logprobs -1; it allows at "
                              f"most {most}", param=name)
        if value is not None and value > most:
            raise bad_request(f"{name} may be at most {most} (the server's --max-logprobs), got {value}", param=name)


def model_label(st: ServerState, lora: str | None) -> str:
    """The ``model`` a response carries: the adapter's name under an adapter, else the served model's."""
    return lora or st.runtime.model_name


def check_generates(st: ServerState) -> None:
    """A classifier or an encoder generates nothing: every generation route calls this first, so such a request is
    a 400 naming ``model`` before its prompt is rendered or any stream starts."""
    info = st.runtime.model_info
    if info.labels:
        raise bad_request(f"this model is a classifier ({info.architecture}): it serves /classify, /score and "
                          f"/rerank and does not generate", param="model")
    if info.encoder:
        raise bad_request(f"this model is an encoder ({info.architecture}): it serves /v1/embeddings, /v1/score "
                          f"and /v1/rerank and does not generate", param="model")


def allowed_tokens(st: ServerState, prompt_len: int, requested: int | None, min_tokens: int = 0,
                param: str = "messages") -> int:
    """Tokens the reply may have: the request's limit (unset: the sampling defaults' ``max_new_tokens``, when the
    generation config has one) within the server's cap (`SamplingDefaults.max_tokens_cap`), clamped to what the
    context and the whole KV cache leave (a sequence can never outgrow the cache, so a larger limit would only be
    refused later, mid-stream). A prompt the engine would refuse for its length is a 400 here, before any stream
    opens."""
    defaults = st.runtime.sampling_defaults
    if requested is None:
        requested = defaults.max_new_tokens
    if defaults.max_tokens_cap is not None:
        requested = defaults.max_tokens_cap if requested is None else min(requested, defaults.max_tokens_cap)
    limit = st.runtime.max_model_len
    if prompt_len >= limit:
        raise prompt_too_long(f"The prompt has {prompt_len} tokens, but this model's maximum context length is "
                              f"{limit} tokens (prompt plus at least one generated token)", param, prompt_len,
                              limit - 1)
    cache_tokens = st.runtime.model_info.kv_capacity_tokens
    if prompt_len >= cache_tokens:
        raise prompt_too_long(f"The prompt has {prompt_len} tokens, but the server's KV cache holds {cache_tokens} "
                              f"tokens in all (prompt plus at least one generated token)", param, prompt_len,
                              cache_tokens - 1)
    most = st.runtime.model_info.max_prompt_tokens
    if most is not None and prompt_len > most:
        raise prompt_too_long(f"The prompt has {prompt_len} tokens, but this server prefills at most {most} tokens "
                              f"at once (--max-num-batched-tokens, with chunked prefill disabled)", param,
                              prompt_len, most)
    room = context_room(st, prompt_len)
    allowed = room if requested is None else min(requested, room)
    if min_tokens > allowed:
        raise bad_request(f"min_tokens ({min_tokens}) is larger than the {allowed} tokens this reply may have "
                          f"(max_tokens and the context left by the prompt)", param="min_tokens")
    return allowed


def context_room(st: ServerState, prompt_len: int) -> int:
    """The tokens the context window (and the whole KV cache) leaves after a prompt of ``prompt_len`` tokens."""
    return min(st.runtime.max_model_len, st.runtime.model_info.kv_capacity_tokens) - prompt_len


def check_capacity(st: ServerState) -> None:
    """503 while ``max_waiting`` requests wait: those the engine last reported waiting, or, when more, the choices
    admitted and not ended beyond what the engine can run at once (requests it has not reported yet)."""
    waiting = max(st.runtime.engine.stats().num_waiting,
                  st.admitted.count - st.runtime.model_info.max_num_seqs)
    if waiting >= st.config.max_waiting:
        raise ApiError(503, f"The server is overloaded: {waiting} requests are waiting; retry later",
                       code="overloaded")


def logit_bias_ids(st: ServerState, bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    vocab = st.runtime.model_info.vocab_size
    for k, v in bias.items():
        tid = int(k)
        if not 0 <= tid < vocab:
            raise bad_request(f"logit_bias names token {tid}, outside the vocabulary [0, {vocab})", param="logit_bias")
        out[tid] = float(v)
    return out


def stop_ids(st: ServerState, ids: list[int] | None) -> list[int]:
    check_token_ids(st, list(ids or ()), "stop_token_ids")
    return list(ids or ())


def check_token_ids(st: ServerState, ids: list[int], param: str) -> None:
    vocab = st.runtime.model_info.vocab_size
    for t in ids:
        if not 0 <= t < vocab:
            raise bad_request(f"token ID {t} is outside the vocabulary [0, {vocab})", param=param)


def vllm_sampling_extras(st: ServerState, body: Any) -> dict[str, Any]:
    """vLLM's extra sampling fields of a chat or text completion as `SamplingParams` settings: `allowed_token_ids`
    (checked against the vocabulary), `bad_words` (each tokenized alone and after a space, as a word is spelled
    inside text), `cache_salt`, `priority` (under ``--scheduling-policy priority``; otherwise a non-zero one is a
    400, as in vLLM). Beam search and per-request logits processors are not served: asking for either is a 400
    naming the field (ignored, they would change the reply silently). Tokenizes: call it off the event loop."""
    if body.use_beam_search:
        raise bad_request("beam search is not supported", param="use_beam_search")
    if body.logits_processors:
        raise bad_request("the logits_processors argument is not supported by this server (no processor can be "
                          "loaded by name)", param="logits_processors")
    if body.priority and st.config.scheduling_policy != "priority":
        raise bad_request("requests are scheduled first come, first served: priority needs the server started "
                          "with --scheduling-policy priority", param="priority")
    allowed = None
    if body.allowed_token_ids is not None:
        if not body.allowed_token_ids:
            raise bad_request("allowed_token_ids must not be empty", param="allowed_token_ids")
        check_token_ids(st, body.allowed_token_ids, "allowed_token_ids")
        allowed = sorted(set(body.allowed_token_ids))
    bad = None
    if body.bad_words:
        tok = st.runtime.tokenizer
        spelled = {tuple(tok.encode(text, add_special_tokens=False))
                   for word in body.bad_words if word.strip() for text in (word.strip(), " " + word.strip())}
        bad = [list(ids) for ids in sorted(spelled) if ids]
    return {"allowed_token_ids": allowed, "bad_words_ids": bad or None, "cache_salt": body.cache_salt,
            "priority": body.priority}


def tokens_to_keep(keep: int | None, limit: int) -> int | None:
    """vLLM's `truncate_prompt_tokens` against ``limit``, the most tokens a prompt may have: how many of a prompt's
    last tokens to keep (None or 0: all of them; -1: ``limit``); more than ``limit`` is a 400 naming the field."""
    if keep == -1:
        return limit
    if keep is not None and keep > limit:
        raise bad_request(f"truncate_prompt_tokens ({keep}) is more than the {limit} tokens a prompt may have",
                          param="truncate_prompt_tokens")
    return keep


def truncate_prompt(st: ServerState, ids: list[int], keep: int | None, side: str | None = None) -> list[int]:
    """A generation prompt's token IDs after `truncate_prompt_tokens` (`tokens_to_keep` of the model's length): its
    last tokens, or its first with vLLM's ``truncation_side`` "right"."""
    keep = tokens_to_keep(keep, st.runtime.max_model_len)
    if not keep:
        return ids
    return ids[:keep] if side == "right" else ids[-keep:]


async def build_constraints(st: ServerState, n: int, *, setup: ParserSetup, initial: Any, response_format: dict | None,
                       tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool,
                       thinking_budget: int | None, thinking: bool) -> list[Any]:
    """One engine Constraint per choice for the request's structured output / forced tools / thinking budget,
    or Nones when generation is free. `thinking` False (the request switched thinking off) keeps a constrained
    reply from opening a thought of its own. Grammar problems are the request's fault (400). Compiling runs in a
    worker thread (a large schema takes 100+ ms), never on the event loop that streams everyone else's tokens."""
    if tools is None and forces_call(tool_choice) and not st.runtime.tools_enabled:
        raise bad_request("tool_choice forces a tool call, but this server parses no tool calls (it was started with "
                          "--tool-parser none, or its model's chat format has none)", param="tool_choice")
    backend = st.runtime.grammar
    if backend is None:
        forced = tool_choice not in (None, "auto", "none")
        if (response_format and response_format.get("type") != "text") or forced:
            raise bad_request("structured output is not available on this server",
                              param=answer_field(response_format) if response_format else "tool_choice")
        return [None] * n
    if not response_format and not tools and thinking_budget is None:
        return [None] * n
    if response_format and response_format.get("type") == "structural_tag":
        response_format = with_token_ids(response_format, st.runtime.tokenizer)
    return await asyncio.to_thread(
        backend.constraints, n, profile=setup.profile, delimiter_ids=setup.delimiter_ids, initial=initial,
        response_format=response_format, tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls, thinking_budget=thinking_budget, thinking=thinking)



def forces_call(tool_choice: Any) -> bool:
    """Whether ``tool_choice`` (OpenAI's or Anthropic's shape, as the handlers pass it) demands at least one call."""
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") == "allowed_tools":
            spec = tool_choice.get("allowed_tools", tool_choice)
            return isinstance(spec, dict) and spec.get("mode") == "required"
        return tool_choice.get("type") not in ("auto", "none")
    return tool_choice in ("required", "any")


def with_token_ids(response_format: dict, tokenizer: Any) -> dict:
    """A structural-tag answer format with ``token_ids``: the added tokens of this tokenizer (delimiters such as
    `<tool_call>`) that its triggers, begins and ends contain; the grammar accepts them only as those tokens, as the
    parsers read them. Malformed parts are left for the compiler to name."""
    texts = [t for t in response_format.get("triggers") or () if isinstance(t, str)]
    for st in response_format.get("structures") or ():
        if isinstance(st, dict):
            texts += [st[k] for k in ("begin", "end") if isinstance(st.get(k), str)]
    added = tokenizer.get_added_vocab()
    return {**response_format, "token_ids": {a: i for a, i in added.items() if a and any(a in t for t in texts)}}


def client_request_id(request: Request, body_id: str | None = None) -> str | None:
    """The ID a client gave its request, as vLLM reads it: the ``X-Request-Id`` header, else the body's
    ``request_id``; None when neither is given (or is empty)."""
    return request.headers.get("x-request-id") or body_id or None


def request_names(client_id: str | None) -> tuple[str, str]:
    """(the name a request's ``id`` carries after its prefix, the one its engine requests are named by): the client's
    ID (`client_request_id`) or random hex; two requests running at once may share a client's ID, so its engine name
    adds random hex."""
    if client_id:
        return client_id, f"{client_id}-{secrets.token_hex(4)}"
    name = secrets.token_hex(12)
    return name, name


def new_request(st: ServerState, choices: list[ChoiceSpec], stop: list[str], prefix: str,
                arrival: float, sep: str = "-", client_id: str | None = None) -> GenRequest:
    """Admit a request (503 when too many wait: `check_capacity`), count its prompt tokens once per choice (each
    choice is an engine request that prefills its prompt, as vLLM's ``n`` children are) and its choices until they
    end. Its ID, ``prefix``, ``sep`` and ``client_id`` (random hex when None), is the ``id`` its response carries. Two
    running requests may share a client's ID: their engine IDs (in the logs) add random hex to it."""
    check_capacity(st)
    name, engine_name = request_names(client_id)
    req = GenRequest(request_id=f"{prefix}{sep}{name}", choices=choices, stop=stop, arrival=arrival,
                     engine_id=f"{prefix}{sep}{engine_name}")
    st.admitted.hold(req)
    st.metrics.prompt_tokens.inc(sum(len(c.prompt_ids) for c in choices))
    return req



@dataclass
class Run:
    """Outcome of streaming one request: counts for usage and any generation errors."""

    completion_tokens: int = 0
    reasoning_tokens: int = 0  # tokens whose text went to the reasoning channel (OpenAI `reasoning_tokens`)
    errors: list[str] = field(default_factory=list)
    rejected: bool = False  # every error was the engine refusing the request (the client's fault: 400)
    cached: dict[int, int] = field(default_factory=dict)  # choice index -> prompt tokens hit in the prefix cache

    def note(self, step: ChoiceStep) -> None:
        self.completion_tokens += len(step.tokens)
        for t in step.tokens:
            if t.channel == "reasoning":
                self.reasoning_tokens += 1
        if step.end is not None and step.end.cached_tokens is not None:
            self.cached[step.index] = step.end.cached_tokens
        if step.end is not None and step.end.reason == "error":
            self.rejected = step.end.rejected and (self.rejected or not self.errors)
            self.errors.append(step.end.error or "generation failed")

    @property
    def adapter_gone(self) -> bool:
        """Whether the engine refused the request only because its LoRA adapter is not loaded (unloaded after the
        request's ``model`` was checked)."""
        return self.rejected and all(e.startswith(UnknownAdapterError.MESSAGE_START) for e in self.errors)

    def stream_errors(self) -> list[ApiError]:
        """This run's errors as the error events a stream ends with: the 404 naming ``model`` where its adapter is
        gone, 400 where the request's own settings failed it, else 500."""
        if self.adapter_gone:
            return [model_not_found(e) for e in self.errors]
        return [ApiError(400 if self.rejected else 500, e) for e in self.errors]

    def raise_for_errors(self) -> None:
        if self.errors:
            why = "; ".join(dict.fromkeys(self.errors))
            if self.adapter_gone:
                raise model_not_found(f"The model this request names does not exist: {why}")
            if self.rejected:
                raise bad_request("the engine cannot serve this request: " + why)
            raise ApiError(500, "generation failed: " + "; ".join(self.errors))


def shaped(step: ChoiceStep, single_call: bool = False, include_reasoning: bool = True) -> ChoiceStep:
    """``step`` as the reply shows it: only the first tool call with ``single_call``, no thought without
    ``include_reasoning``."""
    if single_call:
        step = first_call_only(step)
    return step if include_reasoning else without_reasoning(step)


async def noted_steps(st: ServerState, req: GenRequest, run: Run, single_call: bool = False,
                      include_reasoning: bool = True) -> AsyncIterator[ChoiceStep]:
    """The request's steps, noted in ``run`` and `shaped`: what a stream encodes and a non-streaming body folds."""
    async with aclosing(run_choices(st.runtime, req, st.metrics)) as steps:
        async for step in steps:
            run.note(step)
            yield shaped(step, single_call, include_reasoning)

async def collect(request: Request, items: AsyncIterator[dict]) -> list[dict]:
    """All items of a non-streaming response; a client that hangs up meanwhile aborts its request (blocks freed)."""
    async def drain() -> list[dict]:
        async with aclosing(items) as it:
            return [x async for x in it]

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ApiError(499, "the client closed the connection")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def stream_error(err: ApiError) -> str:
    return sse_line(openai_error_body(err))
