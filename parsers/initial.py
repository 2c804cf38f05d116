"""Where the reply starts: inside a thought the prompt opened, or in the answer.

Computed once per request from the prompt token IDs and shared by the parser and the grammar builder, so the two can
never disagree (design A.3, I9, I10). Only the prompt after the LAST generation header counts (history turns, tool
examples and system prompts never flip it); within that tail the last thinking delimiter decides: an open -> REASONING,
a close -> CONTENT, neither -> the profile's ``start_mode``. A prompt without any generation header (the request
turned ``add_generation_prompt`` off) is all tail, but an open there counts only where the prompt ends in it (a
system prompt's ``<think>`` is text). A delimiter that is a single token in this vocabulary
(``delimiter_ids``) counts only as that token; one that is not is matched on the tail's text. An assistant prefill
(``continue_final_message``) lies in the tail, so its thought state carries over.

Harmony (gpt-oss) has no thinking delimiters: its channels decide. After the last ``<|start|>assistant`` the tail is
either nothing (the generation prompt: the model writes the header, CONTENT), a header cut right after
``<|channel|>`` (HARMONY_CHANNEL: the model writes the channel name), or a header closed by ``<|message|>`` whose body
the model continues (a continued assistant message, e.g. ``<|channel|>final<|message|>Hello``): an ``analysis``
channel -> REASONING, any other -> HARMONY_CONTENT. A recipient in that header does not make the continuation a tool
call (the call's name, id and arguments so far are prompt, not output): its body surfaces as the channel's text, as
when tools are not parsed. A tail whose last message is already closed (``<|end|>``) or whose header is cut elsewhere
starts in the header, as the generation prompt does; so does a prompt without ``<|start|>assistant``.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from .profiles import Profile
from .tokens import TokenBytes

__all__ = ["InitialState", "initial_state"]


class InitialState(enum.Enum):
    """Where the reply starts. The two HARMONY_ members occur only for a harmony profile (gpt-oss), where REASONING is
    the body of an analysis message the prompt opened and CONTENT the start of a message header (the generation
    prompt ends ``<|start|>assistant``); code that does not parse harmony never sees them."""

    REASONING = "reasoning"
    CONTENT = "content"
    HARMONY_CONTENT = "harmony_content"   # inside a final (or commentary) message body the prompt opened
    HARMONY_CHANNEL = "harmony_channel"   # the prompt's header ends with `<|channel|>`: the channel name comes next


def _tail_after_header(prompt_ids: Sequence[int], headers: Sequence[bytes],
                       tb: TokenBytes) -> tuple[int, bytes, list[int], bool]:
    """(index of the first tail token, tail bytes, byte offset of each tail token within the tail, whether a header
    occurs).

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
    found, cut = cut >= 0, max(cut, 0)
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
    return first, text[cut:], offsets, found


def _last_position(text_pos: int, tail_ids: Sequence[int], offsets: Sequence[int], token_id: int | None) -> int:
    if token_id is None:
        return text_pos
    for k in range(len(tail_ids) - 1, -1, -1):
        if tail_ids[k] == token_id:
            return offsets[k]
    return -1


def initial_state(prompt_ids: Sequence[int], profile: Profile, tb: TokenBytes,
                  delimiter_ids: Mapping[str, int]) -> InitialState:
    """REASONING if the prompt's tail leaves a thought open, else CONTENT; harmony as well HARMONY_CONTENT or
    HARMONY_CHANNEL (see the module docstring)."""
    spec = profile.reasoning
    harmony = profile.tool_format == "harmony"
    if spec is None and not harmony:
        return InitialState.CONTENT
    headers = [h.encode("utf-8") for h in profile.generation_headers if h]
    first, tail, offsets, found = _tail_after_header(prompt_ids, headers, tb)
    tail_ids = prompt_ids[first:]

    def last(delim: str | None) -> int:
        if not delim:
            return -1
        tid = delimiter_ids.get(delim)
        text_pos = tail.rfind(delim.encode("utf-8")) if tid is None else -1
        return _last_position(text_pos, tail_ids, offsets, tid)

    if harmony:
        return _harmony_state(tail, profile.terminals, last) if first > 0 else InitialState.CONTENT
    open_at, close_at = last(spec.open), last(spec.close)
    if headers and not found and open_at > close_at and tail[open_at + len(spec.open.encode("utf-8")):].strip():
        open_at = -1  # no generation header (`add_generation_prompt: false`): only a thought the prompt ends in is open
    if open_at > close_at:
        return InitialState.REASONING
    if close_at >= 0:
        return InitialState.CONTENT
    return InitialState.REASONING if spec.start_mode == "always" else InitialState.CONTENT


def _harmony_state(tail: bytes, terms: Mapping[str, str], last) -> InitialState:
    """The harmony reply's start from the tail after the last ``<|start|>assistant`` (see the module docstring)."""
    message = last(terms["message"])
    ended = max(last(terms[t]) for t in ("end", "call", "return"))
    if message < 0 or ended > message:
        channel = last(terms["channel"])
        if channel >= 0 and channel > ended and not tail[channel + len(terms["channel"].encode()):].strip():
            return InitialState.HARMONY_CHANNEL
        return InitialState.CONTENT
    header = tail[:message].decode("utf-8", "replace")
    chan_part = header.rpartition(terms["channel"])[2].partition(terms["constrain"])[0].split()
    return InitialState.REASONING if chan_part and chan_part[0] == "analysis" else InitialState.HARMONY_CONTENT
