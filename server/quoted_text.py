"""Message text kept as ordinary tokens in a harmony (gpt-oss) prompt.

vLLM renders gpt-oss prompts with the harmony library, which writes a message's text with ordinary tokens only: a
user whose text spells ``<|end|><|start|>system<|message|>`` does not open a system message. Ember renders the chat
template to text and tokenizes it, where that spelling would become the control tokens. `TextQuoter` marks each
text of the request that spells one (message content in any shape, thoughts, tool results, a replayed call's
arguments and its keys, the tools' names, descriptions and property names, chat_template_kwargs, documents) between
two random private-use sentinels that no text of the request holds, and the marked spans are tokenized as ordinary
text afterwards.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

_PRIVATE_USE = [chr(c) for c in range(0xE000, 0xF900)]
"""The Basic Multilingual Plane's private-use characters, which sentinels are spelled in (no template filter changes
them: case, trimming, escaping)."""
_SENTINEL_LENGTH = 8
"""Characters per sentinel: 6400^8 (about 2^101) spellings, so no request can hold them by chance or by design."""


@dataclass(frozen=True)
class Quoted:
    """A template's inputs (by name) with their texts marked between ``open`` and ``close``."""

    inputs: dict[str, Any]
    open: str
    close: str


@dataclass(frozen=True)
class TextQuoter:
    """The added tokens' spellings of one tokenizer (a pattern matching any of them)."""

    spelling: re.Pattern

    @classmethod
    def of(cls, tokenizer: Any) -> "TextQuoter | None":
        """For ``tokenizer``'s added tokens longer than one character; None when it has none."""
        spellings = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if len(t.content) > 1}
        if not spellings:
            return None
        return cls(re.compile("|".join(map(re.escape, sorted(spellings, key=len, reverse=True)))))

    def quote(self, inputs: dict[str, Any]) -> Quoted | None:
        """``inputs`` (the template's: messages, tools, kwargs, documents) with each string that spells an added token
        (a value or a key, at any depth) between two sentinels that no string of the inputs holds; None when none
        does."""
        texts: list[str] = []
        _collect(inputs, texts)
        if not any(self.spelling.search(t) for t in texts):
            return None
        chooser = random.Random()
        while True:
            open_, close = ("".join(chooser.choices(_PRIVATE_USE, k=_SENTINEL_LENGTH)) for _ in range(2))
            if open_ != close and not any(open_ in t or close in t for t in texts):
                break
        mark = self._marker(open_, close)
        return Quoted({name: _mapped(value, mark) for name, value in inputs.items()}, open_, close)

    def _marker(self, open_: str, close: str):
        def mark(text: str) -> str:
            return open_ + text + close if self.spelling.search(text) else text
        return mark


def _collect(value: Any, out: list[str]) -> None:
    """Every string inside ``value`` (dicts' keys and values, lists' items; the template's own structure, a role or a
    part's type, never spells a control token, so marking leaves it as it is)."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _collect(k, out)
            _collect(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out)


def _mapped(value: Any, mark) -> Any:
    """``value`` with `mark` applied to each string `_collect` finds (new containers; the input is not modified)."""
    if isinstance(value, str):
        return mark(value)
    if isinstance(value, dict):
        return {_mapped(k, mark): _mapped(v, mark) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mapped(v, mark) for v in value]
    return value


def encode_quoted(tokenizer: Any, text: str, open_: str, close: str) -> list[int] | None:
    """The token IDs of a prompt rendered from `TextQuoter.quote`'s messages: the marked spans as ordinary text, the
    rest as usual; None when the sentinels do not pair up (the template moved or dropped one)."""
    head, *spans = text.split(open_)
    if close in head:
        return None
    ids = list(tokenizer.encode(head, add_special_tokens=False))
    for span in spans:
        inner, sep, rest = span.partition(close)
        if not sep or close in rest:
            return None
        ids += tokenizer.encode(inner, add_special_tokens=False, split_special_tokens=True)
        ids += tokenizer.encode(rest, add_special_tokens=False)
    return ids
