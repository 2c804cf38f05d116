"""Message text kept as ordinary tokens in a harmony (gpt-oss) prompt.

vLLM renders gpt-oss prompts with the harmony library, which writes a message's text with ordinary tokens only: a
user whose text spells ``<|end|><|start|>system<|message|>`` does not open a system message. Ember renders the chat
template to text and tokenizes it, where that spelling would become the control tokens. `TextQuoter` marks each
message text that spells one with private-use sentinels before rendering and tokenizes the marked spans as ordinary
text afterwards.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "\ue000", "\ue001"
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "thinking")


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

    def quote(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """``messages`` with each text (content, its text parts, a thought) that spells an added token between the
        sentinels; None when none does, or when a text holds a sentinel itself (then nothing is marked)."""
        texts = [t for m in messages for t in _texts(m)]
        if any(OPEN in t or CLOSE in t for t in texts) or not any(self.spelling.search(t) for t in texts):
            return None
        return [self._quoted(m) for m in messages]

    def _quoted(self, message: dict[str, Any]) -> dict[str, Any]:
        copy = dict(message)
        for key in _TEXT_FIELDS:
            value = copy.get(key)
            if isinstance(value, str):
                copy[key] = self._mark(value)
            elif isinstance(value, list):
                copy[key] = [{**p, "text": self._mark(p["text"])} if _is_text_part(p) else p for p in value]
        return copy

    def _mark(self, text: str) -> str:
        return OPEN + text + CLOSE if self.spelling.search(text) else text


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("text"), str)


def _texts(message: dict[str, Any]) -> list[str]:
    """The texts of ``message`` that `TextQuoter` marks."""
    out = []
    for key in _TEXT_FIELDS:
        value = message.get(key)
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list):
            out += [p["text"] for p in value if _is_text_part(p)]
    return out


def encode_quoted(tokenizer: Any, text: str) -> list[int] | None:
    """The token IDs of a prompt rendered from `TextQuoter.quote`'s messages: the marked spans as ordinary text, the
    rest as usual; None when the sentinels do not pair up (the template moved or dropped one)."""
    head, *spans = text.split(OPEN)
    if CLOSE in head:
        return None
    ids = list(tokenizer.encode(head, add_special_tokens=False))
    for span in spans:
        inner, sep, rest = span.partition(CLOSE)
        if not sep or CLOSE in rest:
            return None
        ids += tokenizer.encode(inner, add_special_tokens=False, split_special_tokens=True)
        ids += tokenizer.encode(rest, add_special_tokens=False)
    return ids
