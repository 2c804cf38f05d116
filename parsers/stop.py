"""Stop strings matched on the raw output text, withholding what may still become a match (design A.11).

The matcher sees the raw text of the output before any parsing. A single-token delimiter is structure: a stop string
may end in its text where the token is not special (as in vLLM, whose text holds it), but no partial match runs past
it (`delimiter`). On a match the text is cut at the start of the stop string (or just after it with
``include_stop_str_in_output``) and the caller ends the request; nothing after the match is ever released. The
match is the stop string that is complete first (the earliest end; of those, the first listed), which makes the
result independent of how the text is chunked (vLLM takes the first listed of those found in one step's new text, so
its pick depends on the tokens per step). Text fed with ``check=False`` (the tokens
up to ``min_tokens``, as vLLM) is withheld the same way but cannot end a match: a stop string counts only when it
ends in checked text. Each stop string is followed by a Knuth-Morris-Pratt automaton, so a call costs the text fed
times the number of stop strings (amortized) and memory is linear in their length, however long they are.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    """Per request: ``feed(text)`` returns the text that can no longer be part of a match."""

    __slots__ = ("stops", "include", "stopped", "matched", "_held", "_states", "_fails", "_firsts")

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.include = include_stop_str_in_output
        self.stopped = False
        self.matched: str | None = None
        self._held = ""
        self._states = [0] * len(self.stops)  # per stop string: how much of it the text so far ends with
        self._fails = tuple(_prefix_function(s) for s in self.stops)
        self._firsts = frozenset(s[0] for s in self.stops)

    @property
    def held(self) -> str:
        """Text withheld as a possible start of a stop string."""
        return self._held

    def feed(self, text: str, check: bool = True) -> str:
        if self.stopped or not text:
            return ""
        held = self._held
        if not held:  # every automaton is at its start: skip to the first character that can begin a stop string
            at = min((i for i in (text.find(c) for c in self._firsts) if i >= 0), default=-1)
            if at < 0:
                return text
            held, text = text[:at], text[at:]
        s = held + text
        base = len(held)
        states, stops, fails = self._states, self.stops, self._fails
        for pos, ch in enumerate(text):
            for i, stop in enumerate(stops):
                k = states[i]
                if k == 0 and ch != stop[0]:
                    continue
                while k and stop[k] != ch:
                    k = fails[i][k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    if check:
                        end = base + pos + 1
                        self.stopped, self.matched, self._held = True, stop, ""
                        return s[:end] if self.include else s[:end - k]
                    k = fails[i][k - 1]
                states[i] = k
        keep = max(states)
        self._held = s[len(s) - keep:] if keep else ""
        return s[:len(s) - keep]

    def delimiter(self, text: str, check: bool = True) -> str:
        """A delimiter token's ``text``, which the caller routes as structure: a stop string may end in it, but no
        partial match runs past it. The text to route as plain text before the delimiter: with a match, what `feed`
        releases (the withheld text and the delimiter's text before the match, or through it with
        ``include_stop_str_in_output``); without, the withheld text."""
        held = self._held
        released = self.feed(text, check)
        if self.stopped:
            return released
        self._reset()
        return held

    def flush(self) -> str:
        """Release the withheld text: no later text can complete a match (a delimiter came, or the output ended)."""
        held = self._held
        self._reset()
        return "" if self.stopped else held

    def _reset(self) -> None:
        self._held = ""
        self._states = [0] * len(self.stops)


def _prefix_function(s: str) -> tuple[int, ...]:
    """For each prefix ``s[:j + 1]``, the length of its longest proper prefix that is also its suffix (KMP)."""
    pi = [0] * len(s)
    k = 0
    for j in range(1, len(s)):
        while k and s[j] != s[k]:
            k = pi[k - 1]
        if s[j] == s[k]:
            k += 1
        pi[j] = k
    return tuple(pi)
