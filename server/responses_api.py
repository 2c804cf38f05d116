"""`/v1/responses` (the OpenAI Responses API): create, streamed, not, or in the background
(`background_responses`), over the same engine, parsers and grammar as chat; retrieve, list the input of, cancel and
delete responses.

A request's prompt is its `instructions` (a system message), then the stored conversation of `previous_response_id`
(its input and output; instructions are not carried over, as in the OpenAI API), then its own `input` items, rendered
with the chat template. `store: true` (the default) keeps the response in the server's `ResponseStore`.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from ember.engine.params import SamplingParams

from . import chat
from . import protocol_responses as pr
from .admission import (SSE_HEADERS, Run, ServerState, allowed_tokens, build_constraints,
                        check_generates, check_logprobs, check_model, collect, model_label, new_request, noted_steps,
                        state)
from .errors import ApiError
from .generation import ChoiceSpec, make_pipeline, sampling_params
from .background_responses import follow
from .response_store import StoredResponse
from .openai_encoder import sse_event
from .responses_encoder import ResponseEncoder
from .responses_input import input_items, listed_items, responses_messages
from .sse import EventStreamResponse
from .structured import flat_tool_fields


def _template_kwargs(body: pr.ResponsesRequest) -> dict[str, Any] | None:
    """`chat_template_kwargs`, plus `reasoning.effort` as `reasoning_effort` (gpt-oss's template reads it)."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is None:
        return body.chat_template_kwargs
    return {"reasoning_effort": effort, **(body.chat_template_kwargs or {})}


def _previous(st: ServerState, response_id: str | None) -> list[dict[str, Any]]:
    if response_id is None:
        return []
    if st.background.get(response_id) is not None:
        raise ApiError(400, f"Previous response with id '{response_id}' is still running in the background; poll it "
                            "until it has finished", param="previous_response_id")
    stored = st.responses.get(response_id)
    if stored is None:
        raise ApiError(404, f"Previous response with id '{response_id}' not found (this server keeps the latest "
                            f"{st.responses.capacity} stored responses in memory)", param="previous_response_id",
                       code="previous_response_not_found")
    return stored.messages


def _head(body: pr.ResponsesRequest, response_id: str, model: str, store: bool,
          params: SamplingParams) -> dict[str, Any]:
    """The response object's constant fields: identity and the settings it ran with (``params``: the sampling
    settings in effect, the model's defaults included), echoed."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    tool_choice: Any = body.tool_choice or "auto"  # OpenAI's default, echoed even without tools
    if isinstance(tool_choice, (pr.NamedFunction, pr.AllowedTools)):
        tool_choice = tool_choice.model_dump()
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
        "background": bool(body.background), "instructions": body.instructions,
        "max_output_tokens": params.max_tokens, "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                      "summary": body.reasoning.summary if body.reasoning else None},
        "store": store, "temperature": params.temperature,
        "text": {"format": fmt.echoed() if fmt else {"type": "text"},
                 "verbosity": body.text.verbosity if body.text is not None else None},
        "prompt_cache_key": body.prompt_cache_key,
        "tool_choice": tool_choice, "tools": [t.model_dump() for t in body.tools or ()],
        "top_logprobs": body.top_logprobs or 0, "top_p": params.top_p,
        "truncation": "disabled", "user": body.user, "safety_identifier": body.safety_identifier,
    }


def _conversation(st: ServerState, body: pr.ResponsesRequest) -> tuple[list[dict], list[dict], list[dict],
                                                                      list[dict] | None]:
    """(the request's input items, the conversation the reply continues: the previous response's then those items,
    the messages the template renders: the instructions then that conversation, the tools as chat's)."""
    items = input_items(body.input)
    previous = _previous(st, body.previous_response_id)
    history = previous + responses_messages(items, history=previous)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    return items, history, messages, chat.responses_tools(body.tools)


async def count_input_tokens(body: pr.InputTokensRequest, request: Request) -> Response:
    """`POST /v1/responses/input_tokens`: the prompt tokens a response to this request would read, rendered as
    `create_response` renders it (nothing runs)."""
    st = state(request)
    rt = st.runtime
    check_model(st, body.model)
    body.check()
    _, _, messages, tools = _conversation(st, body)
    prompt_ids = await asyncio.to_thread(rt.prompt_ids, messages, tools=tools, field="input",
                                         kwargs=rt.template_kwargs(_template_kwargs(body)))
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prompt_ids)})


async def create_response(body: pr.ResponsesRequest, request: Request) -> Response:
    arrival = time.monotonic()
    st = state(request)
    rt = st.runtime
    lora = check_model(st, body.model)
    check_generates(st)
    check_logprobs(st, top_logprobs=body.top_logprobs)
    body.check()
    if body.background and st.responses.capacity <= 0:
        raise ApiError(400, "this server stores no responses (--responses-store-size 0), so a background response "
                            "could not be polled", param="background")
    items, history, messages, tools = _conversation(st, body)
    tool_choice: Any = body.tool_choice_or_default
    if isinstance(tool_choice, pr.NamedFunction):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    elif isinstance(tool_choice, pr.AllowedTools):
        tool_choice = tool_choice.model_dump()  # the grammar lets calls name only these
    template_kwargs = rt.template_kwargs(_template_kwargs(body))
    prompt_ids = await asyncio.to_thread(rt.prompt_ids, messages, tools=tools, kwargs=template_kwargs, field="input",
                                     size_param="input")
    max_tokens = allowed_tokens(st, len(prompt_ids), body.max_output_tokens, param="input")
    parse_tools = tools if tool_choice != "none" and rt.tools_enabled else None
    setup = rt.parser
    initial = setup.initial_state(prompt_ids)
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                             top_k=body.top_k, min_p=body.min_p, seed=body.seed, presence_penalty=0.0,
                             frequency_penalty=0.0, repetition_penalty=body.repetition_penalty,
                             logprobs=top_logprobs, logit_bias=None, ignore_eos=body.ignore_eos, lora=lora,
                             cache_salt=body.cache_salt, defaults=rt.sampling_defaults)
    pipe = make_pipeline(setup, initial, stop=(), include_stop_str_in_output=False, tools=parse_tools,
                         ignore_eos=body.ignore_eos)
    fmt = body.text.format if body.text is not None else None
    thinking_off = chat.thinking_switched_off(template_kwargs)
    try:
        [constraint] = await build_constraints(
            st, 1, setup=setup, initial=initial, response_format=fmt.response_format() if fmt else None,
            tools=parse_tools, tool_choice=tool_choice, parallel_tool_calls=body.parallel_tool_calls,
            thinking_budget=body.max_thinking_tokens, thinking=not thinking_off)
    except ApiError as e:
        raise flat_tool_fields(e, "parameters") from None
    req = new_request(st, [ChoiceSpec(prompt_ids, params, pipe, constraint)], [], "resp", arrival, sep="_")
    response_id = req.request_id
    store = body.store and st.responses.capacity > 0
    enc = ResponseEncoder(_head(body, response_id, model_label(st, lora), store, params), rt.token_bytes.token_bytes,
                          len(prompt_ids), top_logprobs, queued=bool(body.background))
    run = Run()
    single_call = not body.parallel_tool_calls

    listed = listed_items(items)  # their IDs, the same while it runs and once stored

    def remember(response: dict[str, Any], events: list[dict[str, Any]] | None = None) -> None:
        if store and (response["status"] != "failed" or body.background):  # a poller must see the failure
            replies = responses_messages(response["output"], own_output=True)
            st.responses.put(response_id, StoredResponse(response, history + replies, listed, events))

    if body.background:
        bg = st.background.start(response_id, enc, noted_steps(st, req, run, single_call), remember, listed)
        if body.stream:  # a view of the task: a client that leaves stops reading, not generating
            return _event_stream(st, follow(bg, -1))
        return JSONResponse(bg.view())
    if body.stream:
        async def stream() -> AsyncIterator[str]:
            yield "".join(sse_event(ev) for ev in enc.start())
            async with aclosing(noted_steps(st, req, run, single_call)) as steps:
                async for step in steps:
                    events = enc.events(step)
                    if events:
                        yield "".join(sse_event(ev) for ev in events)
            remember(enc.response())
        return EventStreamResponse(stream(), st.config.sse_keepalive_seconds, headers=SSE_HEADERS)
    collected = await collect(request, noted_steps(st, req, run, single_call))
    run.raise_for_errors()
    response = enc.body(collected)
    remember(response)
    return JSONResponse(response)


def _stored(st: ServerState, response_id: str) -> StoredResponse:
    stored = st.responses.get(response_id)
    if stored is None:
        raise _not_stored(response_id)
    return stored


def _not_stored(response_id: str) -> ApiError:
    return ApiError(404, f"No stored response with id '{response_id}'", param="response_id", code="response_not_found")


def _event_stream(st: ServerState, events: AsyncIterator[dict[str, Any]]) -> EventStreamResponse:
    async def sse() -> AsyncIterator[str]:
        async with aclosing(events) as it:
            async for ev in it:
                yield sse_event(ev)
    return EventStreamResponse(sse(), st.config.sse_keepalive_seconds, headers=SSE_HEADERS)


async def _replay(events: list[dict[str, Any]], after: int) -> AsyncIterator[dict[str, Any]]:
    for ev in events[max(0, after + 1):]:
        yield ev


async def retrieve_response(response_id: str, request: Request, stream: bool = False,
                            starting_after: int | None = None) -> Any:
    """The response as it stands; with ``stream``, a background response's events after ``starting_after`` (all of
    them without it), followed live while it runs."""
    st = state(request)
    running = st.background.get(response_id)
    after = -1 if starting_after is None else starting_after
    if stream:
        if running is not None:
            return _event_stream(st, follow(running, after))
        stored = _stored(st, response_id)
        if stored.events is None:
            raise ApiError(400, f"Response '{response_id}' was not created in the background; only background "
                                "responses can be streamed again", param="stream")
        return _event_stream(st, _replay(stored.events, after))
    return running.view() if running is not None else _stored(st, response_id).body


async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
    """Stop a background response (its engine request aborted); cancelling a cancelled one again answers it as it
    is, one that has finished otherwise is a 400 (OpenAI's and vLLM's answer: the client learns it was too late)."""
    st = state(request)
    cancelled = await st.background.cancel(response_id)
    if cancelled is not None:
        return cancelled
    body = _stored(st, response_id).body
    if not body.get("background"):
        raise ApiError(400, f"Response '{response_id}' was not created in the background; only background "
                            "responses can be cancelled", param="response_id")
    if body.get("status") != "cancelled":
        raise ApiError(400, f"Cannot cancel a completed response: '{response_id}' has already ended "
                            f"({body.get('status')})", param="response_id")
    return body


async def list_input_items(response_id: str, request: Request, order: Literal["asc", "desc"] = "desc",
                           limit: int = Query(20, ge=1, le=100), after: str | None = None,
                           before: str | None = None) -> dict[str, Any]:
    """A stored or running response's input items, a page at a time, in ``order``: the page after item `after` (the
    last of the previous page), or the page just before item `before` (the first of the next); both: between them.
    `has_more` says whether more lie beyond the page in the direction it was asked."""
    st = state(request)
    running = st.background.get(response_id)
    items = running.input_items if running is not None else _stored(st, response_id).input_items
    items = items if order == "asc" else items[::-1]
    ids = [it["id"] for it in items]

    def position(cursor: str, name: str) -> int:
        if cursor not in ids:
            raise ApiError(400, f"{name}: no input item with id '{cursor}' in this response", param=name)
        return ids.index(cursor)

    start = position(after, "after") + 1 if after is not None else 0
    stop = position(before, "before") if before is not None else len(items)
    if before is not None and after is None:
        page = items[max(start, stop - limit):stop]
        more = stop - limit > start
    else:
        page = items[start:min(stop, start + limit)]
        more = start + limit < stop
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": more}


async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    st = state(request)
    await st.background.cancel(response_id)
    if not st.responses.delete(response_id):
        raise _not_stored(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def add_routes(app: FastAPI, dependencies: list[Any]) -> None:
    """Serve `/v1/responses` on `app`, behind `dependencies` (the app's API-key check)."""
    app.add_api_route("/v1/responses", create_response, methods=["POST"], dependencies=dependencies)
    app.add_api_route("/v1/responses/input_tokens", count_input_tokens, methods=["POST"], dependencies=dependencies)
    app.add_api_route("/v1/responses/{response_id}", retrieve_response, methods=["GET"], dependencies=dependencies)
    app.add_api_route("/v1/responses/{response_id}", delete_response, methods=["DELETE"], dependencies=dependencies)
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"],
                      dependencies=dependencies)
    app.add_api_route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"],
                      dependencies=dependencies)
