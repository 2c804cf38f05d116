"""Qwen3-Next's conv decode step as one Triton launch (interpreter on a CPU) against the model's torch step: the same
outputs and the same windows left in the slots, for tokens that continue a sequence and tokens that start one."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ember.engine.attention import RecurrentMetadata
from ember.engine.models.qwen3_next import GatedDeltaNet


def _layer(state: torch.Tensor, weight: torch.Tensor) -> SimpleNamespace:
    """What `GatedDeltaNet._conv` reads of its layer: the conv weight ``[C, 1, K]`` and the windows."""
    return SimpleNamespace(conv1d=SimpleNamespace(weight=weight), conv_state=state, channels=weight.shape[0],
                           kernel=weight.shape[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("channels,k", [(96, 4), (40, 2), (1500, 3)], ids=["k4", "k2", "wide-k3"])
def test_conv_decode_kernel_equals_the_torch_step(dtype, channels, k):
    g = torch.Generator().manual_seed(channels + k)
    mixed = torch.randn(7, channels, generator=g).to(dtype)
    weight = (torch.randn(channels, 1, k, generator=g) * 0.5).to(dtype)
    state = torch.randn(6, channels, k - 1, generator=g).to(dtype)
    tokens = torch.tensor([0, 2, 3, 6])  # rows 1, 4, 5 belong to a prefill chunk of this step, not to this call
    rec = RecurrentMetadata(tokens, torch.tensor([4, 0, 5, 2]), torch.tensor([1.0, 0.0, 1.0, 1.0]), [])
    want_state, got_state = state.clone(), state.clone()
    want = GatedDeltaNet._conv(_layer(want_state, weight), mixed, rec, triton=False)
    got = GatedDeltaNet._conv(_layer(got_state, weight), mixed, rec, triton=True)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got[tokens], want[tokens], **tol)
    assert torch.equal(got_state, want_state)  # shifted windows, the restarted one from zeros; slots 1, 3 untouched
    assert torch.equal(got_state[[1, 3]], state[[1, 3]]) and (got_state[0, :, -1] == mixed[2]).all()
