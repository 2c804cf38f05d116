"""Numpy mirrors of the running sequences' block tables, so a step's metadata costs C copies, not Python ints.

`ModelRunner.prepare` writes every scheduled sequence's block table into the step's int32 upload. Converting the
Python list each step costs time in proportion to the context (375 blocks per sequence at 6k tokens), every step.
A sequence's ``block_ids`` only grows by appends while it runs; the KV cache manager replaces the list with a new
one when it frees the sequence (finish, preemption). So each mirror (``Sequence.block_mirror``) extends itself by
the appended tail and starts over when the list object changes: per step, only new blocks are converted.
"""
from __future__ import annotations

import numpy as np

from ember.engine.sequence import Sequence


def block_row(seq: Sequence) -> np.ndarray:
    """An int32 array whose first ``len(seq.block_ids)`` entries are the table (valid until the table changes; the
    rest is spare room)."""
    ids = seq.block_ids
    n = len(ids)
    mirror = seq.block_mirror
    if mirror is None or mirror[0] is not ids or mirror[2] > n:  # a new or replaced table
        arr, count = np.empty(max(16, 2 * n), dtype=np.int32), 0
    else:
        _, arr, count = mirror
    if n > count:
        if n > arr.shape[0]:
            grown = np.empty(2 * n, dtype=np.int32)
            grown[:count] = arr[:count]
            arr = grown
        arr[count:n] = ids[count:n]
        seq.block_mirror = (ids, arr, n)
    return arr
