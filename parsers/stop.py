"""Stop strings matched on the raw output text, withholding what may still become a match (design A.11).

The matcher sees the raw text of the output before any parsing. A single-token delimiter is structure: a stop string
may end in its text where the token is not special (as in vLLM, whose text holds it), but no partial match runs past
it (`delimiter`). On a match the text is cut at the start of the stop string (or just after it with
``include_stop_str_in_output``) and the caller ends the request; nothing after the match is ever released. The
match is the stop string that is complete first (the earliest end; of those, the longest), which makes the result
independent of how the text is chunked. Text fed with ``check=False`` (the tokens up to ``min_tokens``, as vLLM) is
withheld the same way but cannot end a match: a stop string counts only when it ends in checked text. Work per call
is bounded by the text fed plus the longest stop string.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    """Per request: ``feed(text)`` returns the text that can no longer be part of a match."""

    __slots__ = ("stops", "include", "stopped", "matched", "_held", "_quiet", "_prefixes", "_longest")

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.include = include_stop_str_in_output
        self.stopped = False
        self.matched: str | None = None
        self._held = ""
        self._quiet = 0  # the leading characters of ``_held`` fed unchecked: no match may end within them
        self._prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))
        self._longest = max((len(s) for s in self.stops), default=0)

    @property
    def held(self) -> str:
        """Text withheld as a possible start of a stop string."""
        return self._held

    def feed(self, text: str, check: bool = True) -> str:
        if self.stopped or not text:
            return ""
        s = self._held + text if self._held else text
        quiet = len(s) if not check else self._quiet
        if check:
            best, best_end, best_stop = -1, -1, ""
            for stop in self.stops:
                i = s.find(stop, max(0, quiet - len(stop) + 1))
                if i >= 0:
                    end = i + len(stop)
                    if best < 0 or end < best_end or (end == best_end and i < best):
                        best, best_end, best_stop = i, end, stop
            if best >= 0:
                self.stopped, self.matched, self._held = True, best_stop, ""
                return s[: best + len(best_stop)] if self.include else s[:best]
        for k in range(min(len(s), self._longest - 1), 0, -1):
            if s[-k:] in self._prefixes:
                self._held, self._quiet = s[-k:], max(0, quiet - (len(s) - k))
                return s[:-k]
        self._held, self._quiet = "", 0
        return s

    def delimiter(self, text: str, check: bool = True) -> str:
        """A delimiter token's ``text``, which the caller routes as structure: a stop string may end in it, but no
        partial match runs past it. The text to route as plain text before the delimiter: with a match, what `feed`
        releases (the withheld text and the delimiter's text before the match, or through it with
        ``include_stop_str_in_output``); without, the withheld text."""
        held = self._held
        released = self.feed(text, check)
        if self.stopped:
            return released
        self._held, self._quiet = "", 0
        return held

    def flush(self) -> str:
        """Release the withheld text: no later text can complete a match (a delimiter came, or the output ended)."""
        held, self._held, self._quiet = self._held, "", 0
        return "" if self.stopped else held
