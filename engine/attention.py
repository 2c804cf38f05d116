"""The per-step attention metadata and the choice of attention backend.

Backends expose ``reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)`` and ``paged_attention(q, k_cache,
v_cache, out, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, max_seqlen_k, softmax_scale)`` over the NHD paged
cache described in `ember.kernels.reference`. CPU uses the torch reference; CUDA (or ``EMBER_ATTENTION=triton``
anywhere) uses the Triton kernels in `ember.kernels.attention`.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass
class AttentionMetadata:
    """Everything one forward over a flattened batch of ``T`` tokens from ``B`` sequences needs.

    ``query_start_loc`` int32 [B+1] (cu_seqlens_q); ``seq_lens`` int32 [B] (context + this step's tokens);
    ``block_table`` int32 [B, max_blocks]; ``slot_mapping`` int64 [T]; ``positions`` int64 [T];
    ``logits_indices`` int64 [S]: the flat index of the last token of each sequence that samples this step.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def backend_name(device: torch.device) -> str:
    """``"triton"`` on CUDA or when ``EMBER_ATTENTION=triton``; ``"reference"`` (or the env's choice) otherwise."""
    forced = os.environ.get("EMBER_ATTENTION", "").strip().lower()
    if forced in ("triton", "reference", "torch"):
        return "reference" if forced == "torch" else forced
    if forced:
        raise ValueError(f"EMBER_ATTENTION={forced!r}: expected 'triton' or 'reference'")
    return "triton" if device.type == "cuda" else "reference"


def get_backend(device: torch.device) -> ModuleType:
    """The module whose ``reshape_and_cache`` / ``paged_attention`` the model calls."""
    name = backend_name(device)
    if name == "triton":
        try:
            return importlib.import_module("ember.kernels.attention")
        except ImportError as e:
            raise RuntimeError(f"Triton attention backend unavailable ({e}); set EMBER_ATTENTION=reference") from e
    return importlib.import_module("ember.kernels.reference")
