"""N-gram speculative decoding (vLLM's ``--speculative-config '{"method": "ngram", ...}'``, prompt lookup).

After each step, a speculating sequence proposes up to ``num_speculative_tokens`` draft tokens: the tokens that
followed the latest earlier occurrence of its last ``n`` tokens (prompt and output), trying ``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``. The next step computes the last token and the drafts in one
chunk and samples every one of those positions, in the same single device read as every other sampled token; the
drafts are kept up to the first position whose token differs from the draft there, followed by that token (or by the
token past the last draft when all are kept). One to ``num_speculative_tokens + 1`` tokens per step:

- a greedy request's token at each position is its argmax, so it emits exactly what plain greedy decoding emits;
- a sampled request draws at each position as it would without speculation, and keeps a draft when the draw equals
  it. For a draft proposed with certainty this is the speculative-sampling rule: the draft is kept with the
  probability q(draft) the request's distribution gives it, and otherwise the token follows q without the draft.
  So every emitted token is a draw from the request's own distribution (temperature, top-k, top-p, min-p), made
  in the context of the tokens actually emitted before it. A seeded request's draw at output position ``i`` is
  seeded by (seed, ``i``), so it emits exactly the tokens it emits without speculation.

Each position samples as if the drafts before it had been emitted (`ember.engine.sampler`): penalties count them,
banned words see them, and logprobs are those of the position's own context, so requests with penalties, logit bias,
allowed or banned tokens and logprobs speculate too. So do requests under a grammar: a later position's mask is the
grammar's once the drafts before it are accepted (`ember.engine.constraint.LookaheadConstraint`; llguidance's matcher
advances and rolls back), and the kept tokens are accepted one by one. A row before ``min_tokens`` bans the stop
tokens as a plain step would, so a drafted stop token there is never kept. Models with recurrent state (Qwen3-Next)
cannot undo rejected drafts, so they are refused with speculation on.

The proposer keeps, per sequence and per ``n``, a map from each ``n``-gram to the end of its latest occurrence,
extended by the tokens appended since the previous proposal: constant work per generated token.

Each sequence paces its drafts (`Drafter`): after a draft of which nothing was kept it pauses drafting for 1, 3, 7,
then 15 steps as such misses repeat, and any kept draft token ends the pause. Where text does not repeat, a sequence
stops paying for positions it throws away, while a run of hits keeps full-length drafts; pacing decides only which
steps check drafts, never which tokens are emitted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember.engine.constraint import Constraint, LookaheadConstraint
from ember.engine.params import SamplingParams


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None
    """No drafts while the engine holds more requests than this (running and waiting): verification stops paying
    once the batch alone keeps the device busy."""


_NGRAM = ("ngram", "[ngram]")
"""vLLM's spellings of the n-gram method (as ``method``, or as ``model`` with no method)."""


def parse_speculative_config(value: dict[str, Any]) -> SpeculativeConfig:
    """vLLM's JSON, checked: ``method`` ``ngram`` (the only one Ember serves), ``num_speculative_tokens`` >= 1,
    ``prompt_lookup_min`` / ``prompt_lookup_max`` (either defaults to the other; both to 5), optional
    ``disable_by_batch_size`` (an integer >= 2); as in vLLM, ``model`` ``ngram`` (or ``[ngram]``) stands for the
    method. ValueError naming the key otherwise."""
    model = value.get("model")
    if model is not None and model not in _NGRAM:
        raise ValueError(f"speculative_config: model {model!r} is not served (Ember speculates with 'ngram' prompt "
                         f"lookup only; draft models, EAGLE and MTP are not supported)")
    lookup = model is not None or "prompt_lookup_max" in value or "prompt_lookup_min" in value
    method = value.get("method", "ngram" if lookup else None)
    if method not in _NGRAM:
        raise ValueError(f"speculative_config: method {method!r} is not served (Ember speculates with 'ngram' "
                         f"prompt lookup only; draft models, EAGLE and MTP are not supported)")
    unknown = sorted(set(value) - {"method", "model", "num_speculative_tokens", "prompt_lookup_min",
                                   "prompt_lookup_max", "disable_by_batch_size"})
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r} for the ngram method")
    k = value.get("num_speculative_tokens")
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    lo, hi = (lo if lo is not None else hi if hi is not None else 5), (hi if hi is not None else lo if lo is not None
                                                                         else 5)
    for name, v in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
    if lo > hi:
        raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    limit = value.get("disable_by_batch_size")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 2):
        raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 2, got {limit!r}")
    return SpeculativeConfig(k, lo, hi, limit)


def speculates(params: SamplingParams, constraint: Constraint | None) -> bool:
    """Whether a request's drafts can be checked position by position: it generates, unconstrained or under a
    constraint that can mask past tokens it has not accepted."""
    return params.pooling is None and (constraint is None or isinstance(constraint, LookaheadConstraint))


MAX_PAUSE = 15  # steps a sequence whose drafts keep missing waits before it drafts again


@dataclass
class NgramIndex:
    """One sequence's n-gram positions: ``ends[n][gram]`` is the end of the latest occurrence of ``gram`` among
    the n-grams that end before the sequence's last token."""

    lookup_min: int
    lookup_max: int
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending at positions <= this are in `ends`

    def propose(self, tokens: Any, num_tokens: int, k: int) -> list[int]:
        """Up to ``k`` draft tokens for a sequence of ``num_tokens`` tokens; ``tokens(start, end)`` reads a slice."""
        if k <= 0 or num_tokens < 2:
            return []
        lo, hi = self.lookup_min, self.lookup_max
        base = max(0, self.indexed + 1 - hi)  # the new n-grams end in (indexed, num_tokens - 1]; the suffix too
        seen = tokens(base, num_tokens)
        for end in range(self.indexed + 1, num_tokens):
            for n in range(lo, min(hi, end) + 1):
                self.ends.setdefault(n, {})[tuple(seen[end - n - base:end - base])] = end
        self.indexed = max(self.indexed, num_tokens - 1)
        for n in range(min(hi, num_tokens - 1), lo - 1, -1):
            end = self.ends.get(n, {}).get(tuple(seen[num_tokens - n - base:num_tokens - base]))
            if end is not None:
                return tokens(end, min(end + k, num_tokens))
        return []


@dataclass
class Drafter:
    """A speculating sequence's n-gram index and the pacing of its drafts (see the module's docstring)."""

    index: NgramIndex
    length: int  # num_speculative_tokens
    pause: int = 0  # steps left before the next draft
    misses: int = 0  # drafts in a row of which nothing was kept

    def draft(self, tokens: Any, num_tokens: int, room: int) -> list[int]:
        """The next draft (``tokens(start, end)`` reads the sequence), at most ``room`` tokens; [] while paused."""
        if self.pause:
            self.pause -= 1
            return []
        return self.index.propose(tokens, num_tokens, min(self.length, room))

    def verified(self, kept: int) -> None:
        """Pace the next draft by this one, of which ``kept`` tokens were kept."""
        if kept:
            self.misses = 0
        else:
            self.misses += 1
            self.pause = min(2 ** self.misses - 1, MAX_PAUSE)
