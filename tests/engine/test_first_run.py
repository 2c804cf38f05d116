"""Engine-side bugs a first GPU run would hit, checked on a CPU: captured decode graphs read static metadata buffers
that each step copies into (never rebinds), the padding rows of a padded decode batch write no KV anywhere, and a
chunked prefill that starts after a prefix-cache hit computes what an uncached run computes."""
from __future__ import annotations


import pytest
import torch

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from tests.conftest import save_tiny_qwen3


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, demo_model_dir):
    return save_tiny_qwen3(tmp_path_factory.mktemp("first-run-qwen3"), demo_model_dir, seed=4)


def _engine(path, **kw) -> Engine:
    opts = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, num_kv_blocks=48, dtype="float32",
                device="cpu")
    return Engine.from_pretrained(path, **(opts | kw))


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

STATIC = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table", "logits_indices")


def test_graph_steps_copy_into_the_captured_buffers(qwen3_dir, monkeypatch):
    monkeypatch.setenv("EMBER_ATTENTION", "torch")
    eng = _engine(qwen3_dir)
    eng.runner.capture_decode_graphs(4, eng.max_model_len)
    graphs = eng.runner.graphs
    ptrs = {name: getattr(graphs, name).data_ptr() for name in STATIC}
    seen: list[dict[str, int]] = []
    forward = graphs.forward

    def spy(ids, meta):
        seen.append({"input_ids": ids.data_ptr(), **{n: getattr(meta, n).data_ptr() for n in STATIC[1:]}})
        return forward(ids, meta)

    graphs.forward = spy
    for i, n in enumerate((5, 9, 3)):  # decode batches of 1, 2 and 3 (padded to 4) as the requests arrive
        eng.add_request(list(range(10 + i, 10 + i + n)), GREEDY)
        eng.step()
    while eng.has_unfinished():
        eng.step()
    assert len(seen) >= 5
    assert all(s == ptrs for s in seen)  # every replay reads the very tensors the graphs captured
    assert {name: getattr(graphs, name).data_ptr() for name in STATIC} == ptrs


def test_padding_rows_write_no_kv(qwen3_dir, monkeypatch):
    monkeypatch.setenv("EMBER_ATTENTION", "torch")
    eng = _engine(qwen3_dir)
    eng.runner.capture_decode_graphs(4, eng.max_model_len)
    for i in range(3):
        eng.add_request([20 + i, 30, 40 + i, 50], GREEDY)
    eng.step()  # the three prefills, eagerly
    before = [(k.clone(), v.clone()) for k, v in eng.runner.kv_caches]
    seqs = list(eng.scheduler.running)
    slots = sorted(s.block_ids[s.num_computed_tokens // 16] * 16 + s.num_computed_tokens % 16 for s in seqs)
    graph_steps = eng.runner.num_graph_steps
    eng.step()  # one decode step of 3 sequences, padded to the captured size 4
    assert eng.runner.num_graph_steps == graph_steps + 1 and eng.runner.graphs.padded_size(3) == 4
    for (k0, v0), (k1, v1) in zip(before, eng.runner.kv_caches):
        for old, new in ((k0, k1), (v0, v1)):
            changed = (old != new).reshape(-1, old.shape[2] * old.shape[3]).any(dim=1).nonzero().flatten()
            assert changed.tolist() == slots


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_after_a_prefix_hit_matches_an_uncached_run(qwen3_dir, monkeypatch, backend):
    monkeypatch.setenv("EMBER_ATTENTION", backend)
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(0, 1270, (36,), generator=g).tolist()
    first = shared + [7, 8]
    second = shared + torch.randint(0, 1270, (21,), generator=g).tolist()

    def run(**kw) -> tuple[list[list[int]], Engine, list[tuple[int, int]]]:
        eng = _engine(qwen3_dir, max_num_batched_tokens=16, **kw)
        chunks: list[tuple[int, int]] = []
        execute = eng.runner.execute

        def spy(out, *carried):
            chunks.extend((c.start, c.num_tokens) for c in out.chunks if c.num_tokens > 1)
            return execute(out, *carried)

        eng.runner.execute = spy
        toks = []
        for prompt in (first, second):  # one after the other: the second finds the first's full blocks cached
            rid = eng.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            got: list[int] = []
            while eng.has_unfinished():
                got += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
            toks.append(got)
        return toks, eng, chunks

    want, _, _ = run(enable_prefix_caching=False)
    got, eng, chunks = run()
    assert eng.kv.prefix_hits == 32  # two full 16-token blocks of the shared prefix
    assert (32, 16) in chunks and (48, 9) in chunks  # the second prompt's 25 new tokens, chunked after the hit
    assert got == want
