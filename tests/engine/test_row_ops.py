"""The model wired to the Triton row kernels (RMSNorm and the zero-centred one, plain and fused with the residual
add, Qwen3-Next's gated norm, neox rotary, SiLU- and GELU-tanh-and-mul; the interpreter on a CPU) generates the same
greedy tokens, with logits within fp32 rounding, as the torch path; the choice follows the device and
``EMBER_ROW_OPS``."""
from __future__ import annotations

import collections

import pytest
import torch

from ember.engine.models.gemma3 import GeluTanhMLP
from ember.engine.models.layers import GatedMLP, OffsetRMSNorm, RMSNorm, RotaryEmbedding, row_ops_backend
from ember.kernels import activation, norm
from tests.conftest import greedy_with_logits


def _run(path, monkeypatch, ops: str):
    return greedy_with_logits(path, monkeypatch, ops, "torch")


def test_triton_row_ops_match_the_torch_path(tiny_qwen3_dir, monkeypatch):
    ref_eng, want, want_logits = _run(tiny_qwen3_dir, monkeypatch, "torch")
    eng, got, got_logits = _run(tiny_qwen3_dir, monkeypatch, "triton")
    mods = [m for m in eng.runner.model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, GatedMLP))]
    assert len(mods) == 2 * 5 + 2 and all(m.triton for m in mods)  # per layer: 4 norms, MLP; final norm, rope
    assert not any(m.triton for m in ref_eng.runner.model.modules() if isinstance(m, RMSNorm))
    assert all(len(v) == 6 for v in want.values())
    assert got == want
    assert len(got_logits) == len(want_logits)
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _count_kernel_calls(monkeypatch) -> collections.Counter:
    """Calls of the zero-centred norm kernels (by function) and of the GELU-tanh one, from now on."""
    calls: collections.Counter = collections.Counter()
    for module, name in ((norm, "rms_norm"), (norm, "fused_add_rms_norm"), (activation, "gelu_tanh_and_mul")):
        def spy(*args, _fn=getattr(module, name), _name=name, **kw):
            calls[_name] += int(_name == "gelu_tanh_and_mul" or kw.get("offset", False))
            return _fn(*args, **kw)

        monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("model,norms,mlps,kernels", [
    # per layer: 4 sandwich norms (the pre-norms add the residual), q/k norms
    ("tiny_gemma3_dir", 7 * 6 + 1, 7, {"rms_norm", "fused_add_rms_norm", "gelu_tanh_and_mul"}),
    ("tiny_qwen3_next_dir", 4 * 2 + 2 * 2 + 1, 0, {"rms_norm", "fused_add_rms_norm"}),  # 2 of 4 layers: q/k norms
], ids=["gemma3", "qwen3_next"])
def test_zero_centred_norms_and_gelu_mlp_match_the_torch_path(model, norms, mlps, kernels, request, monkeypatch):
    path = request.getfixturevalue(model)
    ref_eng, want, want_logits = _run(path, monkeypatch, "torch")
    calls = _count_kernel_calls(monkeypatch)
    eng, got, got_logits = _run(path, monkeypatch, "triton")
    kinds = (OffsetRMSNorm, GeluTanhMLP)
    mods = [m for m in eng.runner.model.modules() if isinstance(m, kinds)]
    assert [isinstance(m, OffsetRMSNorm) for m in mods].count(True) == norms and len(mods) == norms + mlps
    assert all(m.triton for m in mods)
    assert not any(m.triton for m in ref_eng.runner.model.modules() if isinstance(m, kinds))
    assert {k for k, n in calls.items() if n} == kernels
    flagged = [m for m in eng.runner.model.modules() if isinstance(getattr(type(m), "triton", None), bool)]
    assert all(m.triton for m in flagged)  # every row-op module, Qwen3-Next's gated norms included
    assert sum(type(m).__name__ == "GatedRMSNorm" for m in flagged) == (2 if model == "tiny_qwen3_next_dir" else 0)
    assert all(len(v) == 6 for v in want.values())
    assert got == want
    assert len(got_logits) == len(want_logits)
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_row_ops_follow_the_device_and_the_override(monkeypatch):
    monkeypatch.delenv("EMBER_ROW_OPS", raising=False)
    assert row_ops_backend(torch.device("cpu")) == "torch"
    assert row_ops_backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv("EMBER_ROW_OPS", "torch")
    assert row_ops_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv("EMBER_ROW_OPS", "fast")
    with pytest.raises(ValueError, match="EMBER_ROW_OPS"):
        row_ops_backend(torch.device("cpu"))
