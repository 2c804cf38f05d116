"""Request bodies of the Anthropic-compatible endpoints (`/v1/messages`, `/v1/messages/count_tokens`).

Field names follow the Anthropic Messages API reference. Unknown fields are accepted and ignored.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from .errors import THREAD_UNSUPPORTED


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ImageBlock(_Lenient):
    type: Literal["image", "document", "search_result", "container_upload", "browser_state"]


class ToolReferenceBlock(_Lenient):
    """A tool search result naming a tool (`defer_loading` tools are in the prompt from the start here)."""
    type: Literal["tool_reference"]
    tool_name: str


class ToolUseBlock(_Lenient):
    type: Literal["tool_use", "server_tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock | ToolReferenceBlock, Field(discriminator="type")]] | None = (
        None)
    is_error: bool | None = Field(default=None, strict=True)


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type")]
"""A content block, chosen by its ``type`` (an unknown type is named as such, not as a failed string)."""


class Message(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDef(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required of custom tools (checked after the type)
    type: str | None = None  # "custom" or absent; server tools (web_search_...) are refused
    strict: bool | None = Field(default=None, strict=True)  # strict tool use: its inputs must match input_schema


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = Field(default=None, strict=True)

    @model_validator(mode="after")
    def _named(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type tool needs a name")
        return self


class ThinkingConfig(_Lenient):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=0, strict=True)
    display: Literal["summarized", "omitted"] | None = None  # "omitted": thinking blocks keep only their signature


class OutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class OutputConfig(_Lenient):
    format: OutputFormat | None = None
    effort: str | None = None


class _MessagesBase(_Lenient):
    """Numbers and switches are taken only as JSON numbers and booleans, as Anthropic takes them (no ``"3"`` for 3,
    no ``true`` for 1, no ``"yes"`` for true)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    thread: dict[str, Any] | None = None  # the SDK's message threads: always refused (`_no_threads`)
    mcp_servers: list[dict[str, Any]] | None = None  # the MCP connector: refused when non-empty, as server tools are

    @model_validator(mode="before")
    @classmethod
    def _no_threads(cls, data: Any) -> Any:
        """A message thread (the beta ``thread`` field: the server keeps the conversation) is refused before anything
        else, as a server without threads answers, so the SDK resends the whole conversation."""
        if isinstance(data, dict) and data.get("thread") is not None:
            raise PydanticCustomError(THREAD_UNSUPPORTED, "message threads (the thread field) are not supported: "
                                                          "send the whole conversation in messages")
        return data

    @property
    def parallel_tool_use(self) -> bool:
        """Whether the reply may hold several tool calls (``tool_choice.disable_parallel_tool_use`` not set)."""
        return not (self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use)

    @property
    def omits_thinking(self) -> bool:
        """Whether thinking blocks are returned with their signature only (``thinking.display: "omitted"``)."""
        return self.thinking is not None and self.thinking.display == "omitted"

    @model_validator(mode="after")
    def _contents(self) -> "_MessagesBase":
        last = len(self.messages) - 1
        for i, m in enumerate(self.messages):
            if not m.content and not (i == last and m.role == "assistant"):
                raise ValueError(f"messages[{i}].content: all messages must have non-empty content except for the "
                                 "optional final assistant message")
        return self

    @model_validator(mode="after")
    def _tools(self) -> "_MessagesBase":
        if self.mcp_servers:
            raise ValueError("mcp_servers: the MCP connector (tools run by remote MCP servers) is not supported; "
                             "run the MCP client yourself and pass its tools in tools")
        for i, t in enumerate(self.tools or ()):
            if t.type not in (None, "custom"):
                raise ValueError(f"tools[{i}]: server tool type {t.type!r} is not supported")
            if t.input_schema is None:
                raise ValueError(f"tools[{i}].input_schema is required")
            if t.input_schema.get("type") != "object":
                raise ValueError(f"tools[{i}].input_schema.type must be 'object'")
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if self.tool_choice is not None and self.tool_choice.type == "tool":
            if self.tool_choice.name not in {t.name for t in self.tools or ()}:
                raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not in tools")
        return self


class Metadata(_Lenient):
    user_id: str | None = Field(default=None, max_length=256, strict=True)


class MessagesRequest(_MessagesBase):
    max_tokens: int = Field(ge=1, strict=True)
    stop_sequences: list[str] | None = None
    stream: bool = Field(default=False, strict=True)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, strict=True)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, strict=True)
    top_k: int | None = Field(default=None, ge=-1, strict=True)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63, strict=True)  # extension: reproducible sampling
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's first spelling of output_config.format

    @model_validator(mode="after")
    def _output_format(self) -> "MessagesRequest":
        """The beta's ``output_format`` (which the SDKs still send) is ``output_config.format``; both given is a
        400 unless they agree."""
        if self.output_format is None:
            return self
        config = self.output_config or OutputConfig()
        if config.format is not None and config.format != self.output_format:
            raise ValueError("output_format: give the schema in output_config.format or in output_format, not both")
        self.output_config = config.model_copy(update={"format": self.output_format})
        return self

    @model_validator(mode="after")
    def _stops(self) -> "MessagesRequest":
        if any(s == "" for s in self.stop_sequences or ()):
            raise ValueError("stop_sequences must be non-empty strings")
        return self


class CountTokensRequest(_MessagesBase):
    pass
