"""Plain torch references for the attention kernels; also Ember's CPU execution path.

KV cache layout ("NHD"), per layer: ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Token ``t`` of a sequence lives in block ``block_table[seq, t // block_size]`` at offset ``t % block_size``; a write's
slot is ``block_id * block_size + offset`` and slot ``-1`` is padding that writes nothing.

Batch metadata (one flattened batch of ``T`` query tokens over ``B`` sequences):
- ``cu_seqlens_q`` int32 ``[B+1]``: query token ranges per sequence;
- ``seq_lens`` int32 ``[B]``: total context per sequence (cached prefix + this step's new tokens);
- ``block_table`` int32 ``[B, max_blocks]``.
A sequence's new tokens are its last ``query_len`` positions, so query ``i`` attends to keys ``0 .. context_len + i``
with ``context_len = seq_len - query_len`` (causal). This one rule covers prefill, chunked prefill, prefix-cached
prefill and decode. A sliding window ``W`` keeps only keys ``pos - W < key_pos <= pos`` (the query's own position and
the ``W - 1`` before it, as transformers' ``sliding_window``). Sinks (gpt-oss) are one logit per query head that
joins the softmax denominator only: ``p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i))``. A soft-cap ``c`` (Gemma 2's
``attn_logit_softcapping``) bounds each scaled score before the mask: ``s = c * tanh(s / c)``. Chunked attention
``C`` (Llama 4's ``attention_chunk_size``) keeps only keys in the query's own chunk of ``C`` positions:
``(pos // C) * C <= key_pos <= pos``.
"""
from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``slot_mapping`` ``[T]`` (``-1`` skips).

    With an FP8 cache, values are divided by the per-tensor scale before the cast.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    nb, bs, h, d = k_cache.shape
    k = key[valid]
    v = value[valid]
    if k_scale is not None:
        k = k.float() / k_scale
    if v_scale is not None:
        v = v.float() / v_scale
    k_cache.view(nb * bs, h, d)[slots] = k.to(k_cache.dtype)
    v_cache.view(nb * bs, h, d)[slots] = v.to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first ``length`` cached tokens, ``[length, Hkv, D]``."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    blocks = cache[block_table_row[:nblocks].long()]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    k_scale: float | None = None,
    v_scale: float | None = None,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of ``q`` ``[T, Hq, D]`` over the paged cache, written into ``out`` ``[T, Hq, D]``.

    Computes in fp32, one sequence at a time (slow, obviously right). ``max_seqlen_*`` are accepted for signature
    parity with the Triton kernels. ``sliding_window`` (None: unlimited), ``sinks`` ``[Hq]`` (None: none),
    ``softcap`` (None: none) and ``chunk`` (None: none) as in the module doc.
    """
    del max_seqlen_q, max_seqlen_k
    hq = q.shape[1]
    hkv = k_cache.shape[2]
    group = hq // hkv
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        s, e = starts[b], starts[b + 1]
        qlen = e - s
        if qlen == 0:
            continue
        klen = lens[b]
        ctx = klen - qlen
        k = gather_kv(k_cache, block_table[b], klen).float()
        v = gather_kv(v_cache, block_table[b], klen).float()
        if k_scale is not None:
            k = k * k_scale
        if v_scale is not None:
            v = v * v_scale
        k = k.repeat_interleave(group, dim=1)  # [klen, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qs = q[s:e].float()  # [qlen, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * softmax_scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(qlen, device=q.device).unsqueeze(1) + ctx
        kpos = torch.arange(klen, device=q.device).unsqueeze(0)
        hidden = kpos > qpos
        if sliding_window is not None:
            hidden = hidden | (kpos <= qpos - sliding_window)
        if chunk:
            hidden = hidden | (kpos < qpos // chunk * chunk)
        scores = scores.masked_fill(hidden.unsqueeze(0), float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.float().reshape(hq, 1, 1).expand(hq, qlen, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
