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
    token_type_starts: torch.Tensor | None = None
    """int64 [S]: each sequence's first position of token type 1, -1 where the model finds it (encoders only)."""
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
    """The torch reference with every sequence of at most `SHORT_QUERY` query rows (decodes, speculative chunks) in a
    batch computed in one batched SDPA call; longer prefill chunks go through the reference one sequence at a time.
    Same arguments and results as the reference.

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
        opts = dict(sliding_window=sliding_window, sinks=sinks, softcap=softcap, chunk=chunk, k_scale=k_scale,
                    v_scale=v_scale)
        if max_seqlen_q <= 1 and q.shape[0] == seq_lens.shape[0]:
            _batched(q, k_cache, v_cache, out, None, None, seq_lens, block_table, softmax_scale,
                     max_seqlen_k=max_seqlen_k, **opts)
            return out
        qlens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        if max_seqlen_q <= SHORT_QUERY:  # all short (decodes beside speculative chunks): nothing read back
            _batched(q, k_cache, v_cache, out, cu_seqlens_q[:-1].long(), qlens.long(), seq_lens, block_table,
                     softmax_scale, max_seqlen_k=max_seqlen_k, max_seqlen_q=max_seqlen_q, **opts)
            return out
        short = ((qlens > 0) & (qlens <= SHORT_QUERY)).nonzero().flatten()   # an empty segment has no rows
        if short.numel() < qlens.numel():
            rest = (qlens > SHORT_QUERY).nonzero().flatten()
            for b in rest.tolist():
                s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
                reference.paged_attention(q[s:e], k_cache, v_cache, out[s:e], cu_seqlens_q.new_tensor([0, e - s]),
                                          seq_lens[b:b + 1], block_table[b:b + 1], e - s, int(seq_lens[b]),
                                          softmax_scale, k_scale, v_scale, sliding_window=sliding_window,
                                          sinks=sinks, softcap=softcap, chunk=chunk)
        if short.numel():
            _batched(q, k_cache, v_cache, out, cu_seqlens_q[short].long(), qlens[short].long(), seq_lens[short],
                     block_table[short], softmax_scale, **opts)
        return out


SHORT_QUERY = 8
"""Sequences with at most this many query tokens in a step (decodes, speculative chunks, short prefill chunks) are
computed together in one batched SDPA call; longer ones one at a time."""


def _batched(q, k_cache, v_cache, out, starts, qlens, seq_lens, block_table, scale: float,
             sliding_window: int | None = None, sinks: torch.Tensor | None = None,
             max_seqlen_k: int | None = None, k_scale: float | None = None,
             v_scale: float | None = None, softcap: float | None = None, chunk: int | None = None,
             max_seqlen_q: int | None = None) -> None:
    """Each sequence's query rows ``q[starts[i] : starts[i] + qlens[i]]`` (the last tokens of its ``seq_lens[i]``)
    over its cached keys, causally; ``starts`` None: one row per sequence, in order (a decode batch). Given bounds on
    the query and key lengths (``max_seqlen_q``, ``max_seqlen_k``), nothing is read back to the host."""
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
    if starts is None:
        nq, rows = 1, None
        qpos = (seq_lens.long() - 1).unsqueeze(1)  # [b, 1]
        qs = q
    else:
        nq = int(qlens.max()) if max_seqlen_q is None else max_seqlen_q
        i = torch.arange(nq, device=q.device).unsqueeze(0)
        rows = starts.unsqueeze(1) + torch.minimum(i, qlens.unsqueeze(1) - 1)  # [b, nq], padded by repeating
        qpos = seq_lens.long().unsqueeze(1) - qlens.unsqueeze(1) + i
        qs = q[rows.reshape(-1)]
    g = hq // hkv
    qs = qs.float().reshape(b, nq, hkv, g, d).permute(0, 2, 3, 1, 4)  # [b, hkv, g, nq, d]
    kpos = torch.arange(nblk * bs, device=q.device).view(1, 1, -1)
    p = qpos.unsqueeze(2)  # [b, nq, 1]
    valid = kpos <= p
    if sliding_window is not None:
        valid = valid & (kpos > p - sliding_window)
    if chunk:
        valid = valid & (kpos >= p // chunk * chunk)
    if sinks is None and not softcap:
        mask = valid[:, None, None].expand(b, 1, g, nq, -1).reshape(b, 1, g * nq, -1)
        o = F.scaled_dot_product_attention(qs.reshape(b, hkv, g * nq, d), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=scale).reshape(b, hkv, g, nq, d)
    else:  # the scores themselves: a soft-cap bounds them; a sink joins the denominator (a zero value row)
        s = torch.einsum("bhgqd,bkhd->bhgqk", qs, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~valid[:, None, None], float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(1, hkv, g, 1, 1).expand(b, -1, -1, nq, 1)
            pr = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        else:
            pr = torch.softmax(s, dim=-1)
        o = torch.einsum("bhgqk,bkhd->bhgqd", pr, v)
    o = o.permute(0, 3, 1, 2, 4).reshape(b, nq, hq, d)  # [b, nq, hq, d]
    if rows is None:
        out.copy_(o.reshape(b, hq, d))
    else:
        keep = torch.arange(nq, device=q.device).unsqueeze(0) < qlens.unsqueeze(1)
        out[rows[keep]] = o[keep].to(out.dtype)


def check_triton_device(device: torch.device, flag: str) -> None:
    """ValueError naming ``flag`` unless Triton kernels can run for ``device``: on CUDA, or anywhere under the
    interpreter (``TRITON_INTERPRET=1``, what the CPU tests use). Without this a CPU server started and then failed
    every request ("0 active drivers")."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "") != "1":
        raise ValueError(f"{flag} triton needs a CUDA device (this engine runs on {device.type}); choose torch, or "
                         f"set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter (slow, for tests)")


def backend_name(device: torch.device) -> str:
    """``"triton"`` on CUDA, ``"torch"`` on CPU; ``EMBER_ATTENTION`` (triton / torch / reference) overrides."""
    forced = os.environ.get("EMBER_ATTENTION", "").strip().lower()
    if forced == "triton":
        check_triton_device(device, "--attention-backend (EMBER_ATTENTION)")
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
