"""Responses API input items -> the chat-template messages `chat.render` reads.

Items are checked one by one, each error naming `input[i]...`. The mapping:
- a string input is one user message;
- `message` items (`type` may be left out) keep their role (`developer` becomes `system`); text parts
  (`input_text`, `output_text`, `text`, `refusal`) are kept as parts (`content_format` joins them where the template
  reads a string); images, files and audio are refused (text-only);
- `function_call` items become the assistant's `tool_calls` (consecutive calls, and an assistant message right before
  them, form one assistant turn);
- `function_call_output` items become `tool` messages carrying the call's `tool_call_id` and `name`;
- `reasoning` items (their `reasoning_text` content, else their summary) become the next assistant turn's
  `reasoning_content`.

A response's own output items are valid input items, so a stored conversation is replayed through the same mapping.
"""
from __future__ import annotations

import secrets
from typing import Any, Sequence

from .chat import Content, arguments_object, set_reasoning
from .errors import ApiError, bad_request

_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as items: a string is one user message. Two items with one `id` are a 400, as OpenAI
    refuses them (the input item list pages by ID)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    seen: set[str] = set()
    for i, item in enumerate(value):
        ident = item.get("id") if isinstance(item, dict) else None
        if isinstance(ident, str):
            if ident in seen:
                raise bad_request(f"Duplicate item found with id {ident}. Remove duplicate items from your input and "
                                  "try again.", param=f"input[{i}].id")
            seen.add(ident)
    return list(value)


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def new_item_id(kind: str) -> str:
    """A fresh ID for an item of type ``kind`` (``msg_...``, ``fc_...``, ``rs_...``, ...)."""
    return f"{_ID_PREFIX.get(kind, 'item')}_{secrets.token_hex(12)}"


def listed_items(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as `GET /v1/responses/{id}/input_items` lists them: each with an `id` (kept when the client
    gave one), `type` and `status` (`completed` unless the client gave one), a message's string content as one text
    part (`output_text` for the assistant's, `input_text` otherwise)."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        listed = {"type": kind, **item}
        if listed.get("id") is None:  # absent or JSON null (the SDK's model_dump() writes null)
            listed["id"] = new_item_id(kind)
        if listed.get("status") is None:
            listed["status"] = "completed"
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            listed["content"] = [{"type": part, "text": item["content"]}]
        out.append(listed)
    return out


def _str_field(item: dict[str, Any], key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad_request(f"{key} must be a string", param=f"{where}.{key}")
    return v


def _text(content: Any, where: str) -> Content:
    """A message's content: a string, or its text parts' texts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of content parts", param=where)
    out = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            out.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in _TEXT_PARTS:
            raise bad_request(f"content part type {kind!r} is not supported by this text-only model",
                              param=f"{where}[{j}].type")
        key = "refusal" if kind == "refusal" else "text"
        out.append(_str_field(part, key, f"{where}[{j}]"))
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise bad_request(f"{key} must be a list", param=f"{where}.{key}")
        texts = []
        for j, p in enumerate(parts):
            if not isinstance(p, dict) or p.get("type") != kind:
                raise bad_request(f"{key} parts must have type {kind!r}", param=f"{where}.{key}[{j}].type")
            texts.append(_str_field(p, "text", f"{where}.{key}[{j}]"))
        if texts:
            return "".join(texts)
    return ""


def responses_messages(items: Sequence[Any], *, own_output: bool = False,
                       history: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Template messages for the input `items`, in order, following the messages of `history` (a
    `previous_response_id` chain): a ``function_call_output`` carries the ``name`` of its call, made here or there.
    `own_output` marks a response's own output items (replayed for `previous_response_id`): a call cut short, whose
    arguments are no JSON object, replays with ``{}`` (as an Anthropic cut `tool_use` does) instead of being refused,
    as does one a client sends back (its arguments no JSON, or ``status`` ``incomplete``); templates iterate a call's
    arguments, so its raw text would fail or misrender there. A completed call keeps its arguments, whatever JSON
    they are (a tool whose parameters are an array), however the conversation is sent back."""
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []
    call_names = {c["id"]: c["function"]["name"] for m in history for c in m.get("tool_calls") or ()}
    turn: dict[str, Any] | None = None  # the assistant turn function calls may still join

    def assistant(content: Content) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            set_reasoning(msg, "".join(reasoning))
            reasoning.clear()
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request("an input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise bad_request(f"role {role!r} is not one of {', '.join(_ROLES)}", param=f"{where}.role")
            if "content" not in item:
                raise bad_request("a message needs content", param=f"{where}.content")
            text = _text(item["content"], f"{where}.content")
            if _ROLES[role] == "assistant":
                turn = assistant(text)
            else:
                out.append({"role": _ROLES[role], "content": text})
                reasoning.clear()  # a thought whose turn ended without output belongs to no later turn
                turn = None
        elif kind == "function_call":
            name = _str_field(item, "name", where)
            call_id = _str_field(item, "call_id", where)
            raw = _str_field(item, "arguments", where)
            try:
                args = arguments_object(raw, f"{where}.arguments")
            except ApiError:
                if not own_output:
                    raise
                args = {}
            if item.get("status") == "incomplete" and not isinstance(args, dict):
                args = {}
            if turn is None or reasoning:
                turn = assistant("")
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
            call_names[call_id] = name
        elif kind == "function_call_output":
            call_id = _str_field(item, "call_id", where)
            msg = {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{where}.output")}
            if call_id in call_names:
                msg["name"] = call_names[call_id]
            out.append(msg)
            reasoning.clear()
            turn = None
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                reasoning.append(text)
            turn = None
        else:
            raise bad_request(f"input item type {kind!r} is not supported (message, function_call, "
                              "function_call_output and reasoning are)", param=f"{where}.type")
    return out
