"""The runner's numpy mirror of each sequence's block table follows the table through appends, a free (a new list)
and re-admission, so the step metadata never carries a stale block."""
from __future__ import annotations

from ember.engine.block_rows import block_row
from ember.engine.params import SamplingParams
from ember.engine.sequence import Sequence


def test_the_mirror_follows_appends_replacement_and_growth():
    seq = Sequence("a", [1, 2, 3], SamplingParams())
    assert block_row(seq)[:0].tolist() == []
    seq.block_ids.extend([7, 3])
    assert block_row(seq)[:len(seq.block_ids)].tolist() == [7, 3]
    seq.block_ids.extend(range(100, 140))  # past the first allocation: the mirror grows
    assert block_row(seq)[:len(seq.block_ids)].tolist() == [7, 3, *range(100, 140)]
    seq.block_ids = [5]  # freed and admitted again: a new list, maybe shorter, maybe other blocks
    assert block_row(seq)[:len(seq.block_ids)].tolist() == [5]
    seq.block_ids = [9, 8]  # a new list of the same length as a cached one must not be taken for it
    assert block_row(seq)[:len(seq.block_ids)].tolist() == [9, 8]
    other = Sequence("b", [1], SamplingParams(), block_ids=[9, 8])
    assert block_row(other)[:len(other.block_ids)].tolist() == [9, 8] and block_row(seq) is not block_row(other)
