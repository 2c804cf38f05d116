"""Qwen3-Next's grouped linear-attention projections rearranged by one Triton launch (interpreter on a CPU) equal the
model's torch path bit for bit: q|k|v in the conv's channel order, z, b and a per value head."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ember.engine.models.qwen3_next import GatedDeltaNet


def _layer(hk: int, hv: int, dk: int, dv: int, hidden: int, dtype: torch.dtype, seed: int) -> SimpleNamespace:
    """What `GatedDeltaNet._project` reads of its layer: head counts and dims and the two projections."""
    torch.manual_seed(seed)
    r = hv // hk
    layer = SimpleNamespace(hk=hk, hv=hv, dk=dk, dv=dv,
                            in_proj_qkvz=nn.Linear(hidden, hk * (2 * dk + 2 * r * dv), bias=False).to(dtype),
                            in_proj_ba=nn.Linear(hidden, hk * 2 * r, bias=False).to(dtype))
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 8), (3, 3, 24, 12), (1, 4, 32, 16)],
                         ids=["two-value-heads-per-key", "one-each-not-powers-of-two", "four-per-key"])
def test_one_launch_split_equals_the_torch_copies(dtype, hk, hv, dk, dv):
    layer = _layer(hk, hv, dk, dv, 40, dtype, seed=hk + hv + dk)
    x = torch.randn(5, 40).to(dtype)
    want = GatedDeltaNet._project(layer, x, triton=False)
    got = GatedDeltaNet._project(layer, x, triton=True)
    for name, w, g in zip(("q|k|v", "z", "b", "a"), want, got):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous(), name
        assert torch.equal(g, w), name
    # the layout itself: the first key head's q starts the channels, its k starts the k block
    qkvz = layer.in_proj_qkvz(x)
    assert torch.equal(got[0][:, :dk], qkvz[:, :dk])
    assert torch.equal(got[0][:, hk * dk:hk * dk + dk], qkvz[:, dk:2 * dk])


def test_an_empty_step_has_empty_parts():
    layer = _layer(2, 4, 16, 8, 40, torch.float32, seed=0)
    got = GatedDeltaNet._project(layer, torch.empty(0, 40), triton=True)
    assert [tuple(p.shape) for p in got] == [(0, 2 * 2 * 16 + 4 * 8), (0, 4, 8), (0, 4), (0, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_attention_output_gate_reads_the_gate_in_place_and_rounds_as_torch(dtype):
    """Qwen3-Next's gated attention: ``out * sigmoid(gate)`` with each head's gate a strided view between the heads'
    queries, one launch, the same values as the torch expression (the sigmoid rounded to the dtype first)."""
    from ember.kernels import activation

    g = torch.Generator().manual_seed(1)
    t, h, d = 6, 3, 24
    qg = (torch.randn(t, h, 2 * d, generator=g) * 3).to(dtype)
    gate = qg[..., d:]
    out = torch.randn(t, h * d, generator=g).to(dtype)
    got = activation.sigmoid_gate_mul(out, gate)
    want = out * torch.sigmoid(gate.reshape(t, h * d))
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)  # exp's last bits
    torch.testing.assert_close(got, want, **tol)
    assert (got != out).any() and got.dtype == dtype
