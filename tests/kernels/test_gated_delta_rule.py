"""The chunked gated delta rule and the batched decode step equal the token-by-token reference on random inputs,
from a non-zero state, across block boundaries and when a sequence is split into several calls (chunked prefill)."""
from __future__ import annotations

import pytest
import torch

from ember.kernels import gated_delta_rule as gdr

HK, HV, DK, DV = 2, 4, 16, 8


def _inputs(n: int, seed: int, strong_decay: bool = False):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, HK, DK, generator=g), torch.randn(n, HK, DK, generator=g)
    v = torch.randn(n, HV, DV, generator=g)
    decay = -torch.rand(n, HV, generator=g) * (40.0 if strong_decay else 1.0)
    beta = torch.rand(n, HV, generator=g)
    state = torch.randn(HV, DK, DV, generator=g)
    return q, k, v, decay, beta, state


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("n,chunk", [(1, 64), (7, 4), (64, 64), (130, 64), (45, 16)])
def test_chunked_equals_the_reference(n, chunk):
    q, k, v, g, beta, s0 = _inputs(n, seed=n)
    want_o, want_s = gdr.recurrent(q, k, v, g, beta, s0)
    got_o, got_s = gdr.chunked(q, k, v, g, beta, s0, chunk)
    assert _rel(got_o, want_o) < 1e-5 and _rel(got_s, want_s) < 1e-5


def test_strong_decay_stays_finite():
    """Cumulative log decays of thousands (Qwen3-Next's A up to 16) underflow to zero weight, never to inf/NaN."""
    q, k, v, g, beta, s0 = _inputs(128, seed=3, strong_decay=True)
    want_o, want_s = gdr.recurrent(q, k, v, g, beta, s0)
    got_o, got_s = gdr.chunked(q, k, v, g, beta, s0, 64)
    assert torch.isfinite(got_o).all() and torch.isfinite(got_s).all()
    assert _rel(got_o, want_o) < 1e-5 and _rel(got_s, want_s) < 1e-5


def test_a_sequence_split_across_calls_continues_its_state():
    q, k, v, g, beta, s0 = _inputs(50, seed=11)
    want_o, want_s = gdr.recurrent(q, k, v, g, beta, s0)
    o1, s1 = gdr.chunked(q[:21], k[:21], v[:21], g[:21], beta[:21], s0, 16)
    o2, s2 = gdr.chunked(q[21:], k[21:], v[21:], g[21:], beta[21:], s1, 16)
    assert _rel(torch.cat((o1, o2)), want_o) < 1e-5 and _rel(s2, want_s) < 1e-5


def test_a_padded_batch_equals_each_sequence_alone():
    """Sequences of different lengths in one call (zero-padded at the end) give each one's outputs and final state."""
    seqs = [_inputs(n, seed=20 + n) for n in (5, 37, 64, 1)]
    t = max(x[0].shape[0] for x in seqs)

    def padded(j):
        return torch.stack([torch.nn.functional.pad(x[j], (0, 0) * (x[j].dim() - 1) + (0, t - x[j].shape[0]))
                            for x in seqs])

    got_o, got_s = gdr.chunked(*(padded(j) for j in range(5)), torch.stack([x[5] for x in seqs]), 16)
    for i, x in enumerate(seqs):
        want_o, want_s = gdr.recurrent(*x)
        n = x[0].shape[0]
        assert _rel(got_o[i, :n], want_o) < 1e-5 and _rel(got_s[i], want_s) < 1e-5


def test_decode_step_equals_the_reference_per_sequence():
    rows = [_inputs(1, seed=100 + i) for i in range(5)]
    batched = [torch.cat([r[j] for r in rows]) for j in range(5)]
    states = torch.stack([r[5] for r in rows])
    got_o, got_s = gdr.decode_step(*batched, states)
    for i, r in enumerate(rows):
        want_o, want_s = gdr.recurrent(*r)
        assert _rel(got_o[i], want_o[0]) < 1e-6 and _rel(got_s[i], want_s) < 1e-6


def test_decode_step_with_full_decay_starts_from_zero():
    """``g = -inf`` (how the model starts a one-token prompt in a reused slot) ignores what the slot held."""
    q, k, v, g, beta, stale = _inputs(1, seed=7)
    g = torch.full_like(g, float("-inf"))
    got_o, got_s = gdr.decode_step(q, k, v, g, beta, stale.unsqueeze(0) * 100)
    want_o, want_s = gdr.recurrent(q, k, v, torch.zeros_like(g), beta, torch.zeros_like(stale))
    assert torch.isfinite(got_o).all()
    assert _rel(got_o[0], want_o[0]) < 1e-6 and _rel(got_s[0], want_s) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("dk,dv,block_v", [(16, 8, 32), (24, 40, 16)])
def test_triton_decode_updates_the_slots_like_the_reference(dtype, dk, dv, block_v):
    """The Triton decode kernel (interpreter on CPU): outputs and the four slots it owns equal the torch step; a
    ``keep`` of 0 ignores the stale state in its slot; the slots no row names are untouched."""
    from ember.kernels.gated_delta_decode import gated_delta_decode

    g = torch.Generator().manual_seed(dk + dv)
    d, hk, hv = 4, 2, 4
    q, k = torch.randn(d, hk, dk, generator=g).to(dtype), torch.randn(d, hk, dk, generator=g).to(dtype)
    v = torch.randn(d, hv, dv, generator=g).to(dtype)
    decay, beta = -torch.rand(d, hv, generator=g), torch.rand(d, hv, generator=g)
    state = torch.randn(6, hv, dk, dv, generator=g)
    slots = torch.tensor([4, 1, 5, 0])
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0])
    want_o, want_s = gdr.decode_step(q, k, v, decay + keep.log()[:, None], beta, state[slots])
    before = state.clone()
    got_o = gated_delta_decode(q, k, v, decay, beta, keep, state, slots, block_v=block_v)
    assert _rel(got_o, want_o) < 1e-5
    assert _rel(state[slots], want_s) < 1e-5
    assert torch.equal(state[2:4], before[2:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_decode_forms_qwen3_next_gates_as_the_model_does(dtype):
    """With ``gates=(A_log, dt_bias)`` the kernel takes Qwen3-Next's raw ``a`` and ``b`` and forms ``g = -exp(A_log) *
    softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` (in ``b``'s dtype) as the model's torch code does, including
    softplus past its threshold (20) and far below zero."""
    from ember.kernels.gated_delta_decode import gated_delta_decode

    g = torch.Generator().manual_seed(11)
    d, hk, hv, dk, dv = 4, 2, 4, 16, 8
    q, k = torch.randn(d, hk, dk, generator=g).to(dtype), torch.randn(d, hk, dk, generator=g).to(dtype)
    v = torch.randn(d, hv, dv, generator=g).to(dtype)
    a, b = (torch.randn(d, hv, generator=g) * 4).to(dtype), (torch.randn(d, hv, generator=g) * 3).to(dtype)
    a[0, 0], a[1, 1] = 30.0, -40.0
    a_log, dt_bias = torch.randn(hv, generator=g) * 0.5, torch.randn(hv, generator=g)
    state = torch.randn(5, hv, dk, dv, generator=g)
    slots, keep = torch.tensor([3, 0, 4, 1]), torch.tensor([1.0, 1.0, 0.0, 1.0])
    gates = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    want_state = state.clone()
    want = gated_delta_decode(q, k, v, gates, b.sigmoid(), keep, want_state, slots)
    got = gated_delta_decode(q, k, v, a, b, keep, state, slots, gates=(a_log, dt_bias))
    assert _rel(got, want) < 1e-5 and _rel(state, want_state) < 1e-5


@pytest.mark.parametrize("n,dk,dv,batch,chunk", [(37, 16, 8, 1, 16), (130, 24, 40, 3, 64), (5, 16, 16, 2, 4)])
def test_triton_block_scan_equals_the_torch_walk(n, dk, dv, batch, chunk):
    """The chunked rule with its block walk in the Triton scan kernel (interpreter on CPU, fp32 dots; blocks of 16 or
    32 tokens whatever was asked), batched and with head dims that are not powers of two: the reference's outputs
    and final states."""
    g = torch.Generator().manual_seed(n + dk)
    hk, hv = 2, 4
    q, k = torch.randn(batch, n, hk, dk, generator=g), torch.randn(batch, n, hk, dk, generator=g)
    v = torch.randn(batch, n, hv, dv, generator=g)
    decay, beta = -torch.rand(batch, n, hv, generator=g), torch.rand(batch, n, hv, generator=g)
    state = torch.randn(batch, hv, dk, dv, generator=g)
    got_o, got_s = gdr.chunked(q, k, v, decay, beta, state, chunk, scan_kernel=True)
    for i in range(batch):
        want_o, want_s = gdr.recurrent(q[i], k[i], v[i], decay[i], beta[i], state[i])
        assert _rel(got_o[i], want_o) < 1e-5 and _rel(got_s[i], want_s) < 1e-5
