"""DecodeGraphRunner's padding contract, exercised eagerly on the CPU (graph capture itself needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from ember.engine.attention import AttentionMetadata
from ember.engine.cuda_graphs import DecodeGraphRunner, capture_sizes
from ember.kernels import attention, reference

HQ, HKV, D, BS = 4, 2, 64, 16


def test_capture_sizes_are_powers_of_two_then_the_maximum():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]


def _decode_forward(backend, k_cache, v_cache, wq, wk, wv):
    """A one-layer attention-only decode forward over the paged cache (stands in for a model)."""

    def forward(input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = torch.nn.functional.embedding(input_ids, wq) + meta.positions[:, None].float() * 1e-2
        q = (x @ wk[:, : HQ * D]).view(-1, HQ, D)
        k = (x @ wv[:, : HKV * D]).view(-1, HKV, D)
        v = (x @ wv[:, HKV * D:]).view(-1, HKV, D)
        backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        backend.paged_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                meta.max_seqlen_q, meta.max_seqlen_k, D ** -0.5)
        return out

    return forward


def _meta(seq_lens: list[int], table: torch.Tensor) -> AttentionMetadata:
    n = len(seq_lens)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    pos = sl.long() - 1
    slots = table[torch.arange(n), pos // BS].long() * BS + pos % BS
    return AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=sl, block_table=table,
        slot_mapping=slots, positions=pos, logits_indices=torch.arange(n), max_seqlen_q=1, max_seqlen_k=int(sl.max()),
    )


@pytest.mark.parametrize("backend", [reference, attention], ids=["reference", "triton"])
def test_padded_batch_matches_the_unpadded_forward_and_padding_writes_no_kv(backend):
    g = torch.Generator().manual_seed(0)
    wq = torch.randn(50, 32, generator=g)
    wk = torch.randn(32, HQ * D, generator=g) * 0.2
    wv = torch.randn(32, 2 * HKV * D, generator=g) * 0.2
    k_cache = torch.randn(12, BS, HKV, D, generator=g)
    v_cache = torch.randn(12, BS, HKV, D, generator=g)
    table = torch.tensor([[3, 7, 0], [5, 0, 0], [9, 10, 11]], dtype=torch.int32)
    meta = _meta([20, 5, 40], table)
    ids = torch.tensor([4, 17, 33])

    k_orig = k_cache.clone()
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    want = _decode_forward(backend, kc_ref, vc_ref, wq, wk, wv)(ids, meta)

    runner = DecodeGraphRunner(_decode_forward(backend, k_cache, v_cache, wq, wk, wv), max_num_seqs=6,
                               max_blocks_per_seq=4, max_seqlen_k=64, device="cpu", sizes=[4, 6])
    runner.capture()
    assert runner.padded_size(3) == 4
    got = runner.run(ids, meta)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    # the padded row wrote nothing: only the three real slots changed, to the unpadded run's values
    changed = (k_cache != k_orig).view(-1, HKV * D).any(dim=1).nonzero().flatten()
    assert changed.tolist() == sorted(meta.slot_mapping.tolist())
    assert torch.allclose(k_cache, kc_ref, atol=1e-5) and torch.allclose(v_cache, vc_ref, atol=1e-5)

    # one sequence padded to 4 right after three real ones: the stale rows must become padding again
    small = _meta([7], table[1:2, :2])
    want_small = _decode_forward(backend, kc_ref, vc_ref, wq, wk, wv)(ids[:1], small)
    assert runner.padded_size(1) == 4
    got_small = runner.run(ids[:1], small)
    assert torch.allclose(got_small, want_small, atol=1e-5, rtol=1e-5)
    assert torch.allclose(k_cache, kc_ref, atol=1e-5)


def test_runner_rejects_prefill_and_oversized_batches():
    runner = DecodeGraphRunner(lambda ids, meta: ids, max_num_seqs=2, max_blocks_per_seq=2, max_seqlen_k=32,
                               device="cpu")
    table = torch.zeros(3, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="largest captured size"):
        runner.run(torch.zeros(3, dtype=torch.long), _meta([1, 1, 1], table))
    prefill = _meta([4], table[:1])
    prefill.max_seqlen_q = 4
    with pytest.raises(ValueError, match="decode batches only"):
        runner.run(torch.zeros(1, dtype=torch.long), prefill)
