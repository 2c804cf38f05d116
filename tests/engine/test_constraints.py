"""The grammar seam: constrained rows sample only allowed tokens; a rejecting or failing constraint ends its request
with "error" (others unaffected); a terminated constraint ends it with "stop"."""
from __future__ import annotations

import pytest
import torch

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams



class AllowList:
    """Allows a fixed set of tokens; terminates after ``length`` accepted tokens."""

    def __init__(self, allowed: list[int], length: int = 1000, reject_after: int | None = None,
                 raise_in_fill: bool = False) -> None:
        self.allowed, self.length, self.reject_after, self.raise_in_fill = allowed, length, reject_after, raise_in_fill
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.raise_in_fill:
            raise RuntimeError("grammar exploded")
        bitmask[row] = 0
        for t in self.allowed:
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)

    def accept_token(self, token_id: int) -> bool:
        if self.reject_after is not None and len(self.accepted) >= self.reject_after:
            return False
        self.accepted.append(token_id)
        return token_id in self.allowed

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length

    def error_message(self) -> str | None:
        return "rejected by the test grammar" if self.reject_after is not None else None


def _drain(engine):
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return Engine.from_pretrained(demo_model_dir, num_kv_blocks=128)


def test_constrained_rows_sample_only_allowed_tokens(engine):
    allowed = [3, 64, 65, 900, 1279]
    c = AllowList(allowed, length=6)
    free = engine.add_request([10, 11, 12], SamplingParams(max_tokens=6, temperature=1.0, seed=0, ignore_eos=True))
    r = engine.add_request([10, 11, 12], SamplingParams(max_tokens=50, temperature=1.0, seed=0, ignore_eos=True),
                           constraint=c)
    outs = _drain(engine)
    toks = [t for o in outs[r] for t in o.new_token_ids]
    assert len(toks) == 6 and set(toks) <= set(allowed)
    assert outs[r][-1].finish_reason == "stop"  # the constraint terminated
    assert c.accepted == toks
    assert not set(t for o in outs[free] for t in o.new_token_ids) <= set(allowed)


def test_rejected_token_ends_only_that_request_with_error(engine):
    bad = engine.add_request([1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                             constraint=AllowList([5, 6], reject_after=2))
    ok = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    outs = _drain(engine)
    assert outs[bad][-1].finish_reason == "error"
    assert outs[bad][-1].error == "rejected by the test grammar"
    assert outs[bad][-1].rejected  # the request's grammar ended it: a client error
    assert sum(len(o.new_token_ids) for o in outs[bad]) == 2
    assert outs[ok][-1].finish_reason == "length"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_filler_failure_and_empty_mask_are_errors(engine):
    boom = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5), constraint=AllowList([5], raise_in_fill=True))
    none = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5), constraint=AllowList([]))
    outs = _drain(engine)
    assert outs[boom][-1].finish_reason == "error" and "grammar exploded" in outs[boom][-1].error
    assert outs[none][-1].finish_reason == "error" and outs[none][-1].error
    assert not outs[boom][-1].rejected  # the filler failed (every constrained row with it): the server's error
    assert not outs[boom][-1].new_token_ids and not outs[none][-1].new_token_ids


def test_a_grammar_that_allows_no_token_is_the_requests_error(engine):
    none = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5), constraint=AllowList([]))
    end = _drain(engine)[none][-1]
    assert end.finish_reason == "error" and end.rejected and not end.new_token_ids
    assert "structured-output constraint allows none" in end.error


def test_custom_bitmask_filler_is_used(demo_model_dir):
    seen = []

    def filler(constraints, bitmask):
        seen.append(len(constraints))
        for i, c in enumerate(constraints):
            c.fill_bitmask(bitmask, i)

    eng = Engine.from_pretrained(demo_model_dir, num_kv_blocks=64, bitmask_filler=filler)
    for _ in range(2):
        eng.add_request([1, 2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                        constraint=AllowList([7, 8]))
    outs = _drain(eng)
    assert seen and max(seen) == 2  # both constrained rows in one call
    assert all(set(o.new_token_ids) <= {7, 8} for v in outs.values() for o in v)
