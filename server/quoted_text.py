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
        changed = False
        out = []
        for message in messages:
            copy = dict(message)
            for key in _TEXT_FIELDS:
                value = copy.get(key)
                if isinstance(value, str):
                    marked = self._mark(value)
                    if marked is None:
                        return None
                    changed |= marked is not value
                    copy[key] = marked
                elif isinstance(value, list):
                    parts = []
                    for part in value:
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            marked = self._mark(part["text"])
                            if marked is None:
                                return None
                            changed |= marked is not part["text"]
                            part = {**part, "text": marked}
                        parts.append(part)
                    copy[key] = parts
            out.append(copy)
        return out if changed else None

    def _mark(self, text: str) -> str | None:
        if OPEN in text or CLOSE in text:
            return None
        return OPEN + text + CLOSE if self.spelling.search(text) else text


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
