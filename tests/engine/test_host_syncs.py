"""A decode step reads the device exactly once (the sampled token IDs, with logprobs and constraint flags packed into
the same transfer) and uploads nothing through pageable memory: counted on a CPU by a shim over every call that
reads a tensor back to the host or uploads a Python list (greedy; sampling with penalties, top-k/p, min_p, seeds and
logit bias; a real llguidance grammar; logprobs)."""
from __future__ import annotations

import collections
import json

import pytest
import torch

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique",
         "masked_select", "bincount")


class SyncCounter:
    """Counts host reads (tensor -> Python/host) and list uploads (``torch.tensor``/``as_tensor`` with a device)
    while ``active``."""

    def __init__(self, monkeypatch) -> None:
        self.active = False
        self.calls: collections.Counter[str] = collections.Counter()
        for name in READS:
            if hasattr(torch.Tensor, name):
                monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
        for name in ("nonzero", "unique", "masked_select", "bincount"):
            monkeypatch.setattr(torch, name, self._wrap(getattr(torch, name), "torch." + name))
        to = torch.Tensor.to

        def counted_to(t, *args, **kw):
            target = kw.get("device", args[0] if args else None)
            if self.active and isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
                self.calls["to(cpu)"] += 1
            return to(t, *args, **kw)

        monkeypatch.setattr(torch.Tensor, "to", counted_to)
        for name in ("tensor", "as_tensor"):
            monkeypatch.setattr(torch, name, self._upload(getattr(torch, name), name))

    def _wrap(self, fn, name):
        def counted(*args, **kw):
            if self.active:
                self.calls[name] += 1
            return fn(*args, **kw)

        return counted

    def _upload(self, fn, name):
        def counted(*args, **kw):
            if self.active and kw.get("device") is not None:
                self.calls["upload:" + name] += 1
            return fn(*args, **kw)

        return counted

    def step(self, engine: Engine) -> tuple[list, collections.Counter]:
        self.calls.clear()
        self.active = True
        try:
            outs = engine.step()
        finally:
            self.active = False
        return outs, collections.Counter(self.calls)


@pytest.fixture(scope="module")
def grammar_backend(demo_model_dir):
    from ember.grammar.matcher import GrammarBackend

    from ember.engine.eos import end_of_turn_ids

    return GrammarBackend.from_pretrained(demo_model_dir, eos_ids=end_of_turn_ids(None, demo_model_dir))


def _constraint(backend):
    from ember.grammar.compiler import GrammarPlan

    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    grammar = json.dumps({"grammars": [{"json_schema": schema}]})
    return backend.constraint(GrammarPlan(grammar=grammar, budget=None))


CASES = {
    "greedy": [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 3,
    "sampling+penalties": [
        SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True,
                       repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
        SamplingParams(max_tokens=8, temperature=1.0, min_p=0.05, seed=3, ignore_eos=True,
                       logit_bias={5: 2.0, 7: -1.0}),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.5, min_tokens=6)],
    "grammar": [SamplingParams(max_tokens=8, temperature=0.7, seed=1),
                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)],
    "logprobs": [SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True),
                 SamplingParams(max_tokens=8, temperature=0.9, logprobs=0, ignore_eos=True, seed=2)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_decode_step_reads_the_device_once(case, demo_model_dir, grammar_backend, monkeypatch):
    monkeypatch.setenv("EMBER_ATTENTION", "torch")
    engine = Engine.from_pretrained(demo_model_dir, num_kv_blocks=64, max_num_seqs=8, device="cpu",
                                    dtype="float32", bitmask_filler=grammar_backend.bitmask_filler())
    for i, params in enumerate(CASES[case]):
        constraint = _constraint(grammar_backend) if case == "grammar" and i == 0 else None
        engine.add_request([10 + i, 11, 12, 13 + i], params, constraint=constraint)
    counter = SyncCounter(monkeypatch)
    engine.step()  # the prefill
    decode_steps = 0
    while engine.has_unfinished() and decode_steps < 4:
        outs, calls = counter.step(engine)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        assert sum(len(o.new_token_ids) for o in outs) == len(CASES[case]) - sum(
            o.finished and not o.new_token_ids for o in outs)
        assert calls == {"tolist": 1}, calls
        if case == "logprobs":
            assert all(o.logprobs and len(o.logprobs[0].top) == o_params.logprobs
                       for o, o_params in zip(outs, CASES[case]))
        decode_steps += 1
    assert decode_steps == 4


def test_a_speculative_step_reads_the_device_once(demo_model_dir, grammar_backend, monkeypatch):
    """Draft rows of greedy, seeded, penalised, logprob and grammar requests are sampled in the step's one read."""
    monkeypatch.setenv("EMBER_ATTENTION", "torch")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    engine = Engine.from_pretrained(demo_model_dir, num_kv_blocks=64, max_num_seqs=8, device="cpu", dtype="float32",
                                    bitmask_filler=grammar_backend.bitmask_filler(), speculative_config=spec)
    motif = [300, 301, 302, 303, 304]
    for i, params in enumerate([SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                               repetition_penalty=1.05, frequency_penalty=0.1),
                                SamplingParams(max_tokens=24, temperature=0.7, seed=3, logprobs=2, ignore_eos=True),
                                SamplingParams(max_tokens=24, temperature=0.0)]):
        engine.add_request(motif * 4 + [10 + i], params, constraint=_constraint(grammar_backend) if i == 3 else None)
    counter = SyncCounter(monkeypatch)
    engine.step()  # the prefill
    while engine.has_unfinished():
        drafted = engine.stats().spec_draft_tokens
        outs, calls = counter.step(engine)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        assert calls == {"tolist": 1}, (calls, engine.stats().spec_draft_tokens - drafted)
    assert engine.stats().spec_accepted_tokens > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch's sync debug mode)")
@pytest.mark.parametrize("case", list(CASES))
def test_a_cuda_decode_step_synchronises_once(case, demo_model_dir, grammar_backend):
    """The same workloads on a GPU, counted by torch itself: ``set_sync_debug_mode("warn")`` warns on every
    synchronising CUDA call (blocking copies, ``.item()``/``.tolist()``, ``nonzero``, stream/device syncs)."""
    import warnings

    engine = Engine.from_pretrained(demo_model_dir, num_kv_blocks=64, max_num_seqs=8, device="cuda",
                                    dtype="float32", bitmask_filler=grammar_backend.bitmask_filler())
    for i, params in enumerate(CASES[case]):
        constraint = _constraint(grammar_backend) if case == "grammar" and i == 0 else None
        engine.add_request([10 + i, 11, 12, 13 + i], params, constraint=constraint)
    engine.step()
    engine.step()  # staging buffers and penalty slots settle
    per_step = []
    for _ in range(3):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        per_step.append([str(w.message)[:120] for w in caught if "synchroniz" in str(w.message)])
    assert all(len(s) == 1 for s in per_step), per_step
