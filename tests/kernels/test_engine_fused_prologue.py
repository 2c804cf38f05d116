"""The engine on the CUDA path's kernels (Triton attention and row kernels; the interpreter on a CPU) runs each
attention layer's q/k norms, RoPE and KV write as one launch, and generates what the torch path generates."""
from __future__ import annotations

import pytest
import torch

from ember.engine.models.layers import Attention
from ember.kernels import qk_norm_rope_cache as prologue
from tests.conftest import greedy_with_logits


def _generate(path, monkeypatch, kernels: str, kv_cache_dtype: str | None = None):
    return greedy_with_logits(path, monkeypatch, kernels, kernels, kv_cache_dtype)


def _count_prologues(monkeypatch) -> list[int]:
    calls = [0]
    fused = prologue.qk_norm_rope_cache

    def spy(*args, **kw):
        calls[0] += 1
        return fused(*args, **kw)

    monkeypatch.setattr(prologue, "qk_norm_rope_cache", spy)
    return calls


@pytest.mark.parametrize("model", ["tiny_qwen3_dir", "tiny_gemma3_dir", "tiny_qwen3_next_dir"],
                         ids=["qwen3-qk-norm", "gemma3-offset-norm-window", "qwen3-next-gated-partial-rotary"])
def test_fused_prologue_generates_what_the_torch_path_generates(model, request, monkeypatch):
    path = request.getfixturevalue(model)
    _, want, want_logits = _generate(path, monkeypatch, "torch")
    calls = _count_prologues(monkeypatch)
    eng, got, got_logits = _generate(path, monkeypatch, "triton")
    layers = sum(isinstance(m, Attention) for m in eng.runner.model.modules())
    assert calls[0] == layers * eng.num_steps  # one launch per attention layer per step, no unfused fallback
    assert all(len(v) == 6 for v in want.values()) and got == want
    assert len(got_logits) == len(want_logits)
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_fused_prologue_writes_the_fp8_cache_as_the_unfused_kernels_do(tiny_qwen3_dir, monkeypatch):
    _, fused, fused_logits = _generate(tiny_qwen3_dir, monkeypatch, "triton", "fp8")
    monkeypatch.setattr(Attention, "_fused_prologue", lambda self, rope, backend: False)
    calls = _count_prologues(monkeypatch)
    _, unfused, unfused_logits = _generate(tiny_qwen3_dir, monkeypatch, "triton", "fp8")
    assert calls[0] == 0
    assert fused == unfused
    for a, b in zip(fused_logits, unfused_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
