"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token after the first gets the log-probability
its prefix gives it, equal to transformers' log-softmax over the same model, through chunked prefill, a prompt the
prefix cache already holds, and a recompute after preemption."""
from __future__ import annotations

import pytest
import torch

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from tests.conftest import save_tiny_qwen3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, demo_model_dir):
    path = save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-plp"), demo_model_dir, seed=4)
    from transformers import AutoModelForCausalLM

    return path, AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def _hf(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _run(engine: Engine, prompts: list[list[int]], top: int) -> dict[str, list]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                prompt_logprobs=top)) for p in prompts]
    got: dict[str, list] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                assert o.request_id not in got  # sent once
                got[o.request_id] = o.prompt_logprobs
                cached[o.request_id] = o.num_cached_tokens
    return {"lps": [got[i] for i in ids], "cached": [cached[i] for i in ids]}


def _check(lps, logp: torch.Tensor, prompt: list[int], top: int) -> None:
    assert [lp.token_id for lp in lps] == prompt[1:]
    want = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(torch.tensor([lp.logprob for lp in lps]), want, atol=1e-4)
    for p, lp in enumerate(lps):
        assert [t for t, _ in lp.top] == logp[p].topk(top).indices.tolist()


def test_prompt_logprobs_equal_transformers_through_chunks_and_a_cached_prefix(tiny):
    path, hf = tiny
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1270, (n,), generator=g).tolist() for n in (37, 5, 1)]
    engine = Engine.from_pretrained(str(path), block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    first = _run(engine, prompts, top=3)
    for lps, prompt in zip(first["lps"][:2], prompts[:2]):
        _check(lps, _hf(hf, prompt), prompt, 3)
    assert first["lps"][2] == []  # a one-token prompt has nothing to score
    again = _run(engine, [prompts[0]], top=3)  # its blocks are in the prefix cache now: computed anyway
    assert again["cached"] == [0]
    _check(again["lps"][0], _hf(hf, prompts[0]), prompts[0], 3)
    plain = engine.add_request(prompts[0], SamplingParams(max_tokens=1, temperature=0.0))
    hits = [o.num_cached_tokens for o in _drain(engine) if o.request_id == plain]
    assert hits[-1] > 0  # without prompt logprobs the same prompt hits the cache


def _drain(engine: Engine):
    out = []
    while engine.has_unfinished():
        out += engine.step()
    return out


def test_a_preempted_prompt_is_scored_once(tiny):
    """Too few KV blocks for both: the older request's decode preempts the younger one in the middle of its prompt,
    which is recomputed; each prompt token still gets exactly its one score."""
    path, hf = tiny
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1270, (n,), generator=g).tolist() for n in (20, 40)]
    engine = Engine.from_pretrained(str(path), block_size=4, num_kv_blocks=16, max_num_batched_tokens=8,
                                    max_num_seqs=2, enable_prefix_caching=False)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, prompt_logprobs=0) for n in (40, 2)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    got, preempted_mid_prompt = {}, False
    while engine.has_unfinished():
        before = engine.stats().num_preemptions
        for o in engine.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] = o.prompt_logprobs
        if engine.stats().num_preemptions > before and ids[1] not in got:
            preempted_mid_prompt = True
    assert preempted_mid_prompt
    for rid, prompt in zip(ids, prompts):
        lps = got[rid]
        assert len(lps) == len(prompt) - 1 and all(lp.top == [] for lp in lps)
        want = _hf(hf, prompt)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor([lp.logprob for lp in lps]), want, atol=1e-4)


def test_a_long_scored_prompt_builds_logits_of_at_most_max_num_seqs_rows(tiny):
    """One 60-token prefill chunk scores 59 tokens, yet no logits tensor has more rows than the `max_num_seqs` the
    memory profile counts (a GPU sized close to its limit would otherwise run out of memory)."""
    path, hf = tiny
    prompt = torch.randint(0, 1270, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = Engine.from_pretrained(str(path), block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    model = engine.runner.model
    rows: list[int] = []
    plain = model.compute_logits

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return plain(hidden)

    model.compute_logits = counted
    got = _run(engine, [prompt], top=2)
    _check(got["lps"][0], _hf(hf, prompt), prompt, 2)
    assert max(rows) <= 4 and sum(rows) >= 59
