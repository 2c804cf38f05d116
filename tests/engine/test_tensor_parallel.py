"""Tensor parallelism on the CPU: 2 processes (gloo, loopback) give the same greedy tokens as 1 process for tiny
random Qwen3 (with attention biases), Llama (with MLP biases, through AsyncEngine) and Qwen3-MoE checkpoints; the
workers exit on shutdown; a split that does not divide fails up front, naming the config field."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil

import pytest
import torch

from ember.engine.async_engine import AsyncEngine
from ember.engine.config import ConfigError
from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from tests.conftest import save_with_tokenizer, tensor_parallel_workers

NEW_TOKENS = 8
ENGINE_OPTIONS = dict(max_model_len=128, max_num_batched_tokens=32, num_kv_blocks=64)


def _save_dense(kind: str, path, tokenizer_dir):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  initializer_range=0.1)
    torch.manual_seed(1)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=False, attention_bias=True, **common))
        with torch.no_grad():  # transformers zero-initialises biases; random ones show a bias added N times
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                             layer.self_attn.o_proj):
                    proj.bias.normal_(0.0, 0.2)
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, mlp_bias=True, **common))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                    proj.bias.normal_(0.0, 0.2)
    return save_with_tokenizer(model, path, tokenizer_dir)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, demo_model_dir):
    return _save_dense("qwen3", tmp_path_factory.mktemp("tp-qwen3"), demo_model_dir)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, demo_model_dir):
    return _save_dense("llama", tmp_path_factory.mktemp("tp-llama"), demo_model_dir)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, demo_model_dir):
    from tests.moe.conftest import save_tiny_moe

    return save_tiny_moe(tmp_path_factory.mktemp("tp-moe"), demo_model_dir)


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    """One torch thread per rank (workers copy the driver's count); Qwen3-MoE registered as tests/moe does."""
    from ember.engine.models import MODEL_REGISTRY
    from ember.engine.models.qwen3_moe import Qwen3MoeForCausalLM

    monkeypatch.setitem(MODEL_REGISTRY, "Qwen3MoeForCausalLM", Qwen3MoeForCausalLM)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
    assert not tensor_parallel_workers(), "a tensor-parallel worker outlived its test"


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 1270, (n,), generator=g).tolist() for n in (3, 9, 17, 40, 58, 75)]


def _greedy(engine: Engine, prompts: list[list[int]], loras: list[str | None] | None = None) -> list[list[int]]:
    """Greedy tokens, one new request per step (mixed prefill and decode batches, long prompts chunked), the i-th
    under LoRA adapter ``loras[i]`` when given."""
    pending, ids, out = list(prompts), [], {}
    loras = list(loras or [None] * len(prompts))
    while pending or engine.has_unfinished():
        if pending:
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora=loras.pop(0))
            ids.append(engine.add_request(pending.pop(0), params))
            out[ids[-1]] = []
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id].extend(o.new_token_ids)
    return [out[r] for r in ids]


def _pooled(engine: Engine, prompt: list[int], kind: str = "mean") -> torch.Tensor:
    """The prompt's pooled embedding (a chunked pooling request; a classifier's logits)."""
    rid = engine.add_request(prompt, SamplingParams(pooling=kind))
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                assert o.error is None, o.error
                vec = torch.tensor(o.embedding)
    return vec


def _assert_workers_exited(workers) -> None:
    assert len(workers) == 1
    for p in workers:
        p.join(timeout=10)
        assert not p.is_alive() and p.exitcode == 0, f"{p.name} exit code {p.exitcode}"


@pytest.mark.parametrize("kind", ["qwen3", "moe"])
def test_two_ranks_generate_the_same_greedy_tokens(kind, request):
    path = request.getfixturevalue(f"{kind}_dir")
    prompts = _prompts()
    single = Engine.from_pretrained(path, **ENGINE_OPTIONS)
    expected, pooled = _greedy(single, prompts), _pooled(single, prompts[4])
    engine = Engine.from_pretrained(path, tensor_parallel_size=2, **ENGINE_OPTIONS)
    workers = list(engine.runner.workers)
    try:
        assert engine.runner.kv_caches[0][0].shape[2] == 1  # each rank caches 1 of the 2 KV heads
        assert _greedy(engine, prompts) == expected
        assert torch.allclose(_pooled(engine, prompts[4]), pooled, rtol=1e-4, atol=1e-5)
    finally:
        engine.shutdown()
    _assert_workers_exited(workers)


def test_two_ranks_speculate_as_one_process_decodes(qwen3_dir):
    """N-gram speculative chunks reach every rank through the broadcast forward: the greedy tokens are the plain
    single process's."""
    prompts = [p * 3 for p in _prompts()[:3]]  # repeated text, so drafts are found
    expected = _greedy(Engine.from_pretrained(qwen3_dir, **ENGINE_OPTIONS), prompts)
    engine = Engine.from_pretrained(qwen3_dir, tensor_parallel_size=2, **ENGINE_OPTIONS,
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    workers = list(engine.runner.workers)
    try:
        assert _greedy(engine, prompts) == expected
        assert engine.stats().spec_draft_tokens > 0
    finally:
        engine.shutdown()
    _assert_workers_exited(workers)


def test_async_engine_with_two_ranks_matches_and_stops_its_workers(llama_dir):
    prompts = _prompts()
    expected = _greedy(Engine.from_pretrained(llama_dir, **ENGINE_OPTIONS), prompts)
    ae = AsyncEngine.from_pretrained(str(llama_dir), tensor_parallel_size=2, **ENGINE_OPTIONS)
    workers = list(ae.engine.runner.workers)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    async def one(prompt):
        toks = []
        async for o in ae.generate(prompt, params):
            assert o.error is None, o.error
            toks.extend(o.new_token_ids)
        return toks

    async def all_at_once():
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        assert asyncio.run(all_at_once()) == expected
    finally:
        ae.shutdown()
    _assert_workers_exited(workers)


def test_an_in_process_engine_stops_when_a_worker_dies(qwen3_dir):
    """The engine loop in the server process (``--in-process``) with two ranks: a worker killed mid-request ends
    the request with an error naming the worker, and the engine is then dead with that reason (the server answers
    503 and exits 1). Before, /health stayed 200 and every later request failed on the broken group."""
    import time

    ae = AsyncEngine.from_pretrained(str(qwen3_dir), tensor_parallel_size=2, **ENGINE_OPTIONS)
    (worker,) = ae.engine.runner.workers
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def killed_midway():
        outputs = []
        async for o in ae.generate(_prompts()[0], params):
            if not outputs:
                worker.kill()
            outputs.append(o)
        return outputs

    reason = "tensor-parallel worker ember-tp-worker-1 died unexpectedly (exit code -9); the engine stops"
    try:
        last = asyncio.run(killed_midway())[-1]
        assert (last.finish_reason, last.error) == ("error", reason)
        deadline = time.monotonic() + 10
        while ae.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not ae.is_alive() and ae.death_reason == reason
    finally:
        ae.shutdown()
    assert not worker.is_alive()


def _all_at_once(engine: Engine, prompts: list[list[int]], counter=None) -> tuple[list[list[int]], list[dict]]:
    """Greedy tokens of ``prompts`` added together, and the host reads of each step (with a ``SyncCounter``)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    out, reads = {r: [] for r in ids}, []
    while engine.has_unfinished():
        outs, calls = counter.step(engine) if counter is not None else (engine.step(), {})
        for o in outs:
            assert o.error is None, o.error
            out[o.request_id].extend(o.new_token_ids)
        reads.append(dict(calls))
    return [out[r] for r in ids], reads


def test_overlapped_steps_under_tensor_parallelism_read_the_device_once(qwen3_dir, monkeypatch):
    """With asynchronous scheduling the driver sends each step's host buffers, not device tensors, and the tokens
    of the step in flight reach the worker by a device broadcast: every step reads the device at most once (its
    sampled tokens), as in one process, and the tokens are one process's."""
    from ember.engine.distributed import TensorParallel
    from tests.engine.test_host_syncs import SyncCounter

    prompts = _prompts()[:4]
    expected, _ = _all_at_once(Engine.from_pretrained(qwen3_dir, **ENGINE_OPTIONS), prompts)
    engine = Engine.from_pretrained(qwen3_dir, tensor_parallel_size=2, async_scheduling=True, **ENGINE_OPTIONS)
    workers = list(engine.runner.workers)
    counter = SyncCounter(monkeypatch)
    broadcast = TensorParallel.broadcast

    def unobserved(self, obj):  # pickling a command over the gloo control group touches only host tensors
        active, counter.active = counter.active, False
        try:
            return broadcast(self, obj)
        finally:
            counter.active = active

    monkeypatch.setattr(TensorParallel, "broadcast", unobserved)
    try:
        got, reads = _all_at_once(engine, prompts, counter)
    finally:
        engine.shutdown()
    _assert_workers_exited(workers)
    assert got == expected
    assert engine.num_deferred_steps >= NEW_TOKENS
    decode = reads[reads.index({"tolist": 1}):]  # the CPU attention backend reads back in prefill steps
    assert all(r in ({}, {"tolist": 1}) for r in decode), reads
    assert sum(r == {"tolist": 1} for r in decode) >= NEW_TOKENS


@pytest.mark.parametrize("field,change,tp", [
    ("num_key_value_heads", {"num_key_value_heads": 1}, 2),
    ("num_attention_heads", {}, 3),
])
def test_a_split_that_does_not_divide_fails_naming_the_field(qwen3_dir, tmp_path, field, change, tp):
    bad = tmp_path / "bad"
    shutil.copytree(qwen3_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(change)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"tensor_parallel_size {tp} does not divide {field}"):
        Engine.from_pretrained(bad, tensor_parallel_size=tp, **ENGINE_OPTIONS)
    assert not tensor_parallel_workers()


def test_tensor_parallel_size_must_be_positive(qwen3_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        Engine.from_pretrained(qwen3_dir, tensor_parallel_size=0, **ENGINE_OPTIONS)



def _stack(tensors: dict, prefix: str, proj: str, experts: int) -> torch.Tensor:
    return torch.stack([tensors[f"{prefix}{e}.{proj}.weight"] for e in range(experts)])


def test_fused_expert_keys_shard_like_per_expert_keys(moe_dir, tmp_path):
    """A checkpoint with transformers 5's fused expert stacks gives each rank the same expert slices as the
    per-expert form save_pretrained writes (gate and up halves split separately)."""
    from safetensors.torch import load_file, save_file

    from ember.engine.distributed import TensorParallel, iter_shard_weights

    experts = 8
    tensors = load_file(str(moe_dir / "model.safetensors"))
    fused = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
    for name in tensors:
        if name.endswith(".experts.0.gate_proj.weight"):
            prefix = name[: -len("0.gate_proj.weight")]
            fused[prefix + "gate_up_proj"] = torch.cat([_stack(tensors, prefix, "gate_proj", experts),
                                                        _stack(tensors, prefix, "up_proj", experts)], dim=1)
            fused[prefix + "down_proj"] = _stack(tensors, prefix, "down_proj", experts)
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    save_file(fused, str(fused_dir / "model.safetensors"))
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        per_expert = dict(iter_shard_weights(moe_dir, tp))
        checked = 0
        for name, t in iter_shard_weights(fused_dir, tp):
            prefix = name.rsplit(".", 1)[0] + "."
            if name.endswith("experts.gate_up_proj"):
                want = torch.cat([_stack(per_expert, prefix, "gate_proj", experts),
                                  _stack(per_expert, prefix, "up_proj", experts)], dim=1)
            elif name.endswith("experts.down_proj"):
                want = _stack(per_expert, prefix, "down_proj", experts)
            else:
                continue
            assert t.shape == want.shape and torch.equal(t, want), name
            checked += 1
        assert checked == 4  # two sparse layers, two stacks each


def test_two_ranks_load_a_per_tensor_fp8_qwen3_next_as_one_process(demo_model_dir, tmp_path):
    """A per-tensor FP8 Qwen3-Next (compressed-tensors ``tensor``: scalar ``weight_scale`` and ``input_scale`` on
    every projection, the linear attention's included) splits over 2 ranks and gives 1 process's greedy tokens (the
    linear attention's scalars were split as its projections, failing at start)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3NextForCausalLM

    from ember.kernels import fp8_block
    from tests.moe.conftest import assert_two_ranks_match_one, compressed_tensors_fp8, prompts, save_hybrid
    from tests.moe.test_qwen3_next import tiny_next_config

    torch.manual_seed(0)
    src = save_hybrid(Qwen3NextForCausalLM(tiny_next_config(num_hidden_layers=2, mlp_only_layers=[])),
                      tmp_path / "src", demo_model_dir)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        module = name[: -len(".weight")]
        if ".layers." in name and name.endswith(".weight") and "proj" in module.rsplit(".", 1)[1] and t.dim() == 2:
            q = fp8_block.quantize(t, (fp8_block.CHANNEL, fp8_block.CHANNEL))
            tensors |= {name: q.weight, f"{module}.weight_scale": q.scale.reshape(1),
                        f"{module}.input_scale": torch.ones(1)}
        else:
            tensors[name] = t
    assert "model.layers.0.linear_attn.in_proj_ba.input_scale" in tensors
    fp8 = tmp_path / "fp8"
    shutil.copytree(src, fp8)
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps(cfg | {"quantization_config": compressed_tensors_fp8("tensor")}))
    assert_two_ranks_match_one(fp8, prompts(2, seed=7, min_len=5, max_len=20), 4)


@pytest.mark.parametrize("head", ["checkpoint", "from_tokens"])
def test_two_ranks_classify_as_one_process(demo_model_dir, tmp_path, head):
    """Both a checkpoint's own score head and one built from LM-head rows (``--hf-overrides``'s
    ``classifier_from_token``, read from the files by every rank) are replicated, not split."""
    from tests.conftest import save_tiny_qwen3

    if head == "checkpoint":
        path = save_tiny_qwen3(tmp_path / "seq-cls", demo_model_dir, seed=3, head="ForSequenceClassification",
                               num_labels=3, pad_token_id=0)
        options = dict(ENGINE_OPTIONS)
    else:
        path = save_tiny_qwen3(tmp_path / "lm", demo_model_dir, seed=3)
        from transformers import AutoTokenizer

        tokens = AutoTokenizer.from_pretrained(path).convert_ids_to_tokens([11, 500, 900])
        options = dict(ENGINE_OPTIONS, hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                                     "classifier_from_token": tokens, "method": "no_post_processing"})
    prompt = _prompts()[4]
    want = _pooled(Engine.from_pretrained(path, **options), prompt, "last")
    engine = Engine.from_pretrained(path, tensor_parallel_size=2, **options)
    workers = list(engine.runner.workers)
    try:
        got = _pooled(engine, prompt, "last")
        assert got.shape == (3,) and torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    finally:
        engine.shutdown()
    _assert_workers_exited(workers)


def test_two_ranks_serve_lora_adapters_as_one_process(qwen3_dir, tmp_path):
    """Each rank holds its share of every adapter (lora_B rows of the column-parallel projections, lora_A columns
    of o_proj / down_proj), loaded at start or at runtime, and the batch's rows per adapter reach every rank."""
    from tests.lora_adapters import ALL, ATTENTION, save_adapter

    save_adapter(tmp_path / "all", seed=1, rank=8, alpha=16, modules=ALL)
    save_adapter(tmp_path / "attn", seed=2, rank=4, alpha=8, modules=ATTENTION)
    prompts = _prompts()
    loras = ["all", None, "attn", "all", "attn", None]

    def run(engine: Engine) -> list[list[int]]:
        engine.load_lora("attn", str(tmp_path / "attn"))  # at runtime: reaches every rank
        return _greedy(engine, prompts, loras)

    options = dict(ENGINE_OPTIONS, lora_modules=(("all", str(tmp_path / "all")),), max_loras=2)
    expected = run(Engine.from_pretrained(qwen3_dir, **options))
    assert expected[0] != _greedy(Engine.from_pretrained(qwen3_dir, **ENGINE_OPTIONS), prompts[:1])[0]
    engine = Engine.from_pretrained(qwen3_dir, tensor_parallel_size=2, **options)
    workers = list(engine.runner.workers)
    try:
        assert run(engine) == expected
    finally:
        engine.shutdown()
    _assert_workers_exited(workers)


def test_a_dead_worker_ends_the_requests_and_stops_the_engine_core(qwen3_dir, capfd):
    """A worker that fails (here on a command it has no method for) logs its traceback and exits; the engine core
    then reports it as fatal, ends the request in flight with an error naming that worker and its exit code, and
    stops, so the front end answers 503 and exits instead of failing every later request on the broken group."""
    import threading

    import zmq

    from ember.engine import core_process, wire
    from ember.engine.args import EngineArgs

    class Events:
        def __init__(self) -> None:
            self.sent: list[list] = []

        def send(self, data: bytes) -> None:
            self.sent.append(wire.unpack(data))

    args = EngineArgs(tensor_parallel_size=2, cpu_threads=1, max_model_len=128, max_num_batched_tokens=32,
                      kv_cache_blocks=64)
    events = Events()
    core = core_process._Core(str(qwen3_dir), dataclasses.asdict(args), None, events)
    (worker,) = core.engine.runner.workers
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    front.bind("inproc://tp-commands")
    back.connect("inproc://tp-commands")
    loop = threading.Thread(target=core.run, args=(back, os.getppid()))
    try:
        core.engine.runner._send("no_such_method")
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        front.send(wire.pack(["add", "r1", _prompts()[0], wire.encode_params(params), None]))
        loop.start()
        loop.join(timeout=30)
        stopped = not loop.is_alive()
        if not stopped:
            front.send(wire.pack(["shutdown"]))
            loop.join()
    finally:
        core.close()
        front.close(linger=0)
        back.close(linger=0)
        ctx.term()
    assert stopped, "the engine core went on stepping with a dead tensor-parallel worker"
    reason = "tensor-parallel worker ember-tp-worker-1 died unexpectedly (exit code 1)"
    fatal = next(i for i, m in enumerate(events.sent) if m[0] == "fatal")  # first: the front end is unhealthy first
    assert events.sent[fatal] == ["fatal", f"{reason}; the engine stops"]
    assert [m[0] for m in events.sent[fatal + 1:]] == ["step"]
    (ended,) = [wire.decode_output(o) for m in events.sent if m[0] == "step" for o in m[1]]
    assert (ended.request_id, ended.finish_reason, ended.error) == ("r1", "error", f"{reason}; the engine stops")
    err = capfd.readouterr().err
    assert "tensor-parallel rank 1 failed in no_such_method; the worker exits" in err and "AttributeError" in err
    assert not worker.is_alive()


def test_qwen3_5_linear_attention_per_tensor_scales_are_replicated():
    """Qwen3.5's linear-attention projections split by rows, but their per-tensor FP8 scales (scalars) cover any
    slice: each rank gets them whole (a scalar ``input_scale`` failed to split at start)."""
    from ember.engine.models.qwen3_5 import Qwen3_5ForCausalLM

    for proj in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        for leaf in ("input_scale", "weight_scale_2"):
            rule = Qwen3_5ForCausalLM.tp_split_rule(f"model.layers.0.linear_attn.{proj}.{leaf}", None)
            assert rule == ("replicate", -1), (proj, leaf)
    assert Qwen3_5ForCausalLM.tp_split_rule("model.layers.0.linear_attn.in_proj_z.weight", None) == ("shard", 0)


def test_a_worker_killed_before_joining_is_reported_as_killed():
    """A worker killed during start-up (the OOM killer, an operator): the error says so, instead of pointing at an
    error "printed above" and a missing main guard, which is what a worker that exits by itself means."""
    import multiprocessing as mp
    import signal
    import time

    import torch.distributed as dist

    from ember.engine.distributed import _wait_for_workers

    worker = mp.get_context("spawn").Process(target=time.sleep, args=(60,), name="ember-tp-worker-1")
    worker.start()
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    with pytest.raises(RuntimeError, match="ember-tp-worker-1 was killed by signal 9 before joining the group"):
        _wait_for_workers(dist.HashStore(), [worker])
