"""The output pipeline of one request and choice: generated token IDs in, ordered events out.

Per token: a single-token delimiter is routed whole to the machine (the UTF-8 assembler and the stop matcher are
flushed first, so earlier text lands before it); an EOS / end-of-turn / pad id that the machine does not handle, or
one of ``ending_ids`` (the stop tokens a request leaves out, delimiters too), is Dropped and adds no text (a
character or a stop string split around it still joins, as in vLLM's detokenized text); any other id becomes
bytes -> whole characters (`Utf8Assembler`) -> stop strings (`StopMatcher`) -> the profile's `ParserMachine`. One of
``passed_ids`` (an EOS a request ignores) is neither delimiter nor end of turn: an ordinary token, Dropped only where
``special_ids_to_drop`` holds it. Each step costs O(its tokens + bounded holdback): nothing already seen is scanned
again.
Streaming and non-streaming use this same object; the final message is `fold` of all events (`parsers.result`).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .events import ContentDelta, Dropped, Event, Malformed, ReasoningDelta
from .initial import InitialState, initial_state
from .machine import ParserMachine
from .profiles import Profile, get_profile
from .result import ParsedOutput, fold
from .stop import StopMatcher
from .tokens import TokenBytes, Utf8Assembler, profile_delimiter_ids

__all__ = ["OutputPipeline", "PipelineStep", "ParserSetup", "DELIMITER", "DROPPED", "PENDING", "parse_all"]

DELIMITER = "delimiter"   # token_channels entry of a token whose text was consumed as structure (never surfaced)
DROPPED = "dropped"       # token_channels entry of a Dropped special (EOS, end-of-turn, pad)
PENDING = "pending"       # token_channels entry of a token whose text the parser still withholds (or one after it)


@dataclass(slots=True)
class PipelineStep:
    """What one ``feed`` produced.

    ``events``: in order. ``stopped``: a stop string matched; end the request (call ``finish("stop")``).
    ``token_channels``: per consumed token, the channel its text went to ("reasoning", "content", "tool"; text of a
    tool call surfaced as Malformed is "content") or `DELIMITER` / `DROPPED` (for logprobs routing, design A.11); a
    delimiter surfaced as text has the channel of that text. `PENDING`: the parser still withholds the token's text
    (whitespace held at a boundary, a buffered call head), or it follows such a token; a later step (or
    `finish_step`) resolves it. ``resolved``: the channels, in order, of all tokens earlier steps left `PENDING`,
    when this step resolved them (their text surfaced or was dropped here). ``tokens_used``: how many of the fed
    tokens belong to the output; fewer than fed when a stop string ended it mid-delta (the rest are discarded, like
    their logprobs).
    """

    events: list[Event]
    stopped: bool
    token_channels: list[str]
    tokens_used: int
    resolved: list[str] = field(default_factory=list)


def _fate(own: str, events: Sequence[Event]) -> str:
    """The channel of a token whose text went to ``own`` (the machine's channel when it was fed; `DELIMITER` for a
    delimiter token), from the ``events`` its text produced (they start with its first character): tool-call and
    delimiter text is "content" where it surfaced as Malformed; other text takes the channel of the first event
    (`DELIMITER` where it was dropped)."""
    if own == "tool" or own == DELIMITER:
        for e in events:
            if type(e) is Malformed:
                return "content"
        return own
    if not events:
        return own
    t = type(events[0])
    if t is ContentDelta or t is Malformed:
        return "content"
    if t is ReasoningDelta:
        return "reasoning"
    return DELIMITER if t is Dropped else "tool"


def _surfaced(events: Sequence[Event], text: str) -> str:
    """The channel of a delimiter token whose feed produced ``events``: that of the text it ended with when the parser
    surfaced it as text (it stood where it delimits nothing, e.g. `</think>` with thinking off), else `DELIMITER`."""
    last = events[-1] if events else None
    if text and last is not None and type(last) in (ContentDelta, Malformed, ReasoningDelta) \
            and last.text.endswith(text):
        return "reasoning" if type(last) is ReasoningDelta else "content"
    return DELIMITER


class OutputPipeline:
    """One per request and choice; see the module docstring. Never raises on any token sequence."""

    def __init__(self, tb: TokenBytes, profile: Profile, delimiter_ids: Mapping[str, int], initial: InitialState,
                 *, stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 special_ids_to_drop: Collection[int] = (), tools: Sequence[dict] | None = None,
                 call_id: Callable[[int], str] | None = None, parse_tools: bool | None = None,
                 min_tokens: int = 0, ending_ids: Collection[int] = (),
                 passed_ids: Collection[int] = ()) -> None:
        self.profile = profile
        self.initial = initial
        self._tb = tb
        self._bytes = tb.bytes_table
        self._texts = tb.text_table
        self._size = tb.vocab_size
        passed = frozenset(passed_ids)
        machine_ids = {t: i for t, i in delimiter_ids.items() if i is not None and i not in passed}
        # a token that ends the output and is left out of it (a request's stop_token_ids) is no delimiter then
        self._delims: dict[int, str] = {i: t for t, i in machine_ids.items() if i not in ending_ids}
        self._delims_as_text = frozenset(self._delims.keys() - tb.special_ids)  # in the raw text stop strings see
        drop = set(special_ids_to_drop)
        for t in profile.end_of_turn:
            i = tb.added_token_id(t)
            if i is not None and i not in passed:
                drop.add(i)
        self._drop = frozenset((drop - self._delims.keys()) | set(ending_ids))
        if parse_tools is None:
            parse_tools = bool(tools)
        self._machine = ParserMachine(profile, machine_ids, initial, tools=tools, call_id=call_id,
                                      parse_tools=parse_tools)
        self._asm = Utf8Assembler()
        self._stop = StopMatcher(stop, include_stop_str_in_output) if any(stop) else None
        self._min_tokens = min_tokens  # a stop string ends the output only in a token past these (vLLM)
        self._count = 0  # tokens so far, counted only where there are stop strings (for min_tokens)
        self.stopped = False
        self.finish_reason: str | None = None
        self._closed = False
        # the PENDING tokens, in order: (own channel, whether the machine withheld its text, feed, index in its step)
        self._waiting: list[tuple[str, bool, int, int]] = []
        self._feeds = 0  # feed / finish_step calls so far

    # ------------------------------------------------------------------------------------------------ public
    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output (Anthropic's ``stop_sequence``), or None."""
        return self._stop.matched if self._stop is not None else None

    def feed(self, token_ids: Sequence[int]) -> PipelineStep:
        """Consume one delta of generated tokens (any number, e.g. from speculative decoding)."""
        events: list[Event] = []
        channels: list[str] = []
        resolved: list[str] = []
        if self._closed or self.stopped:
            return PipelineStep(events, self.stopped, channels, 0, resolved)
        m = self._machine
        mfeed = m.feed
        asm = self._asm
        stop = self._stop
        delims, drop, texts, raw, size = self._delims, self._drop, self._texts, self._bytes, self._size
        waiting = self._waiting
        self._feeds += 1
        used = 0
        for tid in token_ids:
            delim = delims.get(tid)
            if delim is not None:
                start = len(events)
                as_text = stop is not None and tid in self._delims_as_text
                if self._flush_text(events, hold=as_text):
                    self._resolve(events[start:], channels, resolved)
                    break
                self._count += 1
                if as_text:  # a stop string may end in its text: what it releases is text before the delimiter
                    text = stop.delimiter(delim, self._count > self._min_tokens)
                    if text:
                        events += mfeed(None, text)
                    if stop.stopped:
                        self._resolve(events[start:], channels, resolved)
                        self._stopped_now()
                        used += 1
                        break
                events += mfeed(tid, delim)
                new = events[start:]
                self._place(_surfaced(new, delim) if new else DELIMITER, not new, new, channels, resolved)
            elif tid in drop:  # adds no text: a character or a stop string split around it still joins (vLLM)
                self._count += 1
                self._place(DROPPED, False, (), channels, resolved)
                t = self._tb.token_bytes(tid).decode("utf-8", "replace")
                if t:
                    events.append(Dropped(t, "special"))
            else:
                own = m.channel
                if 0 <= tid < size:
                    text = texts[tid]
                    if text is None or asm.pending:
                        text = asm.feed(raw[tid])
                else:
                    text = ""
                if stop is not None:  # the count of tokens so far matters only to the stop strings' min_tokens
                    self._count += 1
                    text = stop.feed(text, self._count > self._min_tokens)
                    if stop.stopped:
                        start = len(events)
                        events += mfeed(tid, text)
                        new = events[start:]
                        self._place(_fate(own, new), bool(text) and not new, new, channels, resolved)
                        self._stopped_now()
                        used += 1
                        break
                ev = mfeed(tid, text)
                if ev:
                    events += ev
                    if waiting:
                        self._place(_fate(own, ev), False, ev, channels, resolved)
                    else:  # nothing held: the common path, one channel lookup and no bookkeeping
                        channels.append(_fate(own, ev))
                elif waiting or text:
                    self._place(own, bool(text), ev, channels, resolved)
                else:
                    channels.append(own)
            used += 1
        return PipelineStep(events, self.stopped, channels, used, resolved)

    def finish(self, reason: str) -> list[Event]:
        """End of output (``reason``: "stop", "length", "eos", ...): flush everything withheld, close what is open."""
        return self.finish_step(reason).events

    def finish_step(self, reason: str) -> PipelineStep:
        """`finish`, as a step whose ``resolved`` holds the channels of the tokens still `PENDING`."""
        resolved: list[str] = []
        if self._closed:
            return PipelineStep([], self.stopped, [], 0, resolved)
        self._closed = True
        self.finish_reason = reason
        events: list[Event] = []
        if not self.stopped:
            self._flush_text(events)
        events += self._machine.finish(cut=reason == "length" or self.stopped)  # a stop string cuts it too
        self._feeds += 1
        self._resolve(events, [], resolved)
        resolved += [DELIMITER if withheld else own for own, withheld, _, _ in self._waiting]  # never surfaced
        self._waiting.clear()
        return PipelineStep(events, self.stopped, [], 0, resolved)

    def abort(self) -> None:
        """The client went away: emit nothing more, keep no state."""
        self._closed = True
        self.finish_reason = "abort"
        self._asm = Utf8Assembler()
        self._waiting = []

    # ----------------------------------------------------------------------------------------------- helpers
    def _resolve(self, new: Sequence[Event], channels: list[str], resolved: list[str]) -> None:
        """The `PENDING` tokens are settled by ``new``, the first events since they were fed: a token whose text the
        machine withheld takes their `_fate`, the others keep their own channel (in ``channels`` where this step fed
        them, else appended to ``resolved``)."""
        waiting = self._waiting
        if not new or not waiting:
            return
        now = self._feeds
        for own, withheld, fed, at in waiting:
            ch = _fate(own, new) if withheld else own
            if fed == now:
                channels[at] = ch
            else:
                resolved.append(ch)
        waiting.clear()

    def _place(self, channel: str, withheld: bool, new: Sequence[Event], channels: list[str],
               resolved: list[str]) -> None:
        """Record the ``channel`` of the token just consumed, whose consumption produced the events ``new``
        (``withheld``: none, the machine holds all its text, and ``channel`` is where that text went): `PENDING`
        while it or an earlier token is withheld."""
        self._resolve(new, channels, resolved)
        if withheld or self._waiting:
            self._waiting.append((channel, withheld, self._feeds, len(channels)))
            channels.append(PENDING)
        else:
            channels.append(channel)

    def _flush_text(self, events: list[Event], hold: bool = False) -> bool:
        """Text withheld by the assembler and the stop matcher goes to the machine (the matcher's stays withheld with
        ``hold``); True if a stop matched."""
        text = self._asm.flush()
        stop = self._stop
        if stop is not None:
            text = stop.feed(text, self._count > self._min_tokens)
            if stop.stopped:
                if text:
                    events += self._machine.feed(None, text)
                self._stopped_now()
                return True
            if not hold:
                text += stop.flush()
        if text:
            events += self._machine.feed(None, text)
        return False

    def _stopped_now(self) -> None:
        self.stopped = True
        self._asm = Utf8Assembler()


@dataclass(frozen=True)
class ParserSetup:
    """A model's parsing facts, built once at load and shared by every request (server and grammar).

    ``drop_ids``: specials never surfaced (EOS, pad, BOS) besides the profile's end-of-turn tokens; `dropped_ids`
    adds the other specials for a request's ``skip_special_tokens``. ``eos_ids``: the model's EOS tokens.
    """

    tb: TokenBytes
    profile: Profile
    delimiter_ids: Mapping[str, int]
    drop_ids: frozenset[int] = frozenset()
    eos_ids: frozenset[int] = frozenset()

    @classmethod
    def from_tokenizer(cls, tok: Any, profile: Profile | str, *, drop_ids: Iterable[int] = (),
                       tb: TokenBytes | None = None, eos_ids: Iterable[int] = ()) -> "ParserSetup":
        p = get_profile(profile) if isinstance(profile, str) else profile
        return cls(tb or TokenBytes.from_tokenizer(tok), p, profile_delimiter_ids(tok, p), frozenset(drop_ids),
                   frozenset(eos_ids))

    @cached_property
    def ignorable_eos_ids(self) -> frozenset[int]:
        """The EOS ids that end nothing for a request ignoring EOS (the pipeline's ``passed_ids``): all but those
        the profile gives a role besides ending the turn (harmony's `<|call|>` and `<|return|>` end a message)."""
        p = self.profile
        structural = {p.terminals.get(n) for (_, n), r in p.transitions.items() if r.action != "end_of_turn"}
        return self.eos_ids - {i for t, i in self.delimiter_ids.items() if t in structural}

    def initial_state(self, prompt_ids: Sequence[int]) -> InitialState:
        return initial_state(prompt_ids, self.profile, self.tb, self.delimiter_ids)

    def dropped_ids(self, skip_special_tokens: bool | None = None) -> frozenset[int]:
        """The ids whose text never surfaces: ``drop_ids``, and with ``skip_special_tokens`` true every special token
        of the tokenizer (added tokens marked special) except the profile's delimiters, which the parser needs
        whether single tokens or matched as text. Unset or false: ``drop_ids`` only (other specials are text)."""
        return self._specials_dropped if skip_special_tokens else self.drop_ids

    @cached_property
    def _specials_dropped(self) -> frozenset[int]:
        terminal_texts = set(self.profile.terminals.values())
        keep = set(self.delimiter_ids.values()) | {i for t, i in self.tb.added.items() if t in terminal_texts}
        return self.drop_ids | (self.tb.special_ids - keep)

    def pipeline(self, prompt_ids: Sequence[int] | None = None, *, initial: InitialState | None = None,
                 **options: Any) -> OutputPipeline:
        """A fresh pipeline for one choice; ``initial`` defaults to the state of ``prompt_ids`` (CONTENT if none).
        ``options``: `OutputPipeline`'s keywords (stop, include_stop_str_in_output, min_tokens, tools, call_id,
        parse_tools, ending_ids, passed_ids)."""
        if initial is None:
            initial = self.initial_state(prompt_ids) if prompt_ids is not None else InitialState.CONTENT
        options.setdefault("special_ids_to_drop", self.drop_ids)
        return OutputPipeline(self.tb, self.profile, self.delimiter_ids, initial, **options)


def parse_all(pipeline: OutputPipeline, token_ids: Sequence[int], reason: str = "stop") -> ParsedOutput:
    """Non-streaming: the whole output as one delta, then finish, folded."""
    step = pipeline.feed(token_ids)
    return fold(step.events + pipeline.finish(reason))
