"""Stop strings matched on the raw output text, withholding what may still become a match (design A.11).

The matcher sees the raw text of the output before any parsing. A single-token delimiter is structure: a stop string
may end in its text where the token is not special (as in vLLM, whose text holds it), but no partial match runs past
it (`delimiter`). On a match the text is cut at the start of the stop string (or just after it with
``include_stop_str_in_output``) and the caller ends the request; nothing after the match is ever released. The
match is the stop string that is complete first (the earliest end; of those, the first listed), which makes the
result independent of how the text is chunked (vLLM takes the first listed of those found in one step's new text, so
its pick depends on the tokens per step). Text fed with ``check=False`` (the tokens
up to ``min_tokens``, as vLLM) is withheld the same way but cannot end a match: a stop string counts only when it
ends in checked text. The stop strings are one Aho-Corasick automaton (`StopStrings`, built once per request and
shared by its choices), so a character fed costs the same however many stop strings there are (amortized), and
memory is linear in their total length.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

__all__ = ["StopMatcher", "StopStrings"]


class StopStrings:
    """A request's stop strings (empty ones and repeats dropped) as an Aho-Corasick automaton: a trie of the strings
    whose node is the longest suffix of the text read that begins one of them. Immutable; one per request, shared by
    the matchers of its choices. A node whose one child was created right after it (a run of a single string) keeps
    that child's character in an array, not a dict, so a long stop string costs a few words per character."""

    __slots__ = ("stops", "starts", "_chain", "_kids", "_fail", "_first", "_anchor", "_depth")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.starts = frozenset(s[0] for s in self.stops)
        self._chain = array("l", [-1])   # node -> the code point of its one child, node + 1 (-1: see _kids)
        self._kids: list[dict[str, int] | None] = [None]   # node -> its children by character, where not a chain
        self._depth = array("l", [0])
        self._first = array("l", [-1])   # node -> the first listed stop string ending there, or -1
        for index, stop in enumerate(self.stops):
            node = 0
            for ch in stop:
                child = self._child(node, ch)
                node = self._add(node, ch) if child < 0 else child
            if self._first[node] < 0:
                self._first[node] = index
        size = len(self._depth)
        fail = self._fail = array("l", bytes(8 * size))     # node -> its longest proper suffix that is a node
        order = [child for _, child in self._children(0)]
        for node in order:                                   # breadth first: a node's fail before its children's
            for ch, child in self._children(node):
                f = fail[node]
                while f and self._child(f, ch) < 0:
                    f = fail[f]
                fail[child] = max(self._child(f, ch), 0)
                order.append(child)
        first, anchor = self._first, array("l", bytes(8 * size))   # anchor: the deepest node with children on the
        for node in order:                                         # node's suffix chain (itself included)
            f = fail[node]
            if first[f] >= 0 and (first[node] < 0 or first[f] < first[node]):
                first[node] = first[f]                       # a stop string ending here via a suffix, listed earlier
            anchor[node] = node if self._chain[node] >= 0 or self._kids[node] else anchor[f]
        self._anchor = anchor

    def __bool__(self) -> bool:
        return bool(self.stops)

    @classmethod
    def of(cls, stops: "Sequence[str] | StopStrings") -> "StopStrings":
        return stops if isinstance(stops, StopStrings) else cls(stops)

    def _child(self, node: int, ch: str) -> int:
        code = self._chain[node]
        if code >= 0:
            return node + 1 if code == ord(ch) else -1
        kids = self._kids[node]
        return kids.get(ch, -1) if kids else -1

    def _children(self, node: int) -> list[tuple[str, int]]:
        code = self._chain[node]
        if code >= 0:
            return [(chr(code), node + 1)]
        kids = self._kids[node]
        return list(kids.items()) if kids else []

    def _add(self, node: int, ch: str) -> int:
        child = len(self._depth)
        chain, kids = self._chain, self._kids
        if chain[node] < 0 and not kids[node] and child == node + 1:
            chain[node] = ord(ch)
        else:
            if chain[node] >= 0:
                kids[node], chain[node] = {chr(chain[node]): node + 1}, -1
            if kids[node] is None:
                kids[node] = {}
            kids[node][ch] = child
        chain.append(-1)
        kids.append(None)
        self._depth.append(self._depth[node] + 1)
        self._first.append(-1)
        return child


class StopMatcher:
    """Per choice: ``feed(text)`` returns the text that can no longer be part of a match."""

    __slots__ = ("strings", "include", "stopped", "matched", "_held", "_node")

    def __init__(self, stops: "Sequence[str] | StopStrings", include_stop_str_in_output: bool = False) -> None:
        self.strings = StopStrings.of(stops)
        self.include = include_stop_str_in_output
        self.stopped = False
        self.matched: str | None = None
        self._held = ""
        self._node = 0          # the automaton's node of the held text (it has children; 0: nothing held)

    @property
    def held(self) -> str:
        """Text withheld as a possible start of a stop string."""
        return self._held

    def feed(self, text: str, check: bool = True) -> str:
        if self.stopped or not text:
            return ""
        a = self.strings
        chain, kids, fail, first = a._chain, a._kids, a._fail, a._first
        held, node = self._held, self._node
        if not node:  # at the root: skip to the first character that can begin a stop string
            starts = a.starts
            at = next((i for i, ch in enumerate(text) if ch in starts), -1)
            if at < 0:
                return text
            held, text = text[:at], text[at:]
        s = held + text
        base = len(held)
        for pos, ch in enumerate(text):
            code = ord(ch)
            while True:
                if chain[node] == code:
                    node += 1
                    break
                children = kids[node]
                child = children.get(ch) if children else None
                if child is not None:
                    node = child
                    break
                if not node:
                    break
                node = fail[node]
            found = first[node]
            if found >= 0 and check:
                stop = a.stops[found]
                end = base + pos + 1
                self.stopped, self.matched, self._held, self._node = True, stop, "", 0
                return s[:end] if self.include else s[:end - len(stop)]
        node = a._anchor[node]
        keep = a._depth[node]
        self._node = node
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
        self._node = 0
