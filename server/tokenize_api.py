"""`POST /tokenize` and `POST /detokenize`, in vLLM's request and response shapes.

`/tokenize` takes either a `prompt` (encoded as `/v1/completions` encodes it) or chat `messages` (rendered with the
chat template as `/v1/chat/completions` renders them) and answers `{count, max_model_len, tokens, token_strs}`;
`/detokenize` turns `{tokens}` back into `{prompt}`.
"""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from pydantic import StrictInt, model_validator

from ember.grammar import GrammarError, check_tools

from . import chat
from . import protocol_openai as po
from .admission import resolve_model
from .errors import bad_request
from .structured import grammar_error


class TokenizeRequest(po._Lenient):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one body: `prompt` or `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[po.ChatMessage] | None = None
    tools: list[po.Tool] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused, as on chat: the server's template is the one rendered
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise po.field_error("prompt", "give exactly one of prompt and messages",
                                 None if self.prompt is None else "...")
        if self.chat_template is not None:
            raise po.field_error("chat_template", po.REQUEST_TEMPLATE_REFUSED, "...")
        if self.messages is not None and self.continue_final_message and self.add_generation_prompt:
            raise po.field_error("continue_final_message",
                                 "continue_final_message and add_generation_prompt exclude each other", True)
        return self


class DetokenizeRequest(po._Lenient):
    model: str | None = None
    tokens: list[StrictInt]


def _runtime(request: Request, model: str | None) -> Any:
    rt = request.app.state.ember.runtime
    resolve_model(rt, model)  # an adapter shares the served model's tokenizer and template
    return rt


def _tokenize(rt: Any, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        rt.check_text_size(body.prompt, "prompt")
        return list(rt.tokenizer.encode(body.prompt, add_special_tokens=special))
    tools = chat.openai_tools(body.tools)
    if tools and rt.tools_enabled:  # the tools /v1/chat/completions would parse, and refuse as it would
        try:
            check_tools(tools)
        except GrammarError as e:
            raise grammar_error(e) from None
    return rt.prompt_ids(chat.openai_messages(body.messages or []), size_param="messages", tools=tools,
                         add_special_tokens=bool(body.add_special_tokens),
                         add_generation_prompt=body.add_generation_prompt,
                         continue_final_message=body.continue_final_message,
                         kwargs=rt.template_kwargs(body.chat_template_kwargs), documents=body.documents)


async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    rt = _runtime(request, body.model)
    ids = await asyncio.to_thread(_tokenize, rt, body)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": rt.max_model_len, "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = list(rt.tokenizer.convert_ids_to_tokens(ids))
    return out


async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    rt = _runtime(request, body.model)
    size = len(rt.tokenizer)
    for i, t in enumerate(body.tokens):
        if not 0 <= t < size:
            raise bad_request(f"token ID {t} is outside the tokenizer's vocabulary [0, {size})", param=f"tokens[{i}]")
    return {"prompt": rt.tokenizer.decode(body.tokens)}


def add_routes(app: FastAPI, dependencies: list[Any]) -> None:
    """Serve the two routes on `app`, behind `dependencies` (the app's API-key check)."""
    app.add_api_route("/tokenize", tokenize, methods=["POST"], dependencies=dependencies)
    app.add_api_route("/detokenize", detokenize, methods=["POST"], dependencies=dependencies)
