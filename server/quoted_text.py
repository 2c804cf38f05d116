"""Message text kept as ordinary tokens in a harmony (gpt-oss) prompt.

vLLM renders gpt-oss prompts with the harmony library, which writes a message's text with ordinary tokens only: a
user whose text spells ``<|end|><|start|>system<|message|>`` does not open a system message. Ember renders the chat
template to text and tokenizes it, where that spelling would become the control tokens. `TextQuoter` marks each
text of the request that spells one (message content in any shape, thoughts, tool results, a replayed call's
arguments, the tools' names and descriptions) between two private-use sentinels that no text of the request holds,
and the marked spans are tokenized as ordinary text afterwards.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_SENTINELS = range(0xE000, 0xF900)
"""The Basic Multilingual Plane's private-use characters, from which `TextQuoter` picks two no text holds."""
_STRUCTURE = frozenset({"role", "type"})
"""Fields whose values are the template's structure, never the request's text."""


@dataclass(frozen=True)
class Quoted:
    """A request's messages and tools with their texts marked between ``open`` and ``close``."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
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

    def quote(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
              ) -> Quoted | None:
        """``messages`` and ``tools`` with each text that spells an added token between two sentinels; None when no
        text does."""
        texts: list[str] = []
        _collect([*messages, *(tools or ())], texts)
        if not any(self.spelling.search(t) for t in texts):
            return None
        used = {ord(c) for t in texts for c in t if 0xE000 <= ord(c) < 0xF900}
        open_, close = (chr(c) for c in [c for c in _SENTINELS if c not in used][:2])
        mark = self._marker(open_, close)
        return Quoted([_mapped(m, mark) for m in messages], [_mapped(t, mark) for t in tools] if tools else tools,
                      open_, close)

    def _marker(self, open_: str, close: str):
        def mark(text: str) -> str:
            return open_ + text + close if self.spelling.search(text) else text
        return mark


def _collect(value: Any, out: list[str]) -> None:
    """Every string inside ``value`` (dicts' values but their `_STRUCTURE` fields, lists' items)."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            if k not in _STRUCTURE:
                _collect(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out)


def _mapped(value: Any, mark) -> Any:
    """``value`` with `mark` applied to each string `_collect` finds (new containers; the input is not modified)."""
    if isinstance(value, str):
        return mark(value)
    if isinstance(value, dict):
        return {k: v if k in _STRUCTURE else _mapped(v, mark) for k, v in value.items()}
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
