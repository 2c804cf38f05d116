"""Pooling requests (`SamplingParams.pooling`): the embedding of a prompt equals transformers' ``last_hidden_state``
pooled the same way (last position, mean, first position), through chunked prefill, a prefix-cache hit, requests
that generate in the same steps, a recompute after preemption and two tensor-parallel ranks."""
from __future__ import annotations

import pytest
import torch

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from tests.conftest import save_tiny_qwen3
from tests.engine.test_engine import _drain


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, demo_model_dir):
    path = save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-pool"), demo_model_dir, seed=5)
    from transformers import AutoModel

    return path, AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()


def _want(hf, prompt: list[int], kind: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf(torch.tensor([prompt])).last_hidden_state[0].float()
    return {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0]}[kind]


def _close(got: list[float], want: torch.Tensor) -> bool:
    g = torch.tensor(got)
    return g.shape == want.shape and bool(((g - want).norm() / want.norm()) < 1e-5)


def _prompts(seed: int, *lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1270, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_embeddings_equal_transformers_through_chunks_next_to_generation(tiny, kind):
    path, hf = tiny
    prompts = _prompts(1, 37, 5, 1, 23)
    engine = Engine.from_pretrained(str(path), block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    gen = engine.add_request(prompts[3], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    ids = [engine.add_request(p, SamplingParams(pooling=kind)) for p in prompts[:3]]
    outs = _drain(engine)
    for rid, prompt in zip(ids, prompts):
        (only,) = outs[rid]  # one output: the finished embedding, no token
        assert only.finished and only.finish_reason == "stop" and only.new_token_ids == []
        assert only.num_prompt_tokens == len(prompt)
        assert _close(only.embedding, _want(hf, prompt, kind))
    assert sum(len(o.new_token_ids) for o in outs[gen]) == 6  # the generating request was not disturbed
    assert all(o.embedding is None for o in outs[gen])
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_last_token_pooling_uses_the_prefix_cache_and_mean_does_not(tiny):
    path, hf = tiny
    (prompt,) = _prompts(2, 30)
    engine = Engine.from_pretrained(str(path), block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    _drain(engine)
    last = engine.add_request(prompt, SamplingParams(pooling="last"))
    mean = engine.add_request(prompt, SamplingParams(pooling="mean"))
    outs = _drain(engine)
    assert outs[last][-1].num_cached_tokens == 28 and _close(outs[last][-1].embedding, _want(hf, prompt, "last"))
    assert outs[mean][-1].num_cached_tokens == 0 and _close(outs[mean][-1].embedding, _want(hf, prompt, "mean"))


def test_a_preempted_mean_pool_starts_again(tiny):
    """Too few KV blocks for both: the older request's decode preempts the pooling one in the middle of its prompt;
    its recompute must not add the first pass's rows twice."""
    path, hf = tiny
    a, b = _prompts(3, 20, 40)
    engine = Engine.from_pretrained(str(path), block_size=4, num_kv_blocks=16, max_num_batched_tokens=8,
                                    max_num_seqs=2, enable_prefix_caching=False)
    engine.add_request(a, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    rid = engine.add_request(b, SamplingParams(pooling="mean"))
    outs = _drain(engine)
    assert engine.scheduler.num_preemptions > 0
    assert _close(outs[rid][-1].embedding, _want(hf, b, "mean"))


def test_a_prompt_may_fill_the_whole_context_and_a_bad_pooling_is_refused(tiny):
    path, hf = tiny
    engine = Engine.from_pretrained(str(path), block_size=4, max_model_len=24, max_num_seqs=2)
    (prompt,) = _prompts(4, 24)
    rid = engine.add_request(prompt, SamplingParams(pooling="last"))
    assert _close(_drain(engine)[rid][-1].embedding, _want(hf, prompt, "last"))
    with pytest.raises(ValueError, match="maximum model length"):
        engine.add_request(prompt, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="pooling must be one of"):
        engine.add_request(prompt[:4], SamplingParams(pooling="max"))
