"""Triton paged attention and KV writes against the torch reference (run under TRITON_INTERPRET=1 on CPU)."""
from __future__ import annotations

import pytest
import torch

from ember.kernels import attention, reference

BLOCK = 16


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _batch(specs, hq, hkv, d, dtype, *, seed, cache_dtype=None, num_blocks=None):
    """A random batch: ``specs`` lists (context_len, query_len) per sequence; blocks are scattered at random."""
    g = torch.Generator().manual_seed(seed)
    need = [(c + q + BLOCK - 1) // BLOCK for c, q in specs]
    max_blocks = max(max(need), 1) + 1
    nb = num_blocks or sum(need) + 3
    k_cache = torch.randn(nb, BLOCK, hkv, d, generator=g)
    v_cache = torch.randn(nb, BLOCK, hkv, d, generator=g)
    cache_dtype = cache_dtype or dtype
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    perm = torch.randperm(nb, generator=g)
    table = torch.randint(0, nb, (len(specs), max_blocks), generator=g, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n].int()
        used += n
    qlens = torch.tensor([q for _, q in specs])
    cu = torch.zeros(len(specs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(qlens, 0)
    seq_lens = torch.tensor([c + q for c, q in specs], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, cu, seq_lens, table


def _run_both(specs, hq, hkv, d, dtype, *, seed, k_scale=None, v_scale=None, cache_dtype=None, **kw):
    q, kc, vc, cu, seq_lens, table = _batch(specs, hq, hkv, d, dtype, seed=seed, cache_dtype=cache_dtype)
    max_q = max(ql for _, ql in specs)
    max_k = int(seq_lens.max())
    scale = d ** -0.5
    ref = torch.zeros_like(q)
    reference.paged_attention(q, kc, vc, ref, cu, seq_lens, table, max_q, max_k, scale, k_scale, v_scale)
    out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
    kc0, vc0 = kc.clone(), vc.clone()
    attention.paged_attention(q, kc, vc, out, cu, seq_lens, table, max_q, max_k, scale, k_scale, v_scale, **kw)
    assert torch.equal(kc.view(torch.uint8), kc0.view(torch.uint8)) and torch.equal(vc.view(torch.uint8), vc0.view(torch.uint8))
    assert not out.isnan().any(), "some output rows were never written"
    return out, ref


# (specs, hq, hkv, head_dim): context lengths are deliberately not multiples of the block size
PREFILL_CASES = [
    pytest.param([(0, 23), (0, 9)], 2, 2, 64, id="prefill-gqa1-hd64"),
    pytest.param([(21, 13), (37, 1), (0, 0), (0, 17), (5, 1)], 8, 2, 128, id="mixed-chunked-prefix-decode-gqa4-hd128"),
    pytest.param([(33, 7), (50, 1), (0, 5)], 8, 1, 64, id="mixed-gqa8-hd64"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("specs,hq,hkv,d", PREFILL_CASES)
def test_prefill_and_mixed_batches_match_reference(specs, hq, hkv, d, dtype):
    out, ref = _run_both(specs, hq, hkv, d, dtype, seed=hq * 100 + hkv * 10 + d)
    assert _rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("block_m,tile", [(64, 32), (32, 64)])
def test_larger_query_blocks_and_tiles_match_reference(block_m, tile):
    specs = [(21, 40), (37, 1), (0, 19)]
    out, ref = _run_both(specs, 8, 2, 64, torch.float16, seed=block_m + tile, block_m=block_m, tile_size=tile)
    assert _rel_err(out, ref) < 1e-3


DECODE_CASES = [
    pytest.param([(40, 1), (3, 1), (70, 1)], 4, 4, 64, id="gqa1-hd64"),
    pytest.param([(17, 1), (95, 1)], 8, 2, 128, id="gqa4-hd128"),
    pytest.param([(60, 1), (1, 1), (33, 1)], 8, 1, 64, id="gqa8-hd64"),
    pytest.param([(44, 1), (9, 1)], 4, 1, 96, id="gqa4-hd96-padded-dim"),
]


@pytest.mark.parametrize("split", [False, True], ids=["2d", "split-kv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("specs,hq,hkv,d", DECODE_CASES)
def test_decode_matches_reference_with_split_on_and_off(specs, hq, hkv, d, dtype, split):
    out, ref = _run_both(specs, hq, hkv, d, dtype, seed=len(specs) * d + hq, split_kv=split)
    assert _rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_reference(seed):
    """Random mixes of sequence count, cached context, query length, GQA ratio, head dim and dtype."""
    g = torch.Generator().manual_seed(1000 + seed)

    def draw(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=g))

    group = (1, 4, 8)[draw(3)]
    hkv = 1 + draw(2)
    d = (64, 128)[draw(2)]
    decode = seed % 2 == 1
    specs = [(draw(70), 1 if decode else draw(20)) for _ in range(1 + draw(4))]
    specs[0] = (specs[0][0], max(specs[0][1], 1))
    dtype = (torch.float32, torch.float16)[draw(2)]
    out, ref = _run_both(specs, group * hkv, hkv, d, dtype, seed=seed, split_kv=None if not decode else bool(seed & 2))
    assert _rel_err(out, ref) < 1e-3


def test_split_kv_segments_with_no_keys_are_weighed_out():
    # 1 tile for the short sequence but 8 segments: seven of its segments see no key at all
    specs = [(2, 1), (80, 1)]
    out, ref = _run_both(specs, 8, 2, 64, torch.float32, seed=7, split_kv=True, num_segments=8)
    assert _rel_err(out, ref) < 1e-3
    for segs, tile in [(2, 32), (1, 16)]:
        out2, _ = _run_both(specs, 8, 2, 64, torch.float32, seed=7, split_kv=True, num_segments=segs, tile_size=tile)
        assert _rel_err(out2, ref) < 1e-3


@pytest.mark.parametrize("split", [False, True], ids=["2d", "split-kv"])
def test_cuda_graph_padding_rows_are_finite_and_leave_real_rows_exact(split):
    """Rows padded in for a captured batch size (seq_len 0, one query token) give zeros, and change nothing else."""
    specs = [(30, 1), (-1, 1), (12, 1), (-1, 1)]  # context -1 + 1 query = seq_len 0
    q, kc, vc, cu, seq_lens, table = _batch([(max(c, 0), 1) for c, _ in specs], 4, 2, 64, torch.float16, seed=3)
    seq_lens[1] = 0
    seq_lens[3] = 0
    ref = torch.zeros_like(q)
    reference.paged_attention(q, kc, vc, ref, cu, seq_lens, table, 1, 31, 0.125)
    out = torch.full_like(q, float("nan"))
    attention.paged_attention(q, kc, vc, out, cu, seq_lens, table, 1, 31, 0.125, split_kv=split)
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))
    assert _rel_err(out[[0, 2]], ref[[0, 2]]) < 1e-3


def test_split_kv_refuses_prefill_batches():
    q, kc, vc, cu, seq_lens, table = _batch([(3, 4)], 2, 2, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="decode-only"):
        attention.paged_attention(q, kc, vc, torch.empty_like(q), cu, seq_lens, table, 4, 7, 0.1, split_kv=True)


@pytest.mark.parametrize("split", [False, True], ids=["2d", "split-kv"])
def test_fp8_kv_cache_with_per_tensor_scales_matches_reference(split):
    specs = [(26, 1), (47, 1)] if split else [(26, 1), (10, 9)]
    out, ref = _run_both(specs, 8, 2, 64, torch.float16, seed=11, cache_dtype=torch.float8_e4m3fn,
                         k_scale=0.07, v_scale=0.2, split_kv=split)
    assert _rel_err(out, ref) < 1e-3


def test_dispatch_splits_only_small_decode_batches(monkeypatch):
    calls = []
    real_3d = attention._unified_attention_3d
    real_2d = attention._unified_attention_2d

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            calls.append(self.name)
            return self.kernel[grid]

    monkeypatch.setattr(attention, "_unified_attention_3d", Spy("3d", real_3d))
    monkeypatch.setattr(attention, "_unified_attention_2d", Spy("2d", real_2d))
    monkeypatch.setattr(attention, "SPLIT_KV_MAX_PROGRAMS", 4)
    for specs, want in [([(5, 1), (9, 1)], "3d"), ([(5, 1), (9, 1), (3, 1)], "2d"), ([(5, 2)], "2d")]:
        calls.clear()
        out, ref = _run_both(specs, 4, 2, 64, torch.float32, seed=5)
        assert calls == [want] and _rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_reshape_and_cache_writes_slots_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(0)
    key = torch.randn(9, 2, 64, generator=g).to(dtype)
    value = torch.randn(9, 2, 64, generator=g).to(dtype)
    slots = torch.tensor([3, -1, 17, 40, -1, 5, 63, 16, -1])
    k_cache = torch.randn(4, BLOCK, 2, 64, generator=g).to(dtype)
    v_cache = torch.randn(4, BLOCK, 2, 64, generator=g).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_before, v_before = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, k_ref, v_ref, slots)
    attention.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    written = slots[slots >= 0]
    assert torch.equal(k_cache.view(-1, 2, 64)[written], key[slots >= 0])
    untouched = torch.ones(4 * BLOCK, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(k_cache.view(-1, 2, 64)[untouched], k_before.view(-1, 2, 64)[untouched])
    assert torch.equal(v_cache.view(-1, 2, 64)[untouched], v_before.view(-1, 2, 64)[untouched])


def test_reshape_and_cache_strided_inputs_from_a_fused_qkv():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 4 + 2 + 2, 64, generator=g, dtype=torch.float16)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([0, 31, -1, 2, 17])
    k_cache = torch.zeros(2, BLOCK, 2, 64, dtype=torch.float16)
    v_cache = torch.zeros(2, BLOCK, 2, 64, dtype=torch.float16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, k_ref, v_ref, slots)
    attention.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_reshape_and_cache_fp8_divides_by_the_scale():
    # values exactly representable in e4m3 after the division: the interpreter's fp32->fp8 rounding is unreliable
    # near binade edges, so rounding itself is checked on a GPU (benchmarks/gpu_check.py)
    g = torch.Generator().manual_seed(2)
    exact_k = torch.randn(6, 2, 64, generator=g).to(torch.float8_e4m3fn).float()
    exact_v = torch.randn(6, 2, 64, generator=g).to(torch.float8_e4m3fn).float()
    key, value = (exact_k * 0.25).half(), (exact_v * 2.0).half()
    slots = torch.tensor([-1, 4, 9, -1, 30, 1])
    k_cache = torch.randn(2, BLOCK, 2, 64, generator=g).to(torch.float8_e4m3fn)
    v_cache = torch.randn(2, BLOCK, 2, 64, generator=g).to(torch.float8_e4m3fn)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, k_ref, v_ref, slots, 0.25, 2.0)
    attention.reshape_and_cache(key, value, k_cache, v_cache, slots, 0.25, 2.0)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


# ---- sliding window and sinks ---------------------------------------------------------------------------------------

def _run_window_sinks(specs, hq, hkv, d, dtype, window, with_sinks, seed, **kw):
    q, kc, vc, cu, seq_lens, table = _batch(specs, hq, hkv, d, dtype, seed=seed)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed + 1)) * 2 if with_sinks else None
    max_q, max_k = max(ql for _, ql in specs), int(seq_lens.max())
    ref = torch.zeros_like(q)
    reference.paged_attention(q, kc, vc, ref, cu, seq_lens, table, max_q, max_k, d ** -0.5,
                              sliding_window=window, sinks=sinks)
    out = torch.full_like(q, float("nan"))
    attention.paged_attention(q, kc, vc, out, cu, seq_lens, table, max_q, max_k, d ** -0.5,
                              sliding_window=window, sinks=sinks, **kw)
    assert not out.isnan().any(), "some output rows were never written"
    return out, ref, (q, kc, vc, cu, seq_lens, table, max_q, max_k)


WINDOW_SPECS = [(21, 13), (37, 1), (0, 17), (70, 1), (5, 30)]  # chunked prefill, decode, fresh prefill


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", [5, 16, 35, 400], ids=["w5", "w16-tile", "w35", "w400-beyond-context"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_prefill_with_sliding_window_and_sinks_matches_reference(window, with_sinks, dtype):
    out, ref, _ = _run_window_sinks(WINDOW_SPECS, 8, 2, 64, dtype, window, with_sinks, seed=window)
    assert _rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("split", [False, True], ids=["2d", "split-kv"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", [3, 16, 40, 400], ids=["w3", "w16-tile", "w40", "w400-beyond-context"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decode_with_sliding_window_and_sinks_matches_reference(window, with_sinks, dtype, split):
    specs = [(40, 1), (2, 1), (95, 1), (16, 1)]
    out, ref, _ = _run_window_sinks(specs, 8, 2, 64, dtype, window, with_sinks, seed=window + 1, split_kv=split,
                                    num_segments=4 if split else None)
    assert _rel_err(out, ref) < 1e-3


def test_window_and_sinks_change_the_result():
    """The reference really applies them: a window shorter than the context and sinks each move the output."""
    specs = [(40, 1), (10, 12)]
    plain, _, args = _run_window_sinks(specs, 4, 2, 64, torch.float32, None, False, seed=3)
    for window, with_sinks in [(8, False), (None, True)]:
        out, ref, _ = _run_window_sinks(specs, 4, 2, 64, torch.float32, window, with_sinks, seed=3)
        assert _rel_err(ref, plain) > 0.05 and _rel_err(out, ref) < 1e-3


def test_tiles_outside_the_window_are_skipped_not_masked():
    """Poisoning the KV outside every query's window (NaN) leaves the output finite: those tiles are never read."""
    specs = [(80, 1), (64, 9)]
    window = 8
    q, kc, vc, cu, seq_lens, table = _batch(specs, 4, 2, 64, torch.float32, seed=9)
    ref = torch.zeros_like(q)
    reference.paged_attention(q, kc, vc, ref, cu, seq_lens, table, 9, 81, 0.125, sliding_window=window)
    for b, (ctx, ql) in enumerate(specs):
        first_visible = ctx - window + 1
        for t in range(first_visible // 16 * 16):  # whole 16-token tiles before the window
            blk, off = int(table[b, t // BLOCK]), t % BLOCK
            kc[blk, off] = float("nan")
            vc[blk, off] = float("nan")
    for split in (False, True):
        if split and max(ql for _, ql in specs) > 1:
            continue
        out = torch.full_like(q, float("nan"))
        attention.paged_attention(q, kc, vc, out, cu, seq_lens, table, 9, 81, 0.125, sliding_window=window,
                                  tile_size=16, split_kv=split)
        assert not out.isnan().any()
        assert _rel_err(out, ref) < 1e-3
    out = torch.full_like(q[:1], float("nan"))
    attention.paged_attention(q[:1], kc, vc, out, cu[:2], seq_lens[:1], table[:1], 1, 81, 0.125,
                              sliding_window=window, tile_size=16, split_kv=True, num_segments=4)
    assert not out.isnan().any() and _rel_err(out, ref[:1]) < 1e-3


def _huge_cache_case() -> None:
    """KV offsets past 2^31 elements: an FP8 cache of 2^31 + 98,304 elements (8 KV heads x 128, 131,078 blocks; 2 GB
    of address space, of which only the written blocks' pages are touched) with every sequence's blocks at its end.
    Run in a subprocess: an int32 offset would wrap to a negative address and crash the interpreter."""
    hkv, d, hq = 8, 128, 16
    nb = (1 << 31) // (BLOCK * hkv * d) + 6
    cache = torch.empty(nb, BLOCK, hkv, d, dtype=torch.float8_e4m3fn)
    assert cache.numel() > 2**31
    table = torch.tensor([[nb - 1, nb - 3, nb - 5], [nb - 2, nb - 4, nb - 6]], dtype=torch.int32)
    seq_lens = torch.tensor([42, 21], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    slots = torch.cat([table[i, torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK
                       for i, n in enumerate(seq_lens.tolist())])
    kv = torch.randn(len(slots), hkv, d, generator=g).to(torch.float8_e4m3fn).half()  # exact in e4m3
    attention.reshape_and_cache(kv, kv, cache, cache, slots)
    assert torch.equal(cache.view(-1, hkv, d)[slots].half(), kv)
    assert cache.view(-1, hkv, d)[slots].float().abs().sum() > 0

    for qlens, split in (([5, 1], False), ([1, 1], True), ([1, 1], False)):
        cu = torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32)
        q = torch.randn(sum(qlens), hq, d, generator=g).half()
        ref = torch.zeros_like(q)
        reference.paged_attention(q, cache, cache, ref, cu, seq_lens, table, max(qlens), 42, d ** -0.5, 0.5, 0.5)
        out = torch.full_like(q, float("nan"))
        attention.paged_attention(q, cache, cache, out, cu, seq_lens, table, max(qlens), 42, d ** -0.5, 0.5, 0.5,
                                  split_kv=split)
        assert _rel_err(out, ref) < 1e-3, (qlens, split)


def test_kv_offsets_past_2_31_elements_use_64_bit_arithmetic():
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent.parent
    code = "from tests.kernels.test_attention import _huge_cache_case; _huge_cache_case()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("split", [False, True], ids=["2d", "split-kv"])
def test_block_table_entries_past_a_sequence_are_never_read(split):
    """A table row is only valid up to its sequence's last block; stale entries past it (-1, or ids far outside the
    cache) must stay masked in every tile, including the partial last tile of a wide TILE."""
    specs = [(21, 1), (37, 1), (2, 1)]
    q, kc, vc, cu, seq_lens, table = _batch(specs, 8, 2, 64, torch.float16, seed=4)
    wide = torch.full((len(specs), 8), -1, dtype=torch.int32)
    for i, (c, ql) in enumerate(specs):
        used = (c + ql + BLOCK - 1) // BLOCK
        wide[i, :used] = table[i, :used]
        wide[i, used + 1:] = 2**31 - 1
    ref = torch.zeros_like(q)
    reference.paged_attention(q, kc, vc, ref, cu, seq_lens, wide, 1, 38, 0.125)
    out = torch.full_like(q, float("nan"))
    attention.paged_attention(q, kc, vc, out, cu, seq_lens, wide, 1, 38, 0.125, split_kv=split, tile_size=64)
    assert _rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("hq,hkv,d", [(8, 1, 128), (4, 4, 64)], ids=["gqa8-hd128", "mha-hd64"])
def test_gpu_default_prefill_tiles_over_a_cached_prefix(hq, hkv, d):
    """The CUDA defaults for a batch with a prefill (64 query rows, 32-key tiles, 4 warps), run by the interpreter:
    chunks over cached prefixes that are not block multiples, a chunk longer than one q-block, a decode row."""
    specs = [(29, 70), (45, 1), (0, 33), (16, 9)]
    out, ref = _run_both(specs, hq, hkv, d, torch.float16, seed=hq + d, block_m=64, tile_size=32, num_warps=4,
                         num_stages=3)
    assert _rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("split", [False, True], ids=["2d", "split-kv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_soft_capped_scores_match_reference(dtype, split):
    """Gemma 2's attention soft-cap: scores of order 10 against a cap of 4, so the cap reshapes every softmax; with a
    window too, in prefill, chunked and decode rows (split-KV takes the decode-only batch)."""
    specs = [(40, 1), (2, 1), (95, 1), (16, 1)] if split else WINDOW_SPECS
    q, kc, vc, cu, seq_lens, table = _batch(specs, 8, 2, 64, dtype, seed=21)
    q = (q.float() * 3).to(dtype)
    max_q, max_k = max(ql for _, ql in specs), int(seq_lens.max())
    outs = {}
    for cap in (None, 4.0):
        ref = torch.zeros_like(q)
        reference.paged_attention(q, kc, vc, ref, cu, seq_lens, table, max_q, max_k, 64 ** -0.5,
                                  sliding_window=35, softcap=cap)
        out = torch.full_like(q, float("nan"))
        attention.paged_attention(q, kc, vc, out, cu, seq_lens, table, max_q, max_k, 64 ** -0.5,
                                  sliding_window=35, softcap=cap, split_kv=split, num_segments=4 if split else None)
        assert _rel_err(out, ref) < 1e-3
        outs[cap] = ref
    assert _rel_err(outs[4.0], outs[None]) > 0.05  # the cap really changes the result


def test_torch_backend_soft_caps_like_the_reference():
    """The CPU backend (batched decode rows, per-sequence prefill) applies the cap in both paths."""
    from ember.engine.attention import TorchBackend

    specs = [(21, 13), (37, 1), (0, 17), (70, 1)]
    q, kc, vc, cu, seq_lens, table = _batch(specs, 8, 2, 64, torch.float32, seed=22)
    q = q * 3
    ref, out = torch.zeros_like(q), torch.zeros_like(q)
    reference.paged_attention(q, kc, vc, ref, cu, seq_lens, table, 17, 71, 0.125, softcap=4.0)
    TorchBackend.paged_attention(q, kc, vc, out, cu, seq_lens, table, 17, 71, 0.125, softcap=4.0)
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("split", [False, True], ids=["2d", "split-kv"])
@pytest.mark.parametrize("chunk", [7, 16, 20, 64], ids=["c7", "c16-tile", "c20", "c64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_chunked_attention_matches_reference(dtype, chunk, split):
    """Llama 4's chunked attention: each query sees only the keys of its own chunk (prefill, chunked prefill over a
    cached prefix and decode rows; split-KV takes the decode-only batch)."""
    specs = [(40, 1), (2, 1), (95, 1), (16, 1)] if split else WINDOW_SPECS
    q, kc, vc, cu, seq_lens, table = _batch(specs, 8, 2, 64, dtype, seed=chunk)
    max_q, max_k = max(ql for _, ql in specs), int(seq_lens.max())
    ref = torch.zeros_like(q)
    reference.paged_attention(q, kc, vc, ref, cu, seq_lens, table, max_q, max_k, 64 ** -0.5, chunk=chunk)
    out = torch.full_like(q, float("nan"))
    attention.paged_attention(q, kc, vc, out, cu, seq_lens, table, max_q, max_k, 64 ** -0.5, chunk=chunk,
                              split_kv=split, num_segments=4 if split else None)
    assert _rel_err(out, ref) < 1e-3
    plain = torch.zeros_like(q)
    reference.paged_attention(q, kc, vc, plain, cu, seq_lens, table, max_q, max_k, 64 ** -0.5)
    assert _rel_err(ref, plain) > 0.05  # the chunks really cut the context


def test_the_reference_chunk_is_the_querys_own():
    """One sequence of 10 fresh tokens, chunk 4: query 5 attends to keys 4 and 5 only; the CPU backend agrees."""
    from ember.engine.attention import TorchBackend

    q, kc, vc, cu, seq_lens, table = _batch([(0, 10)], 2, 2, 16, torch.float32, seed=3)
    vc.zero_()
    for pos in range(10):  # value = the key's position
        vc[table[0, pos // BLOCK], pos % BLOCK, :, 0] = float(pos)
    out = torch.zeros_like(q)
    reference.paged_attention(q, kc, vc, out, cu, seq_lens, table, 10, 10, 0.25, chunk=4)
    assert 4 <= out[5, 0, 0] <= 5 and out[8, 0, 0] == 8 and out[3, 0, 0] <= 3
    dec = torch.zeros_like(q[:1])
    TorchBackend.paged_attention(q[9:10], kc, vc, dec, torch.tensor([0, 1], dtype=torch.int32), seq_lens, table, 1,
                                 10, 0.25, chunk=4)
    assert 8 <= dec[0, 0, 0] <= 9


@pytest.mark.parametrize("split", [False, True], ids=["2d", "split-kv"])
def test_latent_attention_heads_split_the_group_and_match_reference(split, monkeypatch):
    """DeepSeek's latent attention (one KV head of 576, padded to 1024) takes at most 16 query heads per launch, so a
    40-head group is split over three launches (with a sink per head); prefill and decode match the reference."""
    launches = []
    kernel = attention._unified_attention_3d if split else attention._unified_attention_2d

    class Counting:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(kw["GROUP"])
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(attention, "_unified_attention_3d" if split else "_unified_attention_2d", Counting())
    specs = [(9, 1), (20, 1)] if split else [(5, 3), (0, 4), (17, 1)]
    sinks = torch.randn(40)
    q, kc, vc, cu, seq_lens, table = _batch(specs, 40, 1, 576, torch.float16, seed=5)
    max_q = max(ql for _, ql in specs)
    ref = torch.zeros_like(q)
    reference.paged_attention(q, kc, vc, ref, cu, seq_lens, table, max_q, 0, 0.05, sinks=sinks)
    out = torch.full_like(q, float("nan"))
    attention.paged_attention(q, kc, vc, out, cu, seq_lens, table, max_q, 0, 0.05, split_kv=split, sinks=sinks)
    assert launches == [16, 16, 8]
    assert _rel_err(out, ref) < 1e-3
