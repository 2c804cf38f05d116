"""Chat prompts: request messages (OpenAI or Anthropic) -> the plain dicts a Jinja chat template reads -> prompt text.

Templates read `message.content` as a string or a list of text parts (`content_format` decides which: builders here
give a string where the client sent one, else the list of its parts' texts), the assistant's earlier reasoning as
`message.reasoning_content` (Qwen3, DeepSeek, GLM, ...), `message.thinking` (gpt-oss, LFM2) or `message.reasoning`
(Solar Open, Gemma 4; vLLM's name), and
`message.tool_calls[i].function` with `arguments` as a mapping (Hermes-style templates `tojson` it; Qwen3's accepts
either), so JSON arguments are parsed back into objects.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from . import anthropic_turns
from . import content_format as cf
from . import protocol_anthropic as pa
from . import protocol_openai as po
from .errors import bad_request

# apply_chat_template's and its renderer's own parameters, which chat_template_kwargs may not override.
_RESERVED_KWARGS = frozenset({
    "self", "conversation", "conversations", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens", "messages",
})


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: the template text itself when it contains `{`, `}` or a newline (vLLM's rule), else the
    path of a Jinja file (ValueError naming it when it cannot be read)."""
    if value is None or any(c in value for c in "{}\n"):
        return value
    p = Path(value).expanduser()
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise ValueError(f"--chat-template {value}: cannot read the file ({why})") from None


Content = str | list[str]  # as the client sent it: one string, or its text parts' texts


def _texts(parts: Iterable[Any], field: str, assistant: bool = False, references: bool = False) -> list[str]:
    """The texts of a message's content parts; an assistant's ``refusal`` parts are text to the template, as vLLM
    reads them; with ``references`` (an Anthropic tool result), a ``tool_reference`` is its block's JSON."""
    out = []
    for i, part in enumerate(parts):
        kind = getattr(part, "type", None)
        if kind == "refusal" and assistant:
            out.append(part.refusal)
            continue
        if kind == "tool_reference" and references:
            out.append(json.dumps({"type": "tool_reference", "tool_name": part.tool_name}, ensure_ascii=False))
            continue
        if kind != "text":
            only = " (refusal parts are an assistant's)" if kind == "refusal" else ""
            raise bad_request(f"content part type {part.type!r} is not supported by this text-only model{only}",
                              param=f"{field}[{i}].type")
        out.append(part.text)
    return out


def arguments_object(arguments: str | dict[str, Any], field: str) -> Any:
    """A replayed tool call's arguments as the template gets them: the parsed JSON, or ``{}`` for text that is no
    JSON (a call cut by ``max_tokens``, replayed as the client got it: OpenAI takes any string there, and an
    agent's history must not be refused on every later turn; templates iterate arguments, so the raw text would
    fail or misrender). Nesting json cannot decode is a 400 naming ``field``."""
    if isinstance(arguments, dict):
        return arguments
    if arguments.strip() == "":
        return {}
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    except RecursionError:  # json's decoder gives up on arrays and objects nested about a thousand deep
        raise bad_request("tool call arguments are nested too deeply", param=field) from None


THINKING_SWITCHES = ("enable_thinking", "thinking")
"""The chat-template variables that switch a model's thinking on or off: Qwen3's and GLM's ``enable_thinking``,
DeepSeek-V3.1's and Granite's ``thinking``."""


def thinking_switches(on: bool) -> dict[str, bool]:
    """Template variables turning thinking ``on`` (or off) in whichever of `THINKING_SWITCHES` a template reads."""
    return dict.fromkeys(THINKING_SWITCHES, on)


def thinking_switched_off(kwargs: dict[str, Any] | None) -> bool:
    """Whether chat-template variables switch thinking off (any of `THINKING_SWITCHES` false)."""
    return any((kwargs or {}).get(k) is False for k in THINKING_SWITCHES)


def set_reasoning(msg: dict[str, Any], text: str) -> None:
    """An assistant message's reasoning, under each name templates read it by (vLLM gives `reasoning` and
    `reasoning_content`; gpt-oss's and LFM2's templates read `thinking`)."""
    msg["reasoning_content"] = text
    msg["reasoning"] = text
    msg["thinking"] = text


def openai_messages(messages: Sequence[po.ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI chat messages -> template messages (`developer` becomes `system`, `function` becomes `tool`)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        content: Content
        if m.content is None:
            content = []
        elif isinstance(m.content, str):
            content = m.content
        else:
            content = _texts(m.content, f"messages[{i}].content", assistant=role == "assistant")
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if role == "assistant" and reasoning is not None:
            set_reasoning(msg, reasoning)
        if m.tool_calls:  # an id the client left out stays out (templates test `id is defined`), as vLLM passes it
            msg["tool_calls"] = [
                {
                    **({"id": tc.id} if tc.id is not None else {}),
                    "type": "function",
                    "function": {
                        "name": tc.function.name,
                        "arguments": arguments_object(tc.function.arguments,
                                                       f"messages[{i}].tool_calls[{j}].function.arguments"),
                    },
                }
                for j, tc in enumerate(m.tool_calls)
            ]
        if role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def openai_tools(tools: Sequence[po.Tool] | None) -> list[dict[str, Any]] | None:
    """Tools as the plain dicts the client sent (templates `tojson` them; the parsers and grammar read them), with
    an empty object schema where `parameters` is missing."""
    if not tools:
        return None
    out = []
    for t in tools:
        d = t.model_dump(exclude_none=True)
        _default_parameters(d["function"])
        out.append(d)
    return out


def responses_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """Responses API function tools (`{"type": "function", "name", ...}`, flat) in chat's shape, which templates,
    parsers and the grammar read, with an empty object schema where `parameters` is missing."""
    if not tools:
        return None
    return [{"type": "function", "function": _default_parameters(t.model_dump(exclude={"type"}, exclude_none=True))}
            for t in tools]


def _default_parameters(fn: dict[str, Any]) -> dict[str, Any]:
    fn.setdefault("parameters", {"type": "object", "properties": {}})
    return fn


def anthropic_tools(tools: Sequence[pa.ToolDef] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.name}
        if t.description is not None:
            fn["description"] = t.description
        fn["parameters"] = t.input_schema
        if t.strict is not None:
            fn["strict"] = t.strict
        out.append({"type": "function", "function": fn})
    return out


def _tool_result_text(block: pa.ToolResultBlock, field: str) -> Content:
    if block.content is None:
        return []
    if isinstance(block.content, str):
        return block.content
    return _texts(block.content, f"{field}.content", references=True)


def anthropic_messages(system: str | Sequence[pa.TextBlock] | None,
                       messages: Sequence[pa.Message]) -> list[dict[str, Any]]:
    """Anthropic system + messages -> template messages, one per turn (`anthropic_turns`: consecutive messages of a
    role combined, tool results in call order): `thinking` blocks become the assistant's `reasoning_content`,
    `tool_use` blocks its `tool_calls`, `tool_result` blocks `tool` messages. A system without text (``""``, ``[]``,
    empty blocks) is no system turn, so the template's default system prompt stays; a final assistant turn without
    text or blocks (``""``, ``[]``, empty text blocks: a prefill of nothing) after other turns is no turn either, so
    the reply starts at the template's generation prompt (a template would render it as a finished turn, a closed
    empty thought)."""
    out: list[dict[str, Any]] = []
    if system is not None:
        text: Content = system if isinstance(system, str) else _texts(system, "system")
        if "".join(text):
            out.append({"role": "system", "content": text})
    conversation = anthropic_turns.turns(messages)
    if len(conversation) > 1 and conversation[-1].role == "assistant" and _says_nothing(conversation[-1]):
        conversation.pop()
    for t, turn in enumerate(conversation):
        if turn.text is not None:
            out.append({"role": turn.role, "content": turn.text})
        elif turn.role == "assistant":
            out.append(_assistant_turn(turn, last=t == len(conversation) - 1))
        else:
            out.extend(_user_turn(turn))
    return out


def _says_nothing(turn: anthropic_turns.Turn) -> bool:
    """Whether a turn holds no text and no block other than empty text blocks."""
    if turn.text is not None:
        return not turn.text
    return all(b.type == "text" and not b.text for _, b in turn.blocks)


def _assistant_turn(turn: anthropic_turns.Turn, last: bool) -> dict[str, Any]:
    text, thinking, calls = [], [], []
    for where, b in turn.blocks:
        if b.type == "text":
            text.append(b.text)
        elif b.type == "thinking":
            thinking.append(b.thinking)
        elif b.type == "redacted_thinking":
            continue
        elif b.type in ("tool_use", "server_tool_use"):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        else:
            raise bad_request(f"content block type {b.type!r} is not allowed in an assistant message",
                              param=f"{where}.type")
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        set_reasoning(msg, "".join(thinking))
    if calls:
        if last:  # a continued reply cannot start after calls the template renders
            raise bad_request("the final assistant message ends with tool_use blocks: send their results as "
                              "tool_result blocks in a following user message",
                              param=f"messages[{turn.index}].content")
        msg["tool_calls"] = calls
    return msg


_ASSISTANT_ONLY = frozenset({"tool_use", "thinking", "redacted_thinking", "server_tool_use"})


def _user_turn(turn: anthropic_turns.Turn) -> list[dict[str, Any]]:
    """A user turn's messages: its tool results as `tool` messages, the texts between them as user messages."""
    out: list[dict[str, Any]] = []
    pending_text: list[str] = []
    for where, b in turn.blocks:
        if b.type == "text":
            pending_text.append(b.text)
        elif b.type == "tool_result":
            if pending_text:
                out.append({"role": "user", "content": pending_text})
                pending_text = []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _tool_result_text(b, where)})
        elif b.type in _ASSISTANT_ONLY:
            raise bad_request(f"content block type {b.type!r} is not allowed in a user message (only the assistant "
                              "writes it)", param=f"{where}.type")
        else:
            raise bad_request(f"content block type {b.type!r} is not supported in a user message by this text-only "
                              "model", param=f"{where}.type")
    if pending_text or not turn.blocks:
        out.append({"role": "user", "content": pending_text})
    return out


def named_template(template: str | dict[str, str] | None, tools: list[dict[str, Any]] | None) -> str | None:
    """The template to render with. A tokenizer's named templates (Hermes 2 Pro / Hermes 3 / Command R ship a
    ``default`` and a ``tool_use`` one; transformers loads them as a dict) give ``tool_use`` when the request has
    tools and the model has one, else ``default``, as transformers chooses; a single template is itself."""
    if not isinstance(template, dict):
        return template
    chosen = template.get("tool_use") if tools else None
    return chosen if chosen is not None else template.get("default")


def render(tokenizer: Any, template: str | dict[str, str] | None, messages: list[dict[str, Any]], *,
           tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
           continue_final_message: bool = False, kwargs: dict[str, Any] | None = None, field: str = "messages",
           content_format: cf.ContentFormat = "string", documents: list[dict[str, Any]] | None = None) -> str:
    """The prompt text, each message's content given to the template in ``content_format`` (``template``: the text,
    a tokenizer's named templates, see `named_template`, or None for the tokenizer's own); ``documents`` (vLLM's RAG
    field) go to the template as its ``documents`` (Granite, Command R render them); a template that fails on these
    messages is the request's fault (400 naming ``field``, the request field the messages came from)."""
    extra = {k: v for k, v in (kwargs or {}).items() if k not in _RESERVED_KWARGS}
    bad = sorted(set(kwargs or {}) - set(extra))
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs")
    if isinstance(template, dict):
        names, template = sorted(template), named_template(template, tools)
        if template is None:
            raise bad_request(f"this model's chat templates ({', '.join(names)}) have no default to render {field}",
                              param=field)
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise bad_request(f"this model has no chat template to render {field}: send the text itself (input, prompt) "
                          "or start the server with --chat-template", param=field)
    if continue_final_message and messages and messages[-1].get("tool_calls"):
        # transformers cuts the prompt after the final message's text, so its calls would silently disappear
        raise bad_request("continue_final_message continues the final message's text, and this one ends with tool "
                          "calls: send their results as tool messages instead", param=f"{field}[{len(messages) - 1}]"
                          ".tool_calls")

    def apply(tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> Any:
        return tokenizer.apply_chat_template(
            cf.apply(messages, content_format), tools=tools, chat_template=template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, tokenize=False,
            documents=documents, **extra)

    # Retried only where the first form fails: gpt-oss's template adds a tool's description unguarded (the API has it
    # optional) and refuses a tool-call turn with both a thought and text; DeepSeek's templates concatenate a replayed
    # call's arguments as text (others iterate the object).
    tool_forms = [tools, *filter(None, [_with_descriptions(tools)])]
    message_forms = [messages]
    for form in (_string_arguments, _preambles_in_thoughts):
        message_forms += [m for m in map(form, message_forms) if m is not None]
    try:
        first_error: Exception | None = None
        for ms, ts in itertools.product(message_forms, tool_forms):
            try:
                text = apply(ts, ms)
                break
            except RecursionError:
                raise
            except Exception as e:
                first_error = first_error or e
        else:
            raise first_error  # type: ignore[misc]
    except RecursionError:  # arguments, a schema or a template variable nested deeper than Jinja and json reach
        deepest = max((_depth(extra), "chat_template_kwargs"), (_depth(tools), "tools"), (_depth(messages), field))
        raise bad_request(f"the chat template could not render these messages: {deepest[1]} are nested too deeply",
                          param=deepest[1]) from None
    except Exception as e:  # jinja2 TemplateError, raise_exception(...) in the template, type errors on odd input
        raise bad_request(f"the chat template could not render these messages: {e}", param=field) from None
    if not isinstance(text, str):
        raise bad_request("the chat template did not produce text", param=field)
    return text


def _depth(value: Any) -> int:
    """How deep lists and objects nest in ``value`` (without recursion: it may be nested too deeply for that)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend((x, d + 1) for x in v)
    return deepest


def _with_descriptions(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """``tools`` with an empty description on each function that has none; None when every one has one."""
    if not tools or all("description" in t.get("function", {}) for t in tools):
        return None
    return [{**t, "function": {"description": "", **t["function"]}} if "function" in t else t for t in tools]


def _string_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``messages`` with each replayed call's arguments as JSON text (what the model wrote and the API carries), for
    templates that concatenate them; None when no message has a call."""
    if not any(m.get("tool_calls") for m in messages):
        return None
    return [{**m, "tool_calls": [{**tc, "function": {**tc["function"], "arguments": _json_text(tc["function"])}}
                                 for tc in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


def _preambles_in_thoughts(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``messages`` with the text of each assistant turn that has a thought, text and calls (gpt-oss's analysis, its
    commentary preamble, a call: its own output, as Ember parses it) moved to the end of the thought, for a template
    that renders one analysis message per call turn; None when no turn has all three."""
    def text(m: dict[str, Any]) -> str:
        content = m.get("content") or ""
        return content if isinstance(content, str) else "\n".join(content)

    def both(m: dict[str, Any]) -> bool:
        return bool(m.get("tool_calls") and m.get("reasoning_content") and text(m))

    if not any(both(m) for m in messages):
        return None
    out = []
    for m in messages:
        if both(m):
            m = dict(m)
            set_reasoning(m, m["reasoning_content"] + "\n\n" + text(m))
            m["content"] = ""
        out.append(m)
    return out


def _json_text(function: dict[str, Any]) -> Any:
    arguments = function.get("arguments")
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def encode(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """Prompt text -> token IDs; the template already wrote any BOS, so no special tokens are added unless asked
    (vLLM's ``add_special_tokens``)."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
