"""The fused attention prologue (per-head q/k RMSNorm, neox RoPE, paged KV write in one Triton launch) against the
unfused chain it replaces: the torch references, and the Triton norm, rotary and cache-write kernels themselves
(TRITON_INTERPRET=1 on CPU)."""
from __future__ import annotations

import pytest
import torch

from ember.kernels import attention, norm, reference_ops, rotary
from ember.kernels.qk_norm_rope_cache import qk_norm_rope_cache

BLOCK_SIZE = 4


def _case(seed: int, t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None,
          num_blocks: int = 9):
    """A fused qkv output with its q/k/v views, positions, slots (two of them -1) and empty caches."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    positions = torch.randint(0, 500, (t,), generator=g)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:t]
    slots[1::3] = -1
    cache = torch.full((num_blocks, BLOCK_SIZE, hkv, d), 7.0).to(cache_dtype or dtype)
    weights = [(torch.randn(d, generator=g) * 0.5 + 1).to(dtype) for _ in range(2)]
    return positions, q, k, v, slots, cache, weights


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("hq,hkv,d,rot,normed", [(4, 2, 64, 64, True), (8, 1, 128, 128, True), (6, 3, 64, 32, True),
                                                  (5, 5, 32, 32, False), (4, 2, 80, 40, True)],
                         ids=["gqa2", "mqa-hd128", "partial", "no-norm", "hd80-partial"])
def test_fused_prologue_matches_the_unfused_reference(dtype, hq, hkv, d, rot, normed):
    positions, q, k, v, slots, cache, (wq, wk) = _case(hq * d + rot, 7, hq, hkv, d, dtype)
    cs = reference_ops.rotary_cos_sin_cache(rot, 512, 1e6, dtype)
    ws = (wq, wk) if normed else (None, None)
    kc, vc, rkc, rvc = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    got = qk_norm_rope_cache(positions, q, k, v, cs, kc, vc, slots, *ws, 1e-6)
    want = reference_ops.qk_norm_rope_cache(positions, q, k, v, cs, rkc, rvc, slots, *ws, 1e-6)
    assert got.shape == (7, hq, d) and got.dtype == dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel_err(got, want) < tol
    written = slots >= 0
    assert torch.equal(vc, rvc)  # values are copied, not computed
    assert _rel_err(kc, rkc) < tol
    untouched = torch.ones(cache.shape[0] * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots[written]] = False
    assert (kc.view(-1, hkv, d)[untouched] == 7).all() and (vc.view(-1, hkv, d)[untouched] == 7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("offset", [False, True], ids=["rmsnorm", "offset"])
def test_fused_prologue_equals_the_triton_kernels_it_replaces(dtype, offset):
    """The norm, rotary and cache-write kernels in sequence, to the last bit but for the order of the mean square's
    sum (the same roundings to the activation dtype, in the same order)."""
    positions, q, k, v, slots, cache, (wq, wk) = _case(11, 6, 8, 2, 64, dtype)
    cs = reference_ops.rotary_cos_sin_cache(64, 512, 1e4, dtype)
    kc, vc, rkc, rvc = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    got = qk_norm_rope_cache(positions, q, k, v, cs, kc, vc, slots, wq, wk, 1e-5, offset=offset)
    qn, kn = norm.rms_norm(q, wq, 1e-5, offset=offset), norm.rms_norm(k, wk, 1e-5, offset=offset)
    want, kr = rotary.rotary_neox(positions, qn, kn, cs)
    attention.reshape_and_cache(kr, v, rkc, rvc, slots)
    ulp = dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    torch.testing.assert_close(got, want, **ulp)
    torch.testing.assert_close(kc, rkc, **ulp)
    assert torch.equal(vc, rvc)


def test_fused_prologue_scales_into_an_fp8_cache():
    positions, q, k, v, slots, _, (wq, wk) = _case(5, 5, 4, 2, 64, torch.float16)
    cache = torch.zeros(9, BLOCK_SIZE, 2, 64, dtype=torch.float8_e4m3fn)
    cs = reference_ops.rotary_cos_sin_cache(64, 512, 1e6, torch.float16)
    kc, vc, rkc, rvc = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    qk_norm_rope_cache(positions, q, k, v, cs, kc, vc, slots, wq, wk, 1e-6, 0.5, 2.0)
    qn, kn = norm.rms_norm(q, wq, 1e-6), norm.rms_norm(k, wk, 1e-6)
    attention.reshape_and_cache(rotary.rotary_neox(positions, qn, kn, cs)[1], v, rkc, rvc, slots, 0.5, 2.0)
    assert torch.equal(vc.view(torch.uint8), rvc.view(torch.uint8))  # the cast the unfused kernel makes
    assert (kc.view(torch.uint8) != rkc.view(torch.uint8)).float().mean() < 0.02  # but the norm's summation order
    ref_k, ref_v = cache.clone(), cache.clone()
    reference_ops.qk_norm_rope_cache(positions, q, k, v, cs, ref_k, ref_v, slots, wq, wk, 1e-6, 0.5, 2.0)
    assert _rel_err(kc, ref_k) < 0.1 and _rel_err(vc, ref_v) < 0.1  # e4m3 keeps 3 mantissa bits
    assert kc.float().abs().max() > 4  # the keys were divided by 0.5: normed values times 2


def test_fused_prologue_rejects_heads_that_are_not_contiguous():
    positions, q, k, v, slots, cache, _ = _case(3, 4, 4, 2, 64, torch.float32)
    cs = reference_ops.rotary_cos_sin_cache(64, 512, 1e6)
    with pytest.raises(ValueError, match="v: each head's channels must be contiguous"):
        qk_norm_rope_cache(positions, q, k, v.transpose(1, 2).contiguous().transpose(1, 2), cs, cache, cache.clone(),
                           slots)
