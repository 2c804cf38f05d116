"""The per-step attention metadata and the choice of attention backend.

Backends expose ``reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)`` and ``paged_attention(q, k_cache,
v_cache, out, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, max_seqlen_k, softmax_scale)`` over the NHD paged
cache described in `ember.kernels.reference`. CPU uses the torch reference, with its decode rows batched into one
SDPA call (`TorchBackend`; ``EMBER_ATTENTION=reference`` runs the plain per-sequence reference); CUDA (or
``EMBER_ATTENTION=triton`` anywhere) uses the Triton kernels in `ember.kernels.attention`.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F

from ember.kernels import reference


@dataclass
class RecurrentMetadata:
    """Where each chunk's recurrent state lives, for layers that carry one per sequence (Qwen3-Next's linear
    attention). One-token chunks are batched; longer chunks (prefill) are listed for the host to walk.

    ``decode_tokens`` / ``decode_slots`` int64 [D]: the flat token index and state slot of each one-token chunk;
    ``decode_keep`` float32 [D]: 0 where that token starts its sequence (the state starts from zeros), else 1;
    ``prefills``: ``(slot, first token, end token, starts the sequence)`` per longer chunk;
    ``restores`` / ``saves``: ``(from slot, to slot)`` state copies before each layer computes / after the step's
    forward, by the runner (prefix caching's snapshots, `ember.engine.state_snapshots`)."""

    decode_tokens: torch.Tensor
    decode_slots: torch.Tensor
    decode_keep: torch.Tensor
    prefills: list[tuple[int, int, int, bool]]
    restores: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def one_prefill(cls, num_tokens: int, device: torch.device, slot: int = 0) -> "RecurrentMetadata":
        """One sequence's first ``num_tokens`` tokens, from a zero state in ``slot`` (profiling, single-prompt
        forwards)."""
        none = torch.zeros(0, dtype=torch.int64, device=device)
        return cls(none, none, torch.zeros(0, device=device), [(slot, 0, num_tokens, True)])


@dataclass
class AttentionMetadata:
    """Everything one forward over a flattened batch of ``T`` tokens from ``B`` sequences needs.

    ``query_start_loc`` int32 [B+1] (cu_seqlens_q); ``seq_lens`` int32 [B] (context + this step's tokens);
    ``block_table`` int32 [B, max_blocks]; ``slot_mapping`` int64 [T]; ``positions`` int64 [T];
    ``logits_indices`` int64 [S]: the flat index of the last token of each sequence that samples this step;
    ``score_indices`` int64 [Q] (or None): the flat indices of the rows that score prompt tokens
    (`ScheduledChunk.prompt_rows`, in chunk order), whose hidden states the runner keeps for
    `ember.engine.prompt_logprobs`.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    recurrent: RecurrentMetadata | None = None
    """Set for models with recurrent-state layers (`RecurrentMetadata`)."""
    score_indices: torch.Tensor | None = None
    lora_rows: list[tuple[int, torch.Tensor]] | None = None
    """The step's token rows per LoRA adapter slot (`ember.engine.lora.LoRARows`), when the engine serves adapters."""
    lora_row_slots: torch.Tensor | None = None
    """int64 [T]: each token row's LoRA slot (-1: the base model), for decode steps a graph may replay."""

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


FP8_MAX = 448.0
"""Largest finite e4m3 value: writes saturate to it, as the GPU's conversion does (torch's cast would give NaN)."""


class TorchBackend:
    """The torch reference with every decode row (query length 1) of a batch computed in one batched SDPA call;
    prefill rows go through the reference one sequence at a time. Same arguments and results as the reference.

    A decode-only batch (``max_seqlen_q <= 1``, one query token per sequence) reads no metadata back to the host:
    its key length bound is ``max_seqlen_k``. With an FP8 cache, K/V are stored divided by their scales (saturated
    to +-448) and multiplied back when read."""

    name = "torch"

    @staticmethod
    def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        if k_cache.dtype == torch.float8_e4m3fn:
            key = (key.float() / (k_scale or 1.0)).clamp(-FP8_MAX, FP8_MAX)
            value = (value.float() / (v_scale or 1.0)).clamp(-FP8_MAX, FP8_MAX)
            k_scale = v_scale = None
        reference.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    @staticmethod
    def paged_attention(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, max_seqlen_k,
                        softmax_scale, k_scale=None, v_scale=None, *, sliding_window=None,
                        sinks=None, softcap=None, chunk=None) -> torch.Tensor:
        if max_seqlen_q <= 1 and q.shape[0] == seq_lens.shape[0]:
            _decode_batched(q, k_cache, v_cache, out, None, seq_lens, block_table, softmax_scale, sliding_window,
                            sinks, max_seqlen_k, k_scale, v_scale, softcap, chunk)
            return out
        qlens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        decode = (qlens == 1).nonzero().flatten()
        if decode.numel() < qlens.numel():
            rest = (qlens > 1).nonzero().flatten()
            for b in rest.tolist():
                s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
                reference.paged_attention(q[s:e], k_cache, v_cache, out[s:e], cu_seqlens_q.new_tensor([0, e - s]),
                                          seq_lens[b:b + 1], block_table[b:b + 1], e - s, int(seq_lens[b]),
                                          softmax_scale, k_scale, v_scale, sliding_window=sliding_window,
                                          sinks=sinks, softcap=softcap, chunk=chunk)
        if decode.numel():
            _decode_batched(q, k_cache, v_cache, out, cu_seqlens_q[decode].long(), seq_lens[decode],
                            block_table[decode], softmax_scale, sliding_window, sinks, None, k_scale, v_scale,
                            softcap, chunk)
        return out


def _decode_batched(q, k_cache, v_cache, out, rows, seq_lens, block_table, scale: float,
                    sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                    max_seqlen_k: int | None = None, k_scale: float | None = None,
                    v_scale: float | None = None, softcap: float | None = None, chunk: int | None = None) -> None:
    """One-token queries ``q[rows]`` (every row when ``rows`` is None) over their sequences' cached keys."""
    nb, bs, hkv, d = k_cache.shape
    b = seq_lens.shape[0]
    hq = q.shape[1]
    kmax = int(seq_lens.max()) if max_seqlen_k is None else max_seqlen_k
    nblk = min((kmax + bs - 1) // bs, block_table.shape[1])
    blocks = block_table[:, :nblk].long()
    k = k_cache[blocks].reshape(b, nblk * bs, hkv, d).float()
    v = v_cache[blocks].reshape(b, nblk * bs, hkv, d).float()
    if k_scale is not None:
        k = k * k_scale
    if v_scale is not None:
        v = v * v_scale
    qs = (q if rows is None else q[rows]).float().reshape(b, hkv, hq // hkv, d)
    kpos = torch.arange(nblk * bs, device=q.device).unsqueeze(0)
    valid = kpos < seq_lens.unsqueeze(1)
    if sliding_window is not None:
        valid = valid & (kpos >= seq_lens.unsqueeze(1) - sliding_window)
    if chunk:
        valid = valid & (kpos >= (seq_lens.unsqueeze(1) - 1) // chunk * chunk)
    if sinks is None and not softcap:
        o = F.scaled_dot_product_attention(qs, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=valid[:, None, None, :], scale=scale)
    else:  # the scores themselves: a soft-cap bounds them; a sink joins the denominator (a zero value row)
        s = torch.einsum("bhgd,bkhd->bhgk", qs, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(1, hkv, hq // hkv, 1).expand(b, -1, -1, 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        o = torch.einsum("bhgk,bkhd->bhgd", p, v)
    if rows is None:
        out.copy_(o.reshape(b, hq, d))
    else:
        out[rows] = o.reshape(b, hq, d).to(out.dtype)


def backend_name(device: torch.device) -> str:
    """``"triton"`` on CUDA, ``"torch"`` on CPU; ``EMBER_ATTENTION`` (triton / torch / reference) overrides."""
    forced = os.environ.get("EMBER_ATTENTION", "").strip().lower()
    if forced in ("triton", "reference", "torch"):
        return forced
    if forced:
        raise ValueError(f"EMBER_ATTENTION={forced!r}: expected 'triton', 'torch' or 'reference'")
    return "triton" if device.type == "cuda" else "torch"


def is_triton_backend(backend: ModuleType | type) -> bool:
    """The Triton kernels (`ember.kernels.attention`): graph-safe, and what selects the other Triton paths of the
    attention-like layers (Qwen3-Next's linear-attention decode)."""
    return getattr(backend, "__name__", "") == "ember.kernels.attention"


def get_backend(device: torch.device) -> ModuleType | type:
    """The backend whose ``reshape_and_cache`` / ``paged_attention`` the model calls."""
    name = backend_name(device)
    if name == "triton":
        try:
            return importlib.import_module("ember.kernels.attention")
        except ImportError as e:
            raise RuntimeError(f"Triton attention backend unavailable ({e}); set EMBER_ATTENTION=torch") from e
    if name == "torch":
        return TorchBackend
    return reference
