"""A counting shim over the torch calls that synchronise a CUDA stream with the host, for CPU tests.

On CUDA these calls wait for the device (a value must reach the host, or an output's size depends on device data);
inside a captured CUDA graph they fail. On a CPU they are harmless, so tests count them instead:

    with count_host_syncs() as calls:
        moe.moe_align_block_size(ids, 16, 8)
    assert calls == []
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                  "bincount", "unique", "masked_select", "repeat_interleave")
"""``torch.Tensor`` methods that read device data on the host or size an output by it."""
TORCH_FUNCTIONS = ("bincount", "nonzero", "unique", "masked_select", "repeat_interleave", "argwhere")
"""The same as ``torch.*`` functions."""


@contextlib.contextmanager
def count_host_syncs() -> Iterator[list[str]]:
    """Within the block, every call of a listed method/function is appended (by name) to the yielded list."""
    calls: list[str] = []
    saved: list[tuple[object, str, object]] = []

    def wrap(owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            calls.append(label)
            return original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, counted)

    try:
        for name in TENSOR_METHODS:
            wrap(torch.Tensor, name, f"Tensor.{name}")
        for name in TORCH_FUNCTIONS:
            wrap(torch, name, f"torch.{name}")
        yield calls
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
