"""Request bodies of the OpenAI-compatible endpoints (`/v1/chat/completions`, `/v1/completions`).

Field names follow the OpenAI API reference plus vLLM's extensions (`top_k`, `min_p`, `repetition_penalty`,
`return_token_ids`, `chat_template_kwargs`, `include_stop_str_in_output`, `ignore_eos`, `min_tokens`,
`max_thinking_tokens`, `prompt_logprobs`, `structured_outputs` and the `guided_*` fields older vLLM clients send,
`allowed_token_ids`, `bad_words`, `cache_salt`, `truncate_prompt_tokens`, `priority` (with the priority scheduling
policy); `use_beam_search: true` and `logits_processors` are refused).
Unknown fields are accepted and ignored, as the OpenAI SDKs add new ones often. A request field given as JSON `null`
takes its default, as OpenAI marks its optional fields nullable and vLLM accepts them so.
"""
from __future__ import annotations

from functools import cache
from types import NoneType
from typing import Annotated, Any, Literal, get_args

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, StrictInt, Tag, ValidationError,
                      field_validator, model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


@cache
def _null_means_default(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` (by name and alias) that have a default but whose type does not admit None."""
    names = set()
    for name, f in model.model_fields.items():
        if not f.is_required() and not (f.annotation in (Any, NoneType) or NoneType in get_args(f.annotation)):
            names.update(n for n in (name, f.alias) if n)
    return frozenset(names)


class _Request(_Lenient):
    """A request body: a field sent as JSON null takes its default."""

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict) or None not in data.values():
            return data
        defaulted = _null_means_default(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


REQUEST_TEMPLATE_REFUSED = "a chat template per request is not accepted; start the server with --chat-template"
"""Why vLLM's per-request ``chat_template`` is a 400 wherever messages are rendered (vLLM refuses it by default)."""


def field_error(field: str, message: str, value: Any = None) -> ValidationError:
    """A validation error located at ``field`` (dotted for a nested one), for checks that span several fields: the
    400 then names it in ``param``."""
    return ValidationError.from_exception_data("request", [InitErrorDetails(
        type=PydanticCustomError("value_error", "{message}", {"message": message}),
        loc=tuple(field.split(".")), input=value)])


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class RefusalPart(_Lenient):
    type: Literal["refusal"]
    refusal: str


class ImagePart(_Lenient):
    type: Literal["image_url", "input_image", "input_audio", "file", "image"]


ContentPart = Annotated[TextPart | RefusalPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    function_call: FunctionCall | None = None  # the legacy form of one tool call
    refusal: str | None = None  # an assistant's refusal: its text when it has no content

    @model_validator(mode="after")
    def _role_rules(self) -> "ChatMessage":
        if self.role != "assistant" and (self.tool_calls or self.function_call or self.refusal is not None):
            raise ValueError("only assistant messages may carry tool_calls, function_call or refusal")
        if self.role in ("system", "developer", "user") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.function_call is not None and not self.tool_calls:  # the call the legacy `function` reply answers
            self.tool_calls = [ToolCall(function=self.function_call)]
        if self.content is None and self.refusal is not None:
            self.content = self.refusal
        return self


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


def refuse_other_tool_choice(data: Any, named: str) -> Any:
    """``data`` (a request body), unless its tool_choice is an object of another type than ``function`` or
    ``allowed_tools`` (``custom``, a built-in tool): a 400 naming ``tool_choice.type`` that shows the ``named`` form,
    not pydantic's mismatches with each member of the union."""
    choice = data.get("tool_choice") if isinstance(data, dict) else None
    if isinstance(choice, dict) and choice.get("type", "function") not in ("function", "allowed_tools"):
        raise field_error("tool_choice.type", f"tool_choice type {choice['type']!r} is not supported: give none, "
                          f"auto, required, {named} or allowed_tools", choice.get("type"))
    return data


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class AllowedTools(_Lenient):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(_Lenient):
    """OpenAI's ``allowed_tools``: calls may name only these tools (``required``: at least one call); every tool
    stays in the prompt."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def tool_choice_union(named: type, allowed: type) -> Any:
    """A tool_choice field's type: none / auto / required, the ``named`` form or the ``allowed`` one, picked by the
    object's ``type``, so a bad object is reported against its own form (trying each member reported the other
    form's longest-named field, such as ``tool_choice.allowed_tools`` for a function missing ``function``)."""
    def member(value: Any) -> str:
        if isinstance(value, str):
            return "str"
        return allowed.__name__ if isinstance(value, dict) and value.get("type") == "allowed_tools" else named.__name__

    return Annotated[Annotated[Literal["none", "auto", "required"], Tag("str")] | Annotated[named, Tag(named.__name__)]
                     | Annotated[allowed, Tag(allowed.__name__)], Discriminator(member)]


class JsonSchemaSpec(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema", "regex", "grammar", "lark", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None
    regex: str | None = None
    grammar: str | None = None
    structures: list[Any] | None = None  # structural_tag: [{begin, schema, end}]
    triggers: list[Any] | None = None  # structural_tag: the texts that start a structure

    @model_validator(mode="after")
    def _needs_payload(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        if self.type == "regex" and not self.regex:
            raise ValueError("type regex needs a regex")
        if self.type in ("grammar", "lark") and not self.grammar:
            raise ValueError(f"type {self.type} needs a grammar")
        if self.type == "structural_tag" and (not self.structures or not self.triggers):
            raise ValueError("type structural_tag needs structures and triggers")
        return self


class StructuredOutputs(_Lenient):
    """vLLM's `structured_outputs` extension: one answer format (`json`, `regex`, `choice`, `grammar` or
    `json_object`) and its JSON layout options."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @model_validator(mode="after")
    def _one_kind(self) -> "StructuredOutputs":
        kinds = [k for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                ("grammar", self.grammar), ("json_object", self.json_object or None),
                                ("structural_tag", self.structural_tag)) if v is not None]
        if len(kinds) != 1:
            raise ValueError("set exactly one of json, regex, choice, grammar, json_object"
                             + (f"; got {', '.join(kinds)}" if kinds else ""))
        return self


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def _check_stop(v: str | list[str] | None) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else list(v)
    if any(s == "" for s in stops):
        raise ValueError("stop strings must be non-empty")
    return stops


def _no_zero_truncation(v: int | None) -> int | None:
    if v == 0:
        raise ValueError("truncate_prompt_tokens must be -1 (the model's maximum length) or at least 1")
    return v


TruncatePromptTokens = Annotated[int | None, Field(ge=-1), AfterValidator(_no_zero_truncation)]
"""vLLM's ``truncate_prompt_tokens`` on every route that takes it: keep the prompt's last N tokens (N >= 1), or -1
for the model's maximum length."""


class _SamplingFields(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # int64, as vLLM
    n: int = Field(default=1, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens `token_id:N` (default: the flag)
    prompt_logprobs: int | None = Field(default=None, ge=-1)  # -1: all; at most --max-logprobs (checked per route)
    user: str | None = None
    request_id: str | None = None  # vLLM's: the response's `id` after its prefix (an X-Request-Id header wins)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None   # vLLM < 0.12's names for structured_outputs' keys
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    truncate_prompt_tokens: TruncatePromptTokens = None
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "right" keeps the prompt's first tokens
    use_beam_search: bool = False
    logits_processors: list[Any] | None = None  # vLLM's per-request processors: refused, as vLLM refuses them
    priority: int = 0
    # unset or false: EOS, end-of-turn, pad and BOS are dropped, other specials are text (false keeps the EOS
    # tokens ignore_eos generates past); true: every special but the parser's delimiters is dropped
    # (`ember.server.generation.make_pipeline`)
    skip_special_tokens: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        _check_stop(v)
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return v
        for k, b in v.items():
            digits = k.removeprefix("-")
            if not (digits.isascii() and digits.isdigit()):
                raise ValueError(f"logit_bias keys must be token IDs, got {k!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be within [-100, 100], got {b}")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> "_SamplingFields":
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM refuse it
            raise field_error("stream_options", "stream_options can only be set with stream: true",
                              _dumped(self.stream_options))
        return self

    @property
    def stop_list(self) -> list[str]:
        return _check_stop(self.stop)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: tool_choice_union(NamedToolChoice, AllowedToolsChoice) | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # vLLM's: for the template to render (RAG)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens (BOS) on top of the template's
    echo: bool = False  # vLLM's: the reply starts with the last message's text when it has the reply's role
    max_thinking_tokens: int | None = Field(default=None, ge=0)
    thinking_token_budget: int | None = Field(default=None, ge=-1)  # vLLM's name for it; -1: no budget
    include_reasoning: bool = True  # vLLM's: false leaves the (still parsed) thought out of the reply
    chat_template: str | None = None  # vLLM's per-request template: refused, as vLLM refuses it by default
    functions: list[Any] | None = None  # refused (as function_call): the deprecated form of tools
    function_call: Any = None
    modalities: list[str] | None = None  # ["text"] only: audio output is refused
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None  # refused: no web search

    @model_validator(mode="before")
    @classmethod
    def _tool_choice_type(cls, data: Any) -> Any:
        """A tool_choice object of another type than ``function`` or ``allowed_tools`` (``custom``) is a 400 naming
        ``tool_choice.type``, not pydantic's mismatches with each member."""
        return refuse_other_tool_choice(data, '{"type": "function", "function": {"name": ...}}')

    @model_validator(mode="after")
    def _consistency(self) -> "ChatCompletionRequest":
        if self.chat_template is not None:
            raise field_error("chat_template", REQUEST_TEMPLATE_REFUSED, "...")
        for name in ("functions", "function_call"):  # ignored, the model would not see them or not be made to call
            if getattr(self, name) is not None:
                raise field_error(name, f"the deprecated {name} is not supported: send tools and tool_choice",
                                  "...")
        if self.audio is not None or any(m != "text" for m in self.modalities or ()):
            raise field_error("modalities" if self.audio is None else "audio",
                              "this model writes text only: no audio output", "...")
        if self.web_search_options is not None:
            raise field_error("web_search_options", "web search is not available on this server", "...")
        budget = self.thinking_token_budget
        if budget is not None:
            if self.max_thinking_tokens is not None and self.max_thinking_tokens != budget:
                raise field_error("thinking_token_budget", "thinking_token_budget (vLLM's name) and "
                                  "max_thinking_tokens disagree: send one", budget)
            self.max_thinking_tokens = None if budget == -1 else budget
        if self.top_logprobs and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs needs logprobs: true", self.top_logprobs)
        choice = self.tool_choice
        if (isinstance(choice, NamedToolChoice) or choice == "required") and not self.tools:
            raise field_error("tool_choice", "tool_choice needs tools", _dumped(choice))
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            name = choice.function.name
            raise field_error("tool_choice.function.name", f"tool_choice names {name!r}, which is not in tools", name)
        if isinstance(choice, AllowedToolsChoice):
            names = {t.function.name for t in self.tools or ()}
            for i, t in enumerate(choice.allowed_tools.tools):
                if t.function.name not in names:
                    raise field_error("tool_choice.allowed_tools.tools",
                                      f"tool_choice allows {t.function.name!r} (tools[{i}]), which is not in tools",
                                      t.function.name)
        if self.continue_final_message and self.add_generation_prompt:
            raise field_error("continue_final_message",
                              "continue_final_message and add_generation_prompt exclude each other", True)
        return self


def _prompt_shape(value: Any) -> str:
    """The member of `Prompt` that ``value`` is, by its first item: a bad item then gives one error, where trying
    every member gave one per item (millions, seconds of the event loop, for a long token list with one bad ID)."""
    if isinstance(value, str):
        return "str"
    first = value[0] if isinstance(value, list) and value else None
    return "list[str]" if isinstance(first, str) else "list[list[int]]" if isinstance(first, list) else "list[int]"


Prompt = Annotated[Annotated[str, Tag("str")] | Annotated[list[str], Tag("list[str]")]
                   | Annotated[list[StrictInt], Tag("list[int]")]
                   | Annotated[list[list[StrictInt]], Tag("list[list[int]]")], Discriminator(_prompt_shape)]
"""A prompt or embedding input: a text, texts, token IDs or lists of them (the tags read as pydantic's member names,
which `errors.field_path` leaves out)."""


class CompletionRequest(_SamplingFields):
    prompt: Prompt = Field(...)
    max_tokens: int | None = Field(default=16, ge=0)  # 0 only with echo: the prompt is scored, nothing generated
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _consistency(self) -> "CompletionRequest":
        if self.suffix:
            raise field_error("suffix", "suffix is not supported", self.suffix)
        if self.best_of is not None and self.best_of != self.n:
            raise field_error("best_of", "best_of other than n is not supported", self.best_of)
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise field_error("prompt", "prompt must not be empty", [])
        if self.max_tokens == 0 and not self.echo:
            raise field_error("max_tokens", "max_tokens 0 generates nothing: it needs echo: true (to return the "
                                            "prompt and, with logprobs, its scores)", 0)
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: each a text or a list of token IDs."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def _dumped(value: Any) -> Any:
    """A request value as it came in JSON (for an error's ``input``)."""
    return value.model_dump() if isinstance(value, BaseModel) else value
