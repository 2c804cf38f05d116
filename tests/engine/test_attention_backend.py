"""The CPU attention backend (decode rows batched) agrees with the per-sequence torch reference, and the backend
choice follows the device and EMBER_ATTENTION."""
from __future__ import annotations

import pytest
import torch

from ember.engine import attention
from ember.kernels import reference


def _case(seed: int, qlens: list[int], ctx: list[int], hq: int = 8, hkv: int = 2, d: int = 32, bs: int = 16):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx, qlens)]
    nblocks = [(s + bs - 1) // bs for s in seq_lens]
    perm = torch.randperm(sum(nblocks) + 3, generator=g).tolist()
    tables, i = [], 0
    for n in nblocks:
        tables.append(perm[i:i + n] + [0] * (max(nblocks) - n))
        i += n
    k_cache = torch.randn(len(perm), bs, hkv, d, generator=g)
    v_cache = torch.randn(len(perm), bs, hkv, d, generator=g)
    q = torch.randn(sum(qlens), hq, d, generator=g)
    cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32)


OPTIONS = [{}, {"sliding_window": 9}, {"softcap": 3.0}, {"chunk": 16},
           {"sinks": torch.linspace(-1.0, 1.0, 8)}]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("qlens,ctx", [([1, 1, 1, 1], [5, 40, 17, 0]), ([1, 7, 1, 33, 1], [30, 0, 63, 9, 1]),
                                       ([2, 5, 1, 8, 3, 9], [10, 0, 40, 17, 64, 2]),
                                       ([20, 0], [0, 38]), ([0, 3, 0, 12], [5, 4, 0, 20])])  # empty segments
def test_batched_short_queries_match_reference(qlens, ctx, options):
    """Decode rows and short chunks (speculative drafts, small prefill chunks) batched, longer ones per sequence:
    every row equals the per-sequence reference, with each attention variant."""
    q, kc, vc, cu, sl, bt = _case(0, qlens, ctx)
    ref = torch.full_like(q, float("nan"))
    ours = torch.full_like(q, float("nan"))
    scale = q.shape[-1] ** -0.5
    reference.paged_attention(q, kc, vc, ref, cu, sl, bt, max(qlens), int(sl.max()), scale, **options)
    attention.TorchBackend.paged_attention(q, kc, vc, ours, cu, sl, bt, max(qlens), int(sl.max()), scale, **options)
    assert not ours.isnan().any()
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-5


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("EMBER_ATTENTION", raising=False)
    assert attention.backend_name(torch.device("cpu")) == "torch"
    assert attention.backend_name(torch.device("cuda")) == "triton"
    assert attention.get_backend(torch.device("cpu")) is attention.TorchBackend
    monkeypatch.setenv("EMBER_ATTENTION", "reference")
    assert attention.get_backend(torch.device("cpu")) is reference
    monkeypatch.setenv("EMBER_ATTENTION", "triton")
    assert attention.backend_name(torch.device("cpu")) == "triton"
    monkeypatch.setenv("EMBER_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="EMBER_ATTENTION"):
        attention.backend_name(torch.device("cpu"))


def test_engine_on_the_triton_backend_matches_torch(demo_model_dir, monkeypatch):
    """The model runner drives the Triton kernels (interpreted on CPU) through the same interface."""
    from ember.engine.engine import Engine
    from ember.engine.params import SamplingParams

    pytest.importorskip("triton")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    results = []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("EMBER_ATTENTION", backend)
        eng = Engine.from_pretrained(demo_model_dir, num_kv_blocks=8)
        assert eng.runner.backend.__name__.endswith("attention") == (backend == "triton")
        rids = [eng.add_request(list(range(5, 5 + n)), params) for n in (3, 18)]
        toks = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                toks[o.request_id].extend(o.new_token_ids)
        results.append([toks[r] for r in rids])
    assert results[0] == results[1]


@pytest.mark.parametrize("variable,flag", [("EMBER_ATTENTION", "--attention-backend"),
                                           ("EMBER_ROW_OPS", "--row-ops-backend")])
def test_triton_without_cuda_or_the_interpreter_is_refused_when_the_engine_starts(demo_model_dir, monkeypatch,
                                                                                 variable, flag):
    """A CPU engine told to run Triton kernels would start and then fail every step ("0 active drivers"): it is
    refused at start, naming the flag, unless the interpreter runs the kernels."""
    from ember.engine.engine import Engine

    monkeypatch.setenv(variable, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=f"{flag} .*triton needs a CUDA device"):
        Engine.from_pretrained(demo_model_dir, num_kv_blocks=16, device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    Engine.from_pretrained(demo_model_dir, num_kv_blocks=16, device="cpu")


def test_triton_moe_without_cuda_or_the_interpreter_is_refused(monkeypatch):
    from ember.engine.nvfp4_loading import use_triton

    monkeypatch.setenv("EMBER_MOE", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--moe-backend .*triton needs a CUDA device"):
        use_triton(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(torch.device("cpu"))
