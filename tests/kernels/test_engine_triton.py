"""Greedy decoding through the engine is token-identical with the Triton attention path (interpreter on CPU)."""
from __future__ import annotations

import pytest

engine_mod = pytest.importorskip("ember.engine.engine")
from ember.engine.params import SamplingParams  # noqa: E402


def _generate(model_dir, monkeypatch, backend: str) -> tuple[dict[str, list[int]], str]:
    monkeypatch.setenv("EMBER_ATTENTION", backend)
    # a small token budget forces chunked prefill and mixed prefill + decode steps; shared prefixes hit the cache
    eng = engine_mod.Engine.from_pretrained(model_dir, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=256,
                                            num_kv_blocks=32, dtype="float32", device="cpu")
    shared = [(7 * i + 3) % 200 + 20 for i in range(21)]
    prompts = {"a": shared + [5, 9, 11], "b": [40, 41, 42], "c": shared + [77], "d": list(range(60, 90))}
    out: dict[str, list[int]] = {k: [] for k in prompts}
    reasons: dict[str, str] = {}
    for rid, ids in prompts.items():
        eng.add_request(ids, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), request_id=rid)
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert all(r == "length" for r in reasons.values()), reasons
    return out, eng.runner.backend.__name__


def test_triton_attention_path_matches_reference_tokens(demo_model_dir, monkeypatch):
    want, ref_backend = _generate(demo_model_dir, monkeypatch, "reference")
    got, tri_backend = _generate(demo_model_dir, monkeypatch, "triton")
    assert ref_backend == "ember.kernels.reference" and tri_backend == "ember.kernels.attention"
    assert all(len(v) == 5 for v in want.values())
    assert got == want
