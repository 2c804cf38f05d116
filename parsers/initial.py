"""Where the reply starts: inside a thought the prompt opened, or in the answer.

Computed once per request from the prompt token IDs and shared by the parser and the grammar builder, so the two can
never disagree (design A.3, I9, I10). Only the prompt after the LAST generation header counts (history turns, tool
examples and system prompts never flip it); within that tail the last thinking delimiter decides: an open -> REASONING,
a close -> CONTENT, neither -> the profile's ``start_mode``. A delimiter that is a single token in this vocabulary
(``delimiter_ids``) counts only as that token; one that is not is matched on the tail's text. An assistant prefill
(``continue_final_message``) lies in the tail, so its thought state carries over.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from .profiles import Profile
from .tokens import TokenBytes

__all__ = ["InitialState", "initial_state"]


class InitialState(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"


def _tail_after_header(prompt_ids: Sequence[int], headers: Sequence[bytes],
                       tb: TokenBytes) -> tuple[int, bytes, list[int]]:
    """(index of the first tail token, tail bytes, byte offset of each tail token within the tail).

    The tail starts right after the last occurrence of any header; the whole prompt when no header occurs. Windows of
    the prompt's end grow geometrically, so a long prompt is decoded only as far back as its last header.
    """
    n = len(prompt_ids)
    window = 64
    while True:
        start = max(0, n - window)
        pieces = [tb.token_bytes(i) for i in prompt_ids[start:]]
        text = b"".join(pieces)
        cut = -1
        for h in headers:
            p = text.rfind(h)
            if p >= 0:
                cut = max(cut, p + len(h))
        if cut >= 0 or start == 0:
            break
        window *= 4
    cut = max(cut, 0)
    offsets: list[int] = []
    pos = 0
    first = start
    for k, b in enumerate(pieces):
        end = pos + len(b)
        if end <= cut:
            first = start + k + 1
        else:
            offsets.append(pos - cut)
        pos = end
    return first, text[cut:], offsets


def _last_position(text_pos: int, tail_ids: Sequence[int], offsets: Sequence[int], token_id: int | None) -> int:
    if token_id is None:
        return text_pos
    for k in range(len(tail_ids) - 1, -1, -1):
        if tail_ids[k] == token_id:
            return offsets[k]
    return -1


def initial_state(prompt_ids: Sequence[int], profile: Profile, tb: TokenBytes,
                  delimiter_ids: Mapping[str, int]) -> InitialState:
    """REASONING if the prompt's tail leaves a thought open, else CONTENT (see the module docstring)."""
    spec = profile.reasoning
    if spec is None:
        return InitialState.CONTENT
    headers = [h.encode("utf-8") for h in profile.generation_headers if h]
    first, tail, offsets = _tail_after_header(prompt_ids, headers, tb)
    tail_ids = prompt_ids[first:]

    def last(delim: str | None) -> int:
        if not delim:
            return -1
        tid = delimiter_ids.get(delim)
        text_pos = tail.rfind(delim.encode("utf-8")) if tid is None else -1
        return _last_position(text_pos, tail_ids, offsets, tid)

    open_at, close_at = last(spec.open), last(spec.close)
    if open_at > close_at:
        return InitialState.REASONING
    if close_at >= 0:
        return InitialState.CONTENT
    return InitialState.REASONING if spec.start_mode == "always" else InitialState.CONTENT
