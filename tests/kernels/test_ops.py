"""Triton RMSNorm (plain and zero-centred), rotary, SiLU- and GELU-tanh-and-mul against their torch references
(TRITON_INTERPRET=1 on CPU)."""
from __future__ import annotations

import pytest
import torch

from ember.engine.models.layers import OffsetRMSNorm
from ember.kernels import activation, norm, reference_ops, rotary

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@DTYPES
@pytest.mark.parametrize("shape", [(7, 96), (3, 4, 128), (5, 200)])
def test_rms_norm_matches_reference(shape, dtype):
    g = torch.Generator().manual_seed(len(shape) * shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    out = norm.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert _rel_err(out, reference_ops.rms_norm(x, w, 1e-6)) < 1e-3


@DTYPES
def test_fused_add_rms_norm_returns_normed_sum_and_new_residual(dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 160, generator=g).to(dtype)
    res = torch.randn(6, 160, generator=g).to(dtype)
    w = torch.randn(160, generator=g).to(dtype)
    x0, res0 = x.clone(), res.clone()
    out, new_res = norm.fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_res = reference_ops.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(x, x0) and torch.equal(res, res0)
    assert torch.equal(new_res, ref_res)
    assert _rel_err(out, ref_out) < 1e-3


def _offset_norm(w: torch.Tensor, eps: float) -> OffsetRMSNorm:
    m = OffsetRMSNorm(w.shape[0], eps).to(w.dtype)
    with torch.no_grad():
        m.weight.copy_(w)
    return m


@DTYPES
@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 200)])
def test_offset_rms_norm_matches_offset_rmsnorm(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1] + 1)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.5).to(dtype)
    ref = reference_ops.rms_norm(x, w, 1e-6, offset=True)
    assert torch.equal(ref, _offset_norm(w, 1e-6)(x))
    out = norm.rms_norm(x, w, 1e-6, offset=True)
    assert out.shape == x.shape and out.dtype == dtype
    assert _rel_err(out, ref) < 1e-3


@DTYPES
def test_fused_add_offset_rms_norm_returns_normed_sum_and_new_residual(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 136, generator=g).to(dtype)
    res = torch.randn(6, 136, generator=g).to(dtype)
    w = (torch.randn(136, generator=g) * 0.5).to(dtype)
    x0, res0 = x.clone(), res.clone()
    ref_out, ref_res = reference_ops.fused_add_rms_norm(x, res, w, 1e-5, offset=True)
    mod_out, mod_res = _offset_norm(w, 1e-5)(x, res)
    assert torch.equal(ref_out, mod_out) and torch.equal(ref_res, mod_res)
    out, new_res = norm.fused_add_rms_norm(x, res, w, 1e-5, offset=True)
    assert torch.equal(x, x0) and torch.equal(res, res0)
    assert torch.equal(new_res, ref_res)
    assert _rel_err(out, ref_out) < 1e-3


@DTYPES
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (64, 32)], ids=["hd64", "hd128", "partial"])
def test_rotary_neox_matches_reference_on_strided_qkv_views(head_dim, rot_dim, dtype):
    g = torch.Generator().manual_seed(head_dim + rot_dim)
    hq, hkv, t = 8, 2, 9
    cache = reference_ops.rotary_cos_sin_cache(rot_dim, 4096, 1e6)
    positions = torch.randint(0, 4096, (t,), generator=g)
    qkv = torch.randn(t, hq + 2 * hkv, head_dim, generator=g).to(dtype)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
    ref_q, ref_k = reference_ops.rotary_neox(positions, q, k, cache)
    out_q, out_k = rotary.rotary_neox(positions, q, k, cache)
    assert _rel_err(out_q, ref_q) < 1e-3 and _rel_err(out_k, ref_k) < 1e-3
    assert not torch.equal(out_q, q)  # something rotated
    v_before = qkv[:, hq + hkv:].clone()
    rotary.rotary_neox(positions, q, k, cache, inplace=True, block_h=4)
    assert _rel_err(q, ref_q) < 1e-3 and _rel_err(k, ref_k) < 1e-3
    assert torch.equal(qkv[:, hq + hkv:], v_before)


def test_rotary_position_zero_is_identity():
    cache = reference_ops.rotary_cos_sin_cache(64, 16, 10000.0)
    q = torch.randn(2, 4, 64)
    k = torch.randn(2, 1, 64)
    out_q, out_k = rotary.rotary_neox(torch.zeros(2, dtype=torch.long), q, k, cache)
    assert torch.allclose(out_q, q) and torch.allclose(out_k, k)


@DTYPES
@pytest.mark.parametrize("inter,block", [(96, 1024), (300, 128)])
def test_silu_and_mul_matches_reference(inter, block, dtype):
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(2, 5, 2 * inter, generator=g) * 2).to(dtype)
    out = activation.silu_and_mul(x, block=block)
    assert out.shape == (2, 5, inter)
    assert _rel_err(out, reference_ops.silu_and_mul(x)) < 1e-3


@DTYPES
@pytest.mark.parametrize("inter,block", [(96, 1024), (300, 128)])
def test_gelu_tanh_and_mul_matches_reference(inter, block, dtype):
    g = torch.Generator().manual_seed(inter + 1)
    x = (torch.randn(2, 5, 2 * inter, generator=g) * 2).to(dtype)
    x[0, 0, :4] = torch.tensor([-40.0, 40.0, -9.0, 9.0])  # the tanh saturates both ways
    out = activation.gelu_tanh_and_mul(x, block=block)
    assert out.shape == (2, 5, inter) and out.dtype == dtype and torch.isfinite(out).all()
    assert _rel_err(out, reference_ops.gelu_tanh_and_mul(x)) < 1e-3


@DTYPES
@pytest.mark.parametrize("x_dtype", [torch.float32, None], ids=["x-fp32", "x-same"])
def test_gated_rms_norm_matches_reference(dtype, x_dtype):
    """Qwen3-Next's gated norm: the delta rule's float32 output (or a tensor already in the model dtype) normed,
    weighted and gated by ``silu(z)`` in ``z``'s dtype, rounded as the torch code rounds."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 4, 128, generator=g) * 3).to(x_dtype or dtype)
    z = torch.randn(6, 4, 128, generator=g).to(dtype)
    w = (torch.randn(128, generator=g) * 0.5 + 1).to(dtype)
    out = norm.gated_rms_norm(x, z, w, 1e-6)
    want = reference_ops.gated_rms_norm(x, z, w, 1e-6)
    assert out.shape == z.shape and out.dtype == dtype
    assert _rel_err(out, want) < (1e-6 if dtype == torch.float32 else 2e-3)
