"""Request body of `POST /v1/responses` (the OpenAI Responses API).

`input` items stay plain dicts here: `responses_input` checks them one by one (naming `input[i]...` in its errors)
and turns them into chat-template messages. Unknown top-level fields are accepted and ignored, as the OpenAI SDKs
add new ones often; fields Ember cannot honour (`truncation: auto`, `conversation`, `prompt`) are refused by
name. Extensions as on chat: `top_k`, `min_p`, `seed`, `repetition_penalty`,
`ignore_eos`, `max_thinking_tokens`, `chat_template_kwargs`.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .errors import bad_request
from .protocol_openai import JsonSchemaSpec, _Lenient, _Request, refuse_other_tool_choice, tool_choice_union

LOGPROBS_INCLUDE = "message.output_text.logprobs"
KNOWN_INCLUDES = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content"})


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Lenient):
    type: Literal["function"]
    name: str


class AllowedTools(_Lenient):
    """OpenAI's ``allowed_tools``: calls may name only these tools (``required``: at least one call); every tool
    stays in the prompt."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[NamedFunction] = Field(min_length=1)


class TextFormat(_Lenient):
    """`text.format`: plain text, any JSON object, or JSON matching `schema` (the fields of chat's `json_schema`
    flattened into the format, as the Responses API spells them)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type json_schema needs a schema")
        return self

    def echoed(self) -> dict[str, Any]:
        """The format as a response states it: what the request set, and for `json_schema` the `name` it was
        compiled under (the reference's typed format requires one; a request may leave it to the default)."""
        out = self.model_dump(by_alias=True, exclude_unset=True)
        if self.type == "json_schema":
            out.setdefault("name", self.name)
        return out

    def response_format(self) -> dict[str, Any] | None:
        """The chat `response_format` the grammar backend compiles, naming `text.format` as its field (in errors);
        None for plain text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object", "param": "text.format"}
        spec = JsonSchemaSpec(name=self.name, schema=self.schema_, strict=self.strict)
        return {"type": "json_schema", "json_schema": spec.model_dump(by_alias=True, exclude_none=True),
                "param": "text.format"}


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # int64, as vLLM
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    ignore_eos: bool = False
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: prefix-cache blocks shared by one salt only
    safety_identifier: str | None = Field(default=None, max_length=64)  # echoed, as `user` (which it replaces)
    max_thinking_tokens: int | None = Field(default=None, ge=0)
    tools: list[FunctionTool] | None = None
    tool_choice: tool_choice_union(NamedFunction, AllowedTools) | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(default=None, ge=1)  # OpenAI's bound on built-in tool calls: none here, echoed
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _tool_choice_type(cls, data: Any) -> Any:
        return refuse_other_tool_choice(data, '{"type": "function", "name": ...}')

    def check(self) -> None:
        """Refuse, naming the field, what Ember cannot honour and what contradicts itself (400)."""
        if self.background and not self.store:
            raise bad_request("a background response must be stored (store: true) to be polled", param="store")
        if self.truncation == "auto":
            raise bad_request("truncation 'auto' is not supported: a conversation longer than the context is refused",
                              param="truncation")
        if self.conversation is not None:
            raise bad_request("conversations are not supported; pass previous_response_id or the whole input",
                              param="conversation")
        if self.prompt is not None:
            raise bad_request("prompt templates are not supported; send input (and instructions)", param="prompt")
        meta = self.metadata or {}
        if len(meta) > 16:
            raise bad_request(f"metadata holds at most 16 pairs, got {len(meta)}", param="metadata")
        for key, value in meta.items():
            if len(key) > 64:
                raise bad_request(f"metadata key {key[:20]!r}... is {len(key)} characters long; at most 64",
                                  param="metadata")
            if len(value) > 512:
                raise bad_request(f"metadata value of {key!r} is {len(value)} characters long; at most 512",
                                  param="metadata")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise bad_request("input must not be empty", param="input")
        for i, inc in enumerate(self.include or ()):
            if inc not in KNOWN_INCLUDES:
                raise bad_request(f"{inc!r} is not supported; supported: {', '.join(sorted(KNOWN_INCLUDES))}",
                                  param=f"include[{i}]")
        if (self.tool_choice == "required" or isinstance(self.tool_choice, NamedFunction)) and not self.tools:
            raise bad_request("tool_choice needs tools", param="tool_choice")
        names = {t.name for t in self.tools or ()}
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in names:
            raise bad_request(f"tool_choice names {self.tool_choice.name!r}, which is not in tools",
                              param="tool_choice.name")
        if isinstance(self.tool_choice, AllowedTools):
            for i, t in enumerate(self.tool_choice.tools):
                if t.name not in names:
                    raise bad_request(f"tool_choice allows {t.name!r}, which is not in tools",
                                      param=f"tool_choice.tools[{i}].name")

    @property
    def tool_choice_or_default(self) -> str | NamedFunction | AllowedTools:
        """`tool_choice`, or its default: `auto` with tools, `none` without."""
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


class InputTokensRequest(ResponsesRequest):
    """`POST /v1/responses/input_tokens`: a response request's fields, whose `input` may be left out (with
    `previous_response_id`)."""

    input: str | list[dict[str, Any]] = Field(default_factory=list)
