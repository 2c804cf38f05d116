"""Decode steps through `DecodeGraphRunner` (its eager padded mode on the CPU): greedy tokens equal the plain path
with the torch and the Triton (interpreter) attention backends, only decode-only steps take it, padding rows
(``seq_len 0``, slot ``-1``) write zeros and no KV, CUDA graphs are off on a CPU and with ``enforce_eager``, and the
server flags reach the engine."""
from __future__ import annotations


import pytest
import torch

from ember.engine.attention import TorchBackend
from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from ember.kernels import reference
from tests.conftest import save_tiny_qwen3, tensor_parallel_workers

# (prompt lengths, max_tokens, graph sizes captured up to): the requests arrive one per step and, once all are in,
# one ends per step, so the decode batches shrink by one down to 1. Torch: sizes 1, 2, 4, 6 (3 and 5 padded; 7 and 8
# above the largest, eager; 40 > the 32-token budget is a chunked prefill). Triton in the interpreter is slow, so a
# shorter run: sizes 1, 2, 4 (3 padded, 5 eager).
WORKLOADS = {
    "torch": ((5, 19, 3, 40, 11, 7, 26, 2), (24, 14, 18, 9, 18, 9, 11, 11), 6),
    "triton": ((5, 19, 3, 11, 7), (10, 7, 7, 4, 2), 4),
}



@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, demo_model_dir):
    return save_tiny_qwen3(tmp_path_factory.mktemp("graphs-qwen3"), demo_model_dir, seed=3)


def _engine(path, **kw) -> Engine:
    opts = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, num_kv_blocks=64, dtype="float32",
                device="cpu")
    return Engine.from_pretrained(path, **(opts | kw))


def _staggered(engine: Engine, lens: tuple[int, ...],
               max_tokens: tuple[int, ...]) -> tuple[list[list[int]], list[tuple[bool, int, bool]]]:
    """Greedy tokens of prompts arriving one per step, and per forward (decode-only, batch size, took the graph)."""
    runner = engine.runner
    steps: list[tuple[bool, int, bool]] = []
    execute = runner.execute

    def spy(out, carried=None):
        before = runner.num_graph_steps
        logits = execute(out, carried)
        decode = all(c.num_tokens == 1 and c.samples for c in out.chunks)
        steps.append((decode, len(out.chunks), runner.num_graph_steps > before))
        return logits

    runner.execute = spy
    g = torch.Generator().manual_seed(11)
    pending = [(torch.randint(0, 1270, (n,), generator=g).tolist(), m) for n, m in zip(lens, max_tokens)]
    out: dict[str, list[int]] = {}
    order: list[str] = []
    while pending or engine.has_unfinished():
        if pending:
            ids, m = pending.pop(0)
            order.append(engine.add_request(ids, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)))
            out[order[-1]] = []
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id].extend(o.new_token_ids)
    return [out[r] for r in order], steps


@pytest.mark.parametrize("backend,async_scheduling", [("torch", False), ("triton", False), ("torch", True)])
def test_graph_path_greedy_tokens_equal_the_plain_path(qwen3_dir, monkeypatch, backend, async_scheduling):
    """With asynchronous scheduling the graph's input rows take the previous step's tokens on the device."""
    monkeypatch.setenv("EMBER_ATTENTION", backend)
    lens, max_tokens, captured = WORKLOADS[backend]
    plain = _engine(qwen3_dir)
    assert plain.runner.graphs is None
    want, plain_steps = _staggered(plain, lens, max_tokens)
    assert not any(took for _, _, took in plain_steps)

    eng = _engine(qwen3_dir, async_scheduling=async_scheduling)
    eng.runner.capture_decode_graphs(captured, eng.max_model_len)
    sizes = eng.runner.graphs.sizes
    assert sizes == [1, 2, 4, 6][: len(sizes)] and sizes[-1] == captured
    got, steps = _staggered(eng, lens, max_tokens)
    assert [len(t) for t in got] == list(max_tokens)
    assert got == want
    for decode, n, took in steps:
        assert took == (decode and n <= captured), (decode, n, took)
    graphed = {n for _, n, took in steps if took}
    assert graphed == set(range(1, captured + 1))  # 3 (and 5) replay the next size up
    assert len(lens) in {n for d, n, _ in steps if d} and len(lens) > captured  # too big for a graph: eager
    assert any(not d for d, _, _ in steps)  # prefill and mixed steps ran eagerly
    assert eng.runner.num_graph_steps == sum(took for _, _, took in steps)
    assert eng.runner.num_eager_steps == len(steps) - eng.runner.num_graph_steps
    assert (eng.num_deferred_steps > len(steps) // 2) == async_scheduling


def test_graph_path_under_tensor_parallelism_matches_one_process(qwen3_dir, monkeypatch):
    """The driver broadcasts the capture, so both ranks route each decode step alike and meet the same
    all-reduces; under asynchronous scheduling the workers get the inputs the previous step sampled."""

    monkeypatch.setenv("EMBER_ATTENTION", "torch")
    lens, max_tokens, captured = WORKLOADS["triton"]
    want, _ = _staggered(_engine(qwen3_dir), lens, max_tokens)
    eng = _engine(qwen3_dir, tensor_parallel_size=2, async_scheduling=True)
    try:
        assert eng.cuda_graphs is False
        eng.runner.capture_decode_graphs(captured, eng.max_model_len)
        got, steps = _staggered(eng, lens, max_tokens)
    finally:
        eng.shutdown()
    assert got == want
    assert eng.runner.num_graph_steps == sum(took for _, _, took in steps) > 0
    assert eng.num_deferred_steps > 0
    assert not tensor_parallel_workers()


def _attention_inputs():
    g = torch.Generator().manual_seed(5)
    nb, bs, hkv, hq, d = 6, 16, 2, 8, 16
    k_cache = torch.randn(nb, bs, hkv, d, generator=g)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g)
    q = torch.randn(5, hq, d, generator=g)
    seq_lens = torch.tensor([21, 0, 9, 0, 0], dtype=torch.int32)  # rows 1, 3, 4 are graph padding
    table = torch.tensor([[1, 4], [0, 0], [2, 0], [0, 0], [0, 0]], dtype=torch.int32)
    return q, k_cache, v_cache, torch.arange(6, dtype=torch.int32), seq_lens, table


@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
def test_padding_rows_attend_to_nothing_and_write_no_kv(backend):
    from ember.kernels import attention as triton_attention

    be = {"torch": TorchBackend, "reference": reference, "triton": triton_attention}[backend]
    q, k_cache, v_cache, cu, seq_lens, table = _attention_inputs()
    out = torch.full_like(q, float("nan"))
    be.paged_attention(q, k_cache, v_cache, out, cu, seq_lens, table, 1, 21, 0.25)
    real = [0, 2]
    want = torch.full_like(q[real], float("nan"))
    reference.paged_attention(q[real], k_cache, v_cache, want, torch.arange(3, dtype=torch.int32),
                              seq_lens[real], table[real], 1, 21, 0.25)
    torch.testing.assert_close(out[real], want, rtol=1e-4, atol=1e-5)
    assert torch.equal(out[[1, 3, 4]], torch.zeros_like(out[[1, 3, 4]]))

    k_before, v_before = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    be.reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([37, -1, -1]))
    changed = (k_cache != k_before).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == [37]
    assert ((v_cache != v_before).any(-1).any(-1).flatten().nonzero().flatten().tolist()) == [37]
    assert torch.equal(k_cache.view(-1, 2, 16)[37], key[0]) and torch.equal(v_cache.view(-1, 2, 16)[37], value[0])


def test_no_cuda_graphs_on_cpu_or_with_enforce_eager(qwen3_dir):
    eng = _engine(qwen3_dir)
    assert eng.cuda_graphs is False and eng.runner.graphs is None
    assert eng.runner.graph_blocker() == "no CUDA device"
    eager = _engine(qwen3_dir, enforce_eager=True)
    assert eager.config.enforce_eager and eager.cuda_graphs is False and eager.runner.graphs is None


def test_serve_flags_reach_the_engine(demo_model_dir):
    import argparse

    from ember.server import cli
    from ember.server.app import load_runtime

    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    c = cli.serve_config(parser.parse_args(["serve", "--gpu-memory-utilization", "0.55", "--enforce-eager"]))
    assert (c.gpu_memory_utilization, c.enforce_eager) == (0.55, True)
    c = cli.serve_config(parser.parse_args(["serve"]))
    assert (c.gpu_memory_utilization, c.enforce_eager, c.async_scheduling) == (0.9, False, False)
    for bad in ("0", "1.5", "most"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--gpu-memory-utilization", bad])

    c = cli.serve_config(parser.parse_args([
        "serve", str(demo_model_dir), "--kv-cache-blocks", "8", "--max-num-seqs", "2",
        "--gpu-memory-utilization", "0.5", "--enforce-eager", "--async-scheduling", "--in-process"]))
    rt = load_runtime(c)
    try:
        config = rt.engine.engine.config
        assert (config.gpu_memory_utilization, config.enforce_eager, config.async_scheduling) == (0.5, True, True)
        assert rt.engine.engine.async_scheduling
    finally:
        rt.engine.shutdown()
