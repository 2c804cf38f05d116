"""How a chat template receives a message's content (``--chat-template-content-format``, vLLM's setting).

Message builders (`chat.openai_messages`, `anthropic_messages`, `responses_input`) give `content` as a string when
the client sent one, else as the list of its text parts' strings (empty when it sent none). `apply` turns that into
what the template reads; a tool message's content is always one string, as templates print a tool result whole:

- ``string``: one string, several text parts joined with a newline (vLLM's join);
- ``openai``: a list of ``{"type": "text", "text": ...}`` parts, a string becoming one part (vLLM's form);
- ``auto`` (the default): ``string`` unless the template loops over a message's content; then a user message's
  content goes as the client sent it, a string as a string and parts as parts, and every other role's as one string
  (``as_sent``). vLLM would make every content a list there, which breaks templates that print some roles' content
  whole (Gemma 4 prints its system turn's content, so a list shows as its Python repr) or read only its first part
  (Mistral Small 3.2, Devstral, Llama 3.x JSON and others keep a system prompt's first text part; Devstral, Apriel
  and vLLM's mistral3 an assistant turn's); every looping template among the 88 real ones Ember is tested with
  renders a string content correctly, and they loop over content for a user's parts (images, in other servers).
"""
from __future__ import annotations

from typing import Any, Literal

import jinja2
from jinja2 import nodes

ContentFormat = Literal["string", "openai", "as_sent"]


def resolve(option: str, template: str | dict[str, str] | None) -> ContentFormat:
    """The format to render with: ``option`` unless it is ``auto``; for ``auto``, ``as_sent`` when `detect` finds
    that ``template`` (a tokenizer's named templates: its ``default``) loops over content, else ``string``."""
    if option in ("string", "openai"):
        return option  # type: ignore[return-value]
    if isinstance(template, dict):
        template = template.get("default")
    return "as_sent" if template and detect(template) == "openai" else "string"


def detect(template: str) -> ContentFormat:
    """``openai`` when some ``{% for %}`` iterates a message's ``content`` (``message['content']`` or
    ``message.content``, optionally through filters), where ``message`` is a loop variable over ``messages`` (or a
    variable set from it, such as ``loop_messages = messages[1:]``), else ``string``; a template that does not
    parse is read as ``string``."""
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    lists = {"messages"}
    for _ in range(2):  # a list set from one set from `messages`
        lists |= {a.target.name for a in tree.find_all(nodes.Assign)
                  if isinstance(a.target, nodes.Name) and _names(a.node, lists)}
    loops = list(tree.find_all(nodes.For))
    items = {loop.target.name for loop in loops if isinstance(loop.target, nodes.Name) and _names(loop.iter, lists)}
    for loop in loops:
        node = _unfiltered(loop.iter)
        key = node.attr if isinstance(node, nodes.Getattr) else (
            node.arg.value if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) else None)
        if key == "content" and _names(node.node, items):
            return "openai"
    return "string"


def _unfiltered(node: nodes.Node) -> nodes.Node:
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    return node


def _names(node: nodes.Node, names: set[str]) -> bool:
    """Whether ``node`` is one of ``names``, a slice or element of one, or one through filters."""
    node = _unfiltered(node)
    while isinstance(node, nodes.Getitem) and isinstance(node.arg, (nodes.Slice, nodes.Const)) \
            and not isinstance(getattr(node.arg, "value", 0), str):
        node = _unfiltered(node.node)
    return isinstance(node, nodes.Name) and node.name in names


def apply(messages: list[dict[str, Any]], fmt: ContentFormat) -> list[dict[str, Any]]:
    """``messages`` with each `content` in ``fmt`` (new dicts where one changes; the input is not modified)."""
    return [_message(m, fmt) for m in messages]


def _message(msg: dict[str, Any], fmt: ContentFormat) -> dict[str, Any]:
    content, role = msg.get("content"), msg.get("role")
    if fmt == "string" or role == "tool" or (fmt == "as_sent" and (not content or role != "user")):
        if isinstance(content, list):
            return {**msg, "content": "\n".join(content)}
        return msg
    if fmt == "as_sent" and isinstance(content, str):
        return msg
    texts = [content] if isinstance(content, str) else (content or [])
    return {**msg, "content": [{"type": "text", "text": t} for t in texts]}
