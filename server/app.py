"""The FastAPI app: the endpoints, their streams and errors (shared admission and run helpers: `admission`).

`create_app(runtime, config)` builds an app around a loaded `ModelRuntime`; `load_runtime(config)` loads one (the
demo model when `config.model_dir` is None). `BackgroundServer` runs the app on uvicorn in a thread (tests,
benchmarks, embedding).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, get_route_path

from ember.engine.args import lora_module_parent

from . import chat
from . import protocol_anthropic as pa
from . import protocol_openai as po
from . import classify_api, embeddings_api, lora_api, responses_api, score_api, tokenize_api
from .answer_format import answer_format
from .admission import (SSE_HEADERS, Run, ServerState, allowed_tokens, build_constraints, check_generates,
                        check_logprobs, check_model, check_token_ids, client_request_id, collect, context_room,
                        logit_bias_ids, model_label, new_request, noted_steps, require_api_key, shaped, state,
                        stop_ids, stream_error, truncate_prompt, vllm_sampling_extras)
from .body_check import CheckedRoute, content_type_error, is_json
from .call_limit import first_call_only
from .anthropic_encoder import MessageEncoder
from .choice import ChoiceStep
from .config import ServeConfig
from .errors import (ANTHROPIC_REQUEST_ID, ApiError, anthropic_error_body, anthropic_style, bad_request,
                     is_anthropic_request, openai_error_body, validation_error)
from ember.grammar import GrammarError, check_tools
from ember.parsers.initial import InitialState
from ember.parsers.stop import StopStrings

from .generation import ChoiceSpec, GenRequest, ModelRuntime, make_pipeline, run_choices, sampling_params, seeded
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .response_store import ResponseStore
from .openai_encoder import (ChatChoiceEncoder, ChunkMeta, CompletionChoiceEncoder, chat_body, fold_completion,
                             given_text_offsets, literal_prompt_offsets, prompt_text_offsets, sse_event, sse_line,
                             token_names, usage, usage_chunk)
from .sse import RAW_SEND, EventStreamResponse
from .structured import flat_tool_fields

log = logging.getLogger("ember.server")


# ----------------------------------------------------------------------------------------------------- chat (OpenAI)

async def _chat_sse(st: ServerState, req: GenRequest, meta: ChunkMeta, run: Run,
                    single_call: bool, include_reasoning: bool = True) -> AsyncIterator[str]:
    """The chat stream's SSE text: the role chunks, one item per step (all of its chunks), then the tail (errors,
    usage, ``[DONE]``). What `noted_steps` does is inlined: this runs once per streamed step of every stream."""
    tb = token_names(st.runtime.token_bytes.token_bytes, meta)
    encs = [ChatChoiceEncoder(meta, i, tb, len(c.prompt_ids)) for i, c in enumerate(req.choices)]
    prompt_ids = req.choices[0].prompt_ids
    opening = [e.start(prompt_ids if i == 0 else None) for i, e in enumerate(encs)]
    yield "".join(sse_line(ch) for ch in opening + [ch for e in encs for ch in e.echo()])
    async with aclosing(run_choices(st.runtime, req, st.metrics)) as steps:
        async for step in steps:
            run.note(step)
            text = encs[step.index].step_sse(shaped(step, single_call, include_reasoning))
            if text:
                yield text
    tail = [stream_error(err) for err in run.stream_errors()]
    if meta.include_usage:
        tail.append(sse_line(usage_chunk(meta, _chat_usage(len(prompt_ids), run))))
    tail.append("data: [DONE]\n\n")
    yield "".join(tail)



def _prompt_logprobs(st: ServerState, body: po._SamplingFields) -> int | None:
    """vLLM's `prompt_logprobs` (alternatives per prompt token; -1: the whole vocabulary), which come only in a
    non-streaming body: a stream may ask for 0 (and gets none, as in vLLM), not for more."""
    asked = body.prompt_logprobs
    if asked is not None and body.stream:
        if asked:
            raise bad_request("prompt_logprobs is not available with stream: true", param="prompt_logprobs")
        return None
    return st.runtime.model_info.vocab_size if asked == -1 else asked


def _usage_options(body: po._SamplingFields, force: bool = False) -> tuple[bool, bool]:
    """(a last chunk with the usage, every chunk with its choice's usage so far): `stream_options`'
    `include_usage` (always, with ``force``: vLLM's --enable-force-include-usage) and vLLM's
    `continuous_usage_stats`, which needs it."""
    opts = body.stream_options
    include = bool(body.stream and (force or (opts and opts.include_usage)))
    return include, include and bool(opts and opts.continuous_usage_stats)


def _tokens_as_ids(st: ServerState, body: po._SamplingFields) -> bool:
    """vLLM's ``return_tokens_as_token_ids``: the request's field, else the server's flag."""
    asked = body.return_tokens_as_token_ids
    return st.config.return_tokens_as_token_ids if asked is None else asked


def _most(*tops: int | None) -> int | None:
    """The most alternatives any of ``tops`` asks for (None: none asks)."""
    asked = [t for t in tops if t is not None]
    return max(asked) if asked else None


def _chat_usage(prompt_tokens: int, run: Run) -> dict[str, Any]:
    return usage(prompt_tokens, run.completion_tokens, run.cached.get(0, 0), run.reasoning_tokens)


def _template_kwargs(body: po.ChatCompletionRequest) -> dict[str, Any] | None:
    """`chat_template_kwargs`, plus `reasoning_effort` (gpt-oss's template reads it) unless they set it."""
    if body.reasoning_effort is None:
        return body.chat_template_kwargs
    return {"reasoning_effort": body.reasoning_effort, **(body.chat_template_kwargs or {})}


def _echoed(body: po.ChatCompletionRequest, role: str) -> str:
    """vLLM's chat `echo`: the last message's text (text parts joined by newlines) when it has the reply's ``role``,
    which the reply then continues; else nothing."""
    last = body.messages[-1]
    if not body.echo or last.role != role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(p.text for p in last.content if isinstance(p, po.TextPart))


def _reply_role(st: ServerState, body: po.ChatCompletionRequest) -> str:
    """The reply message's role, as vLLM names it: ``--response-role`` after a generation prompt, else (the model
    continues the conversation as it stands) the last message's role."""
    if body.add_generation_prompt or not body.messages:
        return st.config.response_role
    return body.messages[-1].role


async def chat_completions(body: po.ChatCompletionRequest, request: Request,
                           _: None = Depends(require_api_key)) -> Response:
    arrival = time.monotonic()
    st = state(request)
    rt = st.runtime
    lora = check_model(st, body.model)
    check_generates(st)
    check_logprobs(st, top_logprobs=body.top_logprobs, prompt_logprobs=body.prompt_logprobs)
    extras = await asyncio.to_thread(vllm_sampling_extras, st, body)
    if body.n > st.config.max_n:
        raise bad_request(f"n may be at most {st.config.max_n}", param="n")
    messages = chat.openai_messages(body.messages)
    tools = chat.openai_tools(body.tools)
    if isinstance(body.tool_choice, po.NamedToolChoice):
        tool_choice: Any = {"type": "function", "function": {"name": body.tool_choice.function.name}}
    elif isinstance(body.tool_choice, po.AllowedToolsChoice):
        tool_choice = body.tool_choice.model_dump()  # the grammar lets calls name only these
    else:
        tool_choice = body.tool_choice or ("auto" if tools else "none")
    template_kwargs = rt.template_kwargs(_template_kwargs(body))
    prompt_ids = await asyncio.to_thread(
        rt.prompt_ids, messages, tools=tools, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, kwargs=template_kwargs, documents=body.documents,
        size_param="messages" if body.truncate_prompt_tokens is None else None,
        add_special_tokens=body.add_special_tokens)
    prompt_ids = truncate_prompt(st, prompt_ids, body.truncate_prompt_tokens, body.truncation_side)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = allowed_tokens(st, len(prompt_ids), requested, body.min_tokens)
    stop = body.stop_list
    stops = await asyncio.to_thread(StopStrings, stop)  # one automaton for every choice, built off the event loop
    parse_tools = tools if tool_choice != "none" and rt.tools_enabled else None
    setup = rt.parser
    initial = setup.initial_state(prompt_ids)
    scored_top = _prompt_logprobs(st, body)
    base = sampling_params(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        seed=body.seed, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        logit_bias=logit_bias_ids(st, body.logit_bias), stop_token_ids=stop_ids(st, body.stop_token_ids),
        min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, prompt_logprobs=scored_top, lora=lora,
        defaults=rt.sampling_defaults, **extras)
    choices = []
    for i in range(body.n):
        pipe = make_pipeline(setup, initial, stop=stops, include_stop_str_in_output=body.include_stop_str_in_output,
                             tools=parse_tools, stop_token_ids=base.stop_token_ids,
                             skip_special_tokens=body.skip_special_tokens, min_tokens=body.min_tokens,
                             ignore_eos=body.ignore_eos)
        params = seeded(base, i)
        if i:
            params.prompt_logprobs = None  # the prompt is scored once, with the first choice
        choices.append(ChoiceSpec(prompt_ids, params, pipe))
    thinking_off = chat.thinking_switched_off(template_kwargs)
    try:
        constraints = await build_constraints(
            st, body.n, setup=setup, initial=initial, response_format=answer_format(body),
            tools=parse_tools, tool_choice=tool_choice, parallel_tool_calls=body.parallel_tool_calls,
            thinking_budget=body.max_thinking_tokens, thinking=not thinking_off)
    except ApiError as e:
        if e.param == "max_thinking_tokens" and body.thinking_token_budget is not None:  # the field it was sent as
            e.param, e.message = "thinking_token_budget", e.message.replace("max_thinking_tokens",
                                                                            "thinking_token_budget", 1)
        raise
    for c, k in zip(choices, constraints):
        c.constraint = k
    req = new_request(st, choices, stop, "chatcmpl", arrival, client_id=client_request_id(request, body.request_id))
    include_usage, continuous_usage = _usage_options(body, st.config.enable_force_include_usage)
    meta = ChunkMeta(id=req.request_id, created=int(time.time()), model=model_label(st, lora),
                     logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0,
                     return_token_ids=body.return_token_ids, include_usage=include_usage,
                     continuous_usage=continuous_usage, prompt_logprobs=scored_top,
                     tokens_as_ids=_tokens_as_ids(st, body), role=(role := _reply_role(st, body)),
                     echo=_echoed(body, role), named_tool=isinstance(body.tool_choice, po.NamedToolChoice))
    run = Run()
    if body.stream:
        return EventStreamResponse(_chat_sse(st, req, meta, run, not body.parallel_tool_calls,
                                             body.include_reasoning),
                                   st.config.sse_keepalive_seconds, headers=SSE_HEADERS)
    collected = await collect(request, noted_steps(st, req, run, not body.parallel_tool_calls,
                                                   body.include_reasoning))
    run.raise_for_errors()
    tb = token_names(rt.token_bytes.token_bytes, meta)
    return JSONResponse(chat_body(meta, collected, tb, n=len(req.choices), prompt_token_ids=prompt_ids,
                                  usage_body=_chat_usage(len(prompt_ids), run)))


# ----------------------------------------------------------------------------------------------- completions (OpenAI)

async def completions(body: po.CompletionRequest, request: Request, _: None = Depends(require_api_key)) -> Response:
    arrival = time.monotonic()
    st = state(request)
    rt = st.runtime
    lora = check_model(st, body.model)
    check_generates(st)
    check_logprobs(st, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs)
    extras = await asyncio.to_thread(vllm_sampling_extras, st, body)
    prompts = body.prompts()
    if len(prompts) * body.n > st.config.max_n * 4:
        raise bad_request(f"at most {st.config.max_n * 4} choices (prompts times n) per request", param="n")
    stop = body.stop_list
    stops = await asyncio.to_thread(StopStrings, stop)  # one automaton for every choice, built off the event loop
    scored_top = _prompt_logprobs(st, body)
    choices, echoes, echo_offsets, prompt_total = [], [], [], 0
    echo_drop = rt.parser_plain.dropped_ids(body.skip_special_tokens)  # what the echo leaves out, as the output does
    for p_i, p in enumerate(prompts):
        named = f"prompt[{p_i}]" if len(prompts) > 1 else "prompt"
        if isinstance(p, str):
            if body.truncate_prompt_tokens is None:
                rt.check_text_size(p, named)
            ids = list(await asyncio.to_thread(rt.tokenizer.encode, p, add_special_tokens=True))
        else:
            ids = list(p)
            check_token_ids(st, ids, named)
        if not ids:
            raise bad_request(f"{named} is empty", param=named)
        kept = truncate_prompt(st, ids, body.truncate_prompt_tokens, body.truncation_side)
        text, offsets = None, None
        if body.echo:  # the prompt's text (as given, or as decode gives a token prompt) and its tokens' offsets in it
            as_given = isinstance(p, str) and len(kept) == len(ids)
            literal = None
            if as_given:
                plain = await asyncio.to_thread(rt.tokenizer.encode, p, add_special_tokens=False)
                literal = literal_prompt_offsets(rt.token_bytes, ids, plain)
            if literal is not None and literal[0] == p:
                text, offsets = literal
            elif as_given and (given := await asyncio.to_thread(given_text_offsets, rt.tokenizer, p, ids)):
                text, offsets = p, given
            else:
                decoded, offsets = prompt_text_offsets(rt.token_bytes, kept, echo_drop)
                text = p if as_given else decoded
        ids = kept
        max_tokens = allowed_tokens(st, len(ids), body.max_tokens, body.min_tokens, param=named)
        prompt_total += len(ids)
        base = sampling_params(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, seed=body.seed, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
            logprobs=body.logprobs, logit_bias=logit_bias_ids(st, body.logit_bias),
            stop_token_ids=stop_ids(st, body.stop_token_ids), min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos, prompt_logprobs=_most(body.logprobs if body.echo else None, scored_top),
            lora=lora, defaults=rt.sampling_defaults, **extras)
        for j in range(body.n):
            pipe = make_pipeline(rt.parser_plain, InitialState.CONTENT, stop=stops,
                                 include_stop_str_in_output=body.include_stop_str_in_output, tools=None,
                                 stop_token_ids=base.stop_token_ids, skip_special_tokens=body.skip_special_tokens,
                                 min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, prompt_ids=ids)
            choices.append(ChoiceSpec(ids, seeded(base, j), pipe))
            echoes.append(text)
            echo_offsets.append(offsets)
    constraints = await build_constraints(
        st, len(choices), setup=rt.parser_plain, initial=InitialState.CONTENT, response_format=answer_format(body),
        tools=None, tool_choice=None, parallel_tool_calls=True, thinking_budget=None, thinking=False)
    for c, k in zip(choices, constraints):
        c.constraint = k
    req = new_request(st, choices, stop, "cmpl", arrival, client_id=client_request_id(request, body.request_id))
    include_usage, continuous_usage = _usage_options(body, st.config.enable_force_include_usage)
    meta = ChunkMeta(id=req.request_id, created=int(time.time()), model=model_label(st, lora),
                     logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0,
                     return_token_ids=body.return_token_ids, include_usage=include_usage,
                     continuous_usage=continuous_usage, prompt_logprobs=scored_top,
                     tokens_as_ids=_tokens_as_ids(st, body))
    run = Run()

    def completion_usage() -> dict:
        cached = sum(run.cached.get(i, 0) for i in range(0, len(choices), body.n))  # each prompt's first choice
        return usage(prompt_total, run.completion_tokens, cached)

    async def groups() -> AsyncIterator[list[dict]]:
        """The start chunks, then each engine step's chunks: one group per body message of the stream."""
        tb = token_names(rt.token_bytes.token_bytes, meta)
        encs = [CompletionChoiceEncoder(meta, i, tb, echo=echoes[i], prompt_tokens=len(c.prompt_ids),
                                        echo_offsets=echo_offsets[i], prompt=c.pipeline.prompt_context)
                for i, c in enumerate(choices)]
        yield [ch for i, e in enumerate(encs) for ch in e.start(choices[i].prompt_ids)]
        async with aclosing(run_choices(rt, req, st.metrics)) as steps:
            async for step in steps:
                run.note(step)
                yield encs[step.index].step(step)

    if body.stream:
        async def stream() -> AsyncIterator[str]:
            async with aclosing(groups()) as it:
                async for group in it:
                    if group:
                        yield "".join(sse_line(ch) for ch in group)
            tail = [stream_error(err) for err in run.stream_errors()]
            if include_usage:
                tail.append(sse_line(usage_chunk(meta, completion_usage(), "text_completion")))
            tail.append("data: [DONE]\n\n")
            yield "".join(tail)
        return EventStreamResponse(stream(), st.config.sse_keepalive_seconds, headers=SSE_HEADERS)
    collected = [ch for group in await collect(request, groups()) for ch in group]
    run.raise_for_errors()
    return JSONResponse(fold_completion(collected, usage_body=completion_usage()))


# ------------------------------------------------------------------------------------------------- messages (Anthropic)

async def _anthropic_prompt(st: ServerState, body: pa._MessagesBase,
                            counting: bool = False) -> tuple[list[int], list[dict] | None, dict]:
    """The prompt's token IDs, its tools and template variables; a text too long for the context is refused before
    it is tokenized, except when ``counting`` (count_tokens answers how long a conversation is, however long)."""
    rt = st.runtime
    messages = chat.anthropic_messages(body.system, body.messages)
    tools = chat.anthropic_tools(body.tools)
    kwargs = chat.thinking_switches(body.thinking is not None and body.thinking.type != "disabled")
    kwargs = rt.template_kwargs(kwargs) or {}  # the server's defaults under the route's own thinking switches
    continue_final = bool(messages) and messages[-1]["role"] == "assistant"
    ids = await asyncio.to_thread(rt.prompt_ids, messages, tools=tools, add_generation_prompt=not continue_final,
                                  continue_final_message=continue_final, kwargs=kwargs,
                                  size_param=None if counting else "messages")
    return ids, tools, kwargs


async def messages(body: pa.MessagesRequest, request: Request, _: None = Depends(require_api_key)) -> Response:
    arrival = time.monotonic()
    st = state(request)
    rt = st.runtime
    lora = check_model(st, body.model)
    check_generates(st)
    prompt_ids, tools, _kw = await _anthropic_prompt(st, body)
    max_tokens = allowed_tokens(st, len(prompt_ids), body.max_tokens)
    tool_choice, parse_tools = _anthropic_tool_choice(st, body, tools)
    setup = rt.parser
    initial = setup.initial_state(prompt_ids)
    stop = list(body.stop_sequences or ())
    params = sampling_params(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                             top_k=body.top_k, min_p=None, seed=body.seed, presence_penalty=0.0,
                             frequency_penalty=0.0, repetition_penalty=None, logprobs=None, logit_bias=None,
                             lora=lora, defaults=rt.sampling_defaults)
    pipe = make_pipeline(setup, initial, stop=await asyncio.to_thread(StopStrings, stop),
                         include_stop_str_in_output=False, tools=parse_tools)
    fmt = body.output_config.format if body.output_config is not None else None
    rf = None if fmt is None else {"type": "json_schema", "json_schema": {"schema": fmt.schema_, "strict": True},
                                   "param": "output_config.format.schema"}
    constraint = await _anthropic_constraint(st, body, initial, parse_tools, tool_choice, rf)
    parallel = body.parallel_tool_use
    req = new_request(st, [ChoiceSpec(prompt_ids, params, pipe, constraint)], stop, "msg", arrival, sep="_")
    window_bound = max_tokens < body.max_tokens and max_tokens == context_room(st, len(prompt_ids))
    enc = MessageEncoder(req.request_id, model_label(st, lora), len(prompt_ids), omit_thinking=body.omits_thinking,
                         window_bound=window_bound)
    run = Run()

    if body.stream:
        async def stream() -> AsyncIterator[str]:
            """The start events, then each engine step's events as one body message, then any errors."""
            yield "".join(sse_event(ev) for ev in enc.start())
            async with aclosing(run_choices(rt, req, st.metrics)) as steps:
                async for step in steps:
                    evs = _message_step(enc, step if parallel else first_call_only(step), run)
                    if evs:
                        yield "".join(sse_event(ev) for ev in evs)
            if run.errors:
                yield "".join(sse_event(anthropic_error_body(err)) for err in run.stream_errors())
        return EventStreamResponse(stream(), st.config.sse_keepalive_seconds, headers=SSE_HEADERS)
    collected = await collect(request, noted_steps(st, req, run, not parallel))
    run.raise_for_errors()
    return JSONResponse(enc.body(collected))


async def _anthropic_constraint(st: ServerState, body: pa._MessagesBase, initial: InitialState,
                                parse_tools: list[dict] | None, tool_choice: str, response_format: dict | None) -> Any:
    """The grammar a message runs under (forced tool calls, ``response_format``, the thinking budget); its 400s name
    Anthropic's flat tool fields (``tools[0].input_schema``)."""
    thinking_on = body.thinking is not None and body.thinking.type != "disabled"
    budget = body.thinking.budget_tokens if thinking_on and body.thinking.type == "enabled" else None
    choice: Any = tool_choice
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": body.tool_choice.name}}
    try:
        [constraint] = await build_constraints(
            st, 1, setup=st.runtime.parser, initial=initial, response_format=response_format, tools=parse_tools,
            tool_choice=choice, parallel_tool_calls=body.parallel_tool_use, thinking_budget=budget,
            thinking=thinking_on)
    except ApiError as e:
        if e.param == "max_thinking_tokens":  # the message names the field Anthropic's error shape puts first
            e.param, e.message = "thinking.budget_tokens", e.message.removeprefix("max_thinking_tokens: ")
        raise flat_tool_fields(e, "input_schema") from None
    return constraint


def _anthropic_tool_choice(st: ServerState, body: pa._MessagesBase,
                           tools: list[dict] | None) -> tuple[str, list[dict] | None]:
    """The request's tool choice in OpenAI's terms ("auto", "required", "named", "none") and the tools the
    output is parsed for (None when none are)."""
    tc = body.tool_choice.type if body.tool_choice is not None else ("auto" if tools else "none")
    tool_choice = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[tc]
    return tool_choice, tools if tool_choice != "none" and st.runtime.tools_enabled else None


def _message_step(enc: MessageEncoder, step: ChoiceStep, run: Run) -> list[dict]:
    """The stream events of one engine step; a message that ends in an error gets no message_delta/message_stop
    (the error event that follows ends the stream, as Anthropic's do)."""
    run.note(step)
    out = enc.events(step.events, len(step.tokens))
    if step.end is not None and step.end.reason != "error":
        out += enc.finish(step.end)
    return out


async def count_tokens(body: pa.CountTokensRequest, request: Request, _: None = Depends(require_api_key)) -> dict:
    st = state(request)
    check_model(st, body.model)
    prompt_ids, tools, _kw = await _anthropic_prompt(st, body, counting=True)
    tool_choice, parse_tools = _anthropic_tool_choice(st, body, tools)
    try:
        check_tools(parse_tools)  # the tool names /v1/messages would refuse
    except GrammarError as e:
        raise flat_tool_fields(bad_request(e.message), "input_schema") from None
    # the tool schemas a forced call compiles, as /v1/messages would refuse them (a client preflights with this)
    await _anthropic_constraint(st, body, st.runtime.parser.initial_state(prompt_ids), parse_tools, tool_choice, None)
    return {"input_tokens": len(prompt_ids)}


# --------------------------------------------------------------------------------------------------------- the rest

def _model_card(st: ServerState, lora: str | None, name: str | None = None) -> dict:
    """One `/v1/models` entry (the served model under ``name``, one of its names); a LoRA adapter's names the
    served model as its ``parent`` (its `--lora-modules` ``base_model_name`` where given) and its folder as
    ``root``, as vLLM lists adapters."""
    rt = st.runtime
    card = {"id": name or model_label(st, lora), "object": "model", "created": st.started, "owned_by": "ember",
            "root": rt.model_info.model_dir, "parent": None, "max_model_len": rt.max_model_len}
    if lora is not None:
        parents = dict(p for p in map(lora_module_parent, st.config.lora_modules) if p is not None)
        card.update(root=dict(rt.model_info.lora_adapters)[lora], parent=parents.get(lora, rt.model_name))
    return card


async def list_models(request: Request, _: None = Depends(require_api_key)) -> dict:
    st = state(request)
    rt = st.runtime
    adapters = [n for n, _ in rt.model_info.lora_adapters]
    names = [rt.model_name, *rt.model_aliases, *adapters]
    if "anthropic-version" in request.headers:
        page, more = _anthropic_page(names, request.query_params)
        return {"data": [_anthropic_model(st, n) for n in page], "has_more": more,
                "first_id": page[0] if page else None, "last_id": page[-1] if page else None}
    cards = [_model_card(st, None, name) for name in [rt.model_name, *rt.model_aliases]]
    return {"object": "list", "data": cards + [_model_card(st, n) for n in adapters]}


async def get_model(model_id: str, request: Request, _: None = Depends(require_api_key)) -> dict | Response:
    """The model's card: OpenAI's shape, or Anthropic's when the request carries ``anthropic-version``. The list's
    path with a trailing slash (no id) is redirected to the list, as FastAPI redirects vLLM's."""
    if not model_id:
        return RedirectResponse(str(request.url.replace(path=request.url.path.rstrip("/"))), status_code=307)
    st = state(request)
    lora = check_model(st, model_id)
    if "anthropic-version" in request.headers:
        return _anthropic_model(st, model_id)
    return _model_card(st, lora, None if lora else model_id)


def _anthropic_page(names: list[str], query: Mapping[str, str]) -> tuple[list[str], bool]:
    """Anthropic's model-list paging: ``limit`` (1-1000, default 20) names after ``after_id`` or before
    ``before_id``; and whether more lie beyond the page in that direction."""
    raw = query.get("limit", "20")
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 1000:
        raise bad_request(f"limit must be an integer from 1 to 1000, got {raw!r}", param="limit")
    limit = int(raw)
    for key in ("after_id", "before_id"):
        if key in query and query[key] not in names:
            raise bad_request(f"{key} {query[key]!r} is not a listed model", param=key)
    if "before_id" in query:
        end = names.index(query["before_id"])
        return names[max(0, end - limit):end], end > limit
    start = names.index(query["after_id"]) + 1 if "after_id" in query else 0
    return names[start:start + limit], start + limit < len(names)


def _anthropic_model(st: ServerState, name: str) -> dict:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.started))
    return {"type": "model", "id": name, "display_name": name, "created_at": created}


async def health(request: Request) -> Response:
    engine = state(request).runtime.engine
    if not engine.is_alive():
        reason = getattr(engine, "death_reason", None) or "the engine has stopped"
        return JSONResponse({"status": "engine_dead", "message": f"{reason}; restart the server"}, status_code=503)
    s = engine.stats()
    return JSONResponse({"status": "ok", "num_running": s.num_running, "num_waiting": s.num_waiting,
                         "num_steps": s.num_steps, "step_ms": s.step_ms})


async def load(request: Request) -> dict:
    """vLLM's ``/load``: the generation and pooling requests being served (`LOAD_TRACKED_PATHS`), counted with
    ``--enable-server-load-tracking`` (0 without it)."""
    return {"server_load": state(request).server_load}


async def version() -> dict:
    """Ember's version (vLLM's `/version`)."""
    from .cli import version as ember_version

    return {"version": ember_version()}


async def invocations(request: Request, _: None = Depends(require_api_key)) -> Response:
    """SageMaker's inference route, as vLLM serves it: on a classifier every body is a classification; otherwise a
    body with `messages` is a chat completion, one with `prompt` a text completion, one with `input` embeddings (the
    same validation, answers and errors as those routes)."""
    try:
        raw = await request.json()
    except (ValueError, RecursionError) as e:
        raise _unparsed_body(e) from None
    if not is_json(request.headers.get("content-type")):  # a browser's form or text/plain POST needs no preflight
        raise content_type_error(request.headers.get("content-type"))
    pooled: Any = None
    if state(request).runtime.model_info.labels:
        model, pooled = classify_api.ClassifyRequest, classify_api.classify
    elif isinstance(raw, dict) and "messages" in raw:
        model, handler = po.ChatCompletionRequest, chat_completions
    elif isinstance(raw, dict) and "prompt" in raw:
        model, handler = po.CompletionRequest, completions
    elif isinstance(raw, dict) and "input" in raw:
        model, pooled = embeddings_api.EmbeddingRequest, embeddings_api.create_embeddings
    else:
        raise bad_request("an /invocations body is a JSON object with messages (a chat completion), prompt (a "
                          "text completion) or input (embeddings)", param="messages")
    try:
        body = model.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    if pooled is not None:
        return JSONResponse(await pooled(body, request))
    return await handler(body, request, None)


async def metrics(request: Request) -> Response:
    return Response(state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _error_response(request: Request, err: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """``err`` in the shape of the API the request is for: Anthropic's for its routes, and for a path no route serves
    asked with ``anthropic-version`` (an Anthropic SDK given a base URL ending in ``/v1`` asks ``/v1/v1/messages``)."""
    anthropic = is_anthropic_request(get_route_path(request.scope), request.headers) or (
        err.status == 404 and "anthropic-version" in request.headers and not _allowed_methods(request))
    request_id = request.scope.get("state", {}).get(ANTHROPIC_REQUEST_ID)
    body = anthropic_error_body(err, request_id) if anthropic else openai_error_body(err)
    return JSONResponse(body, status_code=err.status, headers=headers)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path (the routes whose path matches, whatever the method)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    order = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return sorted(methods, key=lambda m: (order.index(m) if m in order else len(order), m))


def _unparsed_body(cause: BaseException | None) -> ApiError | None:
    """The 400 for a body the JSON decoder could not take (``cause``: not UTF-8, nested too deeply, or another
    ValueError of the decoder's, such as an integer past Python's digit limit)."""
    if isinstance(cause, UnicodeDecodeError):
        return bad_request(f"Request body is not valid JSON: it is not UTF-8 ({cause})", code="json_invalid")
    if isinstance(cause, RecursionError):
        return bad_request("Request body is nested too deeply to parse", code="json_invalid")
    if isinstance(cause, ValueError):
        return bad_request(f"Request body is not valid JSON: {cause}", code="json_invalid")
    return None


class _RequestCounter:
    """Pure ASGI middleware counting responses by endpoint (the matched route's path template, so a model id or a
    response id does not make a label of its own; ``paths``, FastAPI's own pages, by their path; unknown paths are
    ``other``) and status; does not buffer streams."""

    def __init__(self, app: Any, metrics: Metrics, paths: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, started = {"code": 500}, time.monotonic()
        scope[RAW_SEND] = send  # streamed body messages skip the wrappers inside this one

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")  # the route the router matched (its path template), none for unknown paths
            path = get_route_path(scope)
            handler = getattr(route, "path_format", None) or (path if path in self.paths else None)
            self.metrics.requests.labels(handler or "other", str(status["code"])).inc()
            self.metrics.http_request(handler, scope["method"], status["code"], time.monotonic() - started)


LOAD_TRACKED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/embeddings", "/invocations",
    "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify", "/v1/classify"})


class _LoadTracker:
    """Pure ASGI middleware counting the requests to `LOAD_TRACKED_PATHS` in `ServerState.server_load` from their
    arrival until their response (a stream's included) has ended or its client has gone."""

    def __init__(self, app: Any, st: ServerState):
        self.app = app
        self.st = st

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or get_route_path(scope) not in LOAD_TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.st.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.st.server_load -= 1


class _RequestIdHeaders:
    """Pure ASGI middleware for response ID headers: an Anthropic request (`anthropic_style`) gets a ``request-id``
    header (``req_`` and random hex, as Anthropic's API gives every response; also in its error bodies, through
    ``scope["state"]``); with ``x_request_id`` every response gets an ``X-Request-Id`` header: the request's own, else
    random hex (vLLM's ``--enable-request-id-headers``)."""

    def __init__(self, app: Any, x_request_id: bool):
        self.app = app
        self.x_request_id = x_request_id

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        added: list[tuple[str, str]] = []
        if anthropic_style(get_route_path(scope), headers):
            anthropic_id = f"req_{uuid.uuid4().hex}"
            scope.setdefault("state", {})[ANTHROPIC_REQUEST_ID] = anthropic_id
            added.append(("request-id", anthropic_id))
        if self.x_request_id:
            added.append(("X-Request-Id", headers.get("x-request-id") or uuid.uuid4().hex))
        if not added:
            await self.app(scope, receive, send)
            return

        async def send_with_ids(message: dict) -> None:
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                for name, value in added:
                    out.append(name, value)
            await send(message)

        await self.app(scope, receive, send_with_ids)


async def _watch_engine(st: ServerState, exit_on_death: bool, poll_s: float = 0.2) -> None:
    """Notice the engine's death (requests in flight already fail with its reason, /health answers 503); with
    ``exit_on_death``, give those errors a moment to reach their clients, then stop the server (SIGTERM to this
    process: uvicorn shuts down and `ember serve` exits non-zero)."""
    engine = st.runtime.engine
    while engine.is_alive():
        await asyncio.sleep(poll_s)
    reason = getattr(engine, "death_reason", None)
    if reason is None:  # shut down on purpose
        return
    st.engine_dead = reason
    log.error("%s; the server stops", reason)
    if exit_on_death:
        await asyncio.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)


def create_app(runtime: ModelRuntime, config: ServeConfig, *, shutdown_engine: bool = True,
               exit_on_engine_death: bool = False) -> FastAPI:
    """The HTTP app serving `runtime`; shuts the engine down when the app stops (unless told it is shared), and
    with ``exit_on_engine_death`` stops the server when the engine process dies (`ember serve`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        watcher = asyncio.create_task(_watch_engine(st, exit_on_engine_death))
        yield
        watcher.cancel()
        await st.background.cancel_all()
        if shutdown_engine:  # off the event loop: handlers cut by the shutdown deadline still write their errors
            await asyncio.to_thread(runtime.engine.shutdown)

    docs = {} if not config.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Ember", version="0.1.0", lifespan=lifespan, **docs)
    app.root_path = config.root_path  # as vLLM sets it (FastAPI's keyword for it is deprecated)
    app.router.route_class = CheckedRoute
    st = ServerState(config=config, runtime=runtime, metrics=Metrics(runtime.model_name, runtime.engine.stats,
                                                                      runtime.model_info.max_model_len),
                     responses=ResponseStore(config.responses_store_size))
    info = runtime.model_info
    st.metrics.cache_config(block_size=info.block_size, cache_dtype=info.kv_cache_dtype,
                            enable_prefix_caching=config.enable_prefix_caching,
                            gpu_memory_utilization=config.gpu_memory_utilization, num_gpu_blocks=info.num_kv_blocks)
    app.state.ember = st

    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"], response_model=None)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/messages", messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET"], name="ping")
    app.add_api_route("/ping", health, methods=["POST"], name="ping_post")
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/load", load, methods=["GET"])
    app.add_api_route("/invocations", invocations, methods=["POST"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    responses_api.add_routes(app, [Depends(require_api_key)])
    tokenize_api.add_routes(app, [Depends(require_api_key)])
    embeddings_api.add_routes(app, [Depends(require_api_key)])
    score_api.add_routes(app, [Depends(require_api_key)])
    classify_api.add_routes(app, [Depends(require_api_key)])
    lora_api.add_routes(app, [Depends(require_api_key)])

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if isinstance(exc.body, bytes):  # FastAPI left a body whose Content-Type is not JSON unparsed
            return _error_response(request, content_type_error(request.headers.get("content-type")))
        return _error_response(request, validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405) and get_route_path(request.scope).startswith("/v1/"):
            try:  # as vLLM guards every /v1 path: no key learns which routes exist
                await require_api_key(request)
            except ApiError as unauthorized:
                return _error_response(request, unauthorized)
        err = _unparsed_body(exc.__cause__) or ApiError(exc.status_code, str(exc.detail))
        headers = exc.headers
        if exc.status_code == 405:  # Starlette's names only the first route of the path: a path may have several
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return _error_response(request, err, headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", get_route_path(request.scope))
        return _error_response(request, ApiError(500, f"internal error: {type(exc).__name__}"))

    fastapi_pages = frozenset(r.path for r in app.routes if not isinstance(r, APIRoute))
    app.add_middleware(_RequestCounter, metrics=st.metrics, paths=fastapi_pages)
    if config.enable_server_load_tracking:
        app.add_middleware(_LoadTracker, st=st)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_credentials=config.allow_credentials,
                           allow_methods=list(config.allowed_methods or ("*",)),
                           allow_headers=list(config.allowed_headers or ("*",)))
    app.add_middleware(_RequestIdHeaders, x_request_id=config.enable_request_id_headers)
    return app


# ------------------------------------------------------------------------------------------------------------ loading

def load_runtime(config: ServeConfig) -> ModelRuntime:
    """Start the engine for `config.model_dir` (building the demo model when None): in its own process, or in a
    thread of this one with `config.in_process`; then the front end's tokenizer, parser and grammar setup."""
    from ember.engine.args import engine_args_of
    from ember.engine.checkpoint import tokenizer_dir

    model_dir = config.model_dir
    if model_dir is None:
        from ember.engine import demo

        model_dir = demo.ensure()
    model_dir = Path(model_dir)
    template = chat.load_chat_template(config.chat_template)
    args = engine_args_of(config)
    if config.in_process:
        from ember.engine.async_engine import AsyncEngine

        tokenizer, grammar, why = _front_end_setup(model_dir, tokenizer_dir(model_dir, args.tokenizer))
        engine: Any = AsyncEngine.from_args(str(model_dir), args, grammar)
    else:
        from concurrent.futures import Future

        from ember.engine.core_client import ProcessEngineClient

        from .structured import engine_constraints

        # the front end's tokenizer and grammar tables (seconds for a 200k vocabulary) are built while the engine
        # process starts, from the folder the engine loads its tokenizer from; a daemon thread, so an engine that
        # fails to start is reported without waiting for it
        front: Future = Future()

        def setup() -> None:
            try:
                front.set_result(_front_end_setup(model_dir, tokenizer_dir(model_dir, args.tokenizer)))
            except BaseException as e:
                front.set_exception(e)

        threading.Thread(target=setup, name="ember-front-end-setup", daemon=True).start()
        engine = ProcessEngineClient(str(model_dir), args, engine_constraints, log_level=config.log_level)
        try:
            tokenizer, grammar, why = front.result()
        except BaseException:
            engine.shutdown()
            raise
    if why is not None:
        info = engine.model_info  # a model that generates nothing has no use for structured output: no warning
        (log.info if info.labels or info.encoder else log.warning)("structured output disabled: %s", why)
    try:
        return ModelRuntime.build(engine, config, model_dir, template, grammar=grammar, tokenizer=tokenizer)
    except BaseException:
        engine.shutdown()
        raise


def _front_end_setup(model_dir: Path, tokenizer_dir: Path) -> tuple[Any, Any, str | None]:
    """The front end's tokenizer, and its grammar backend or why there is none (`_structured`)."""
    from ember.engine.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    return (tokenizer, *_structured(model_dir, tokenizer))


def _structured(model_dir: Path, tokenizer: Any) -> tuple[Any, str | None]:
    """The model's grammar backend, or None (structured output refused with 400) and why, if llguidance cannot
    load it."""
    try:
        from .structured import Structured

        return Structured.from_pretrained(model_dir, tokenizer), None
    except Exception as e:  # an exotic tokenizer llguidance cannot read must not stop the server
        return None, str(e)


class BackgroundServer:
    """The app on uvicorn in a daemon thread, on a free loopback port unless one is given."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        import uvicorn

        self.host = host
        self.port = port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level=log_level,
                                                    lifespan="on", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="ember-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


__all__ = ["create_app", "load_runtime", "BackgroundServer", "ServerState", "free_port"]
