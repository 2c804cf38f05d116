"""A tiny random Qwen3-Next (linear + gated attention, MoE with a shared expert): Ember's logits and greedy tokens
equal transformers', through batched decode, chunked prefill, preemption and state-slot reuse."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.moe.conftest import VOCAB, clear_margin, ember_logits, ember_model, hf_greedy, hf_logits, prompts, \
    run_greedy, save_hybrid


def tiny_next_config(**over):
    from transformers import Qwen3NextConfig

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
               decoder_sparse_step=1, mlp_only_layers=[2], linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2,
               partial_rotary_factor=0.5, max_position_embeddings=256, initializer_range=0.1,
               tie_word_embeddings=False)
    cfg.update(over)
    return Qwen3NextConfig(**cfg)


@pytest.fixture(scope="module")
def tiny_next_dir(tmp_path_factory, demo_model_dir) -> Path:
    """A random Qwen3-Next saved by `save_hybrid`."""
    from transformers import Qwen3NextForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen3-next")
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(tiny_next_config())
    return save_hybrid(model, path, demo_model_dir)


def _engine(path: Path, **kw):
    from ember.engine.engine import Engine

    return Engine.from_pretrained(path, dtype=torch.float32, device="cpu", **kw)


def test_layers_follow_the_config(tiny_next_dir):
    from ember.engine import loader
    from ember.engine.model_runner import kv_bytes_per_block

    cfg = loader.load_model_config(tiny_next_dir)
    assert cfg.linear_attention_layers == [0, 2] and cfg.num_kv_layers == 2
    model = ember_model(tiny_next_dir)
    assert [layer.linear_attn is not None for layer in model.model.layers] == [True, False, True, False]
    assert [layer.mlp.__class__.__name__ for layer in model.model.layers] == [
        "SharedExpertMoeBlock", "SharedExpertMoeBlock", "GatedMLP", "SharedExpertMoeBlock"]
    # only the two full-attention layers hold KV: 2 layers x K,V x 16 positions x 2 heads x 16 dims x 4 bytes
    assert kv_bytes_per_block(cfg, 16, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4
    # the real checkpoints' config.json has full_attention_interval but no layer_types
    raw = json.loads((tiny_next_dir / "config.json").read_text())
    raw.pop("layer_types")
    raw["full_attention_interval"] = 2
    from ember.engine.config import ModelConfig

    assert ModelConfig.from_dict(raw).linear_attention_layers == [0, 2]


def test_prefill_logits_match_transformers(tiny_next_dir):
    prompt = prompts(1, seed=5, min_len=70, max_len=70)[0]  # more than one 64-token block of the chunked rule
    want = hf_logits(tiny_next_dir, prompt)
    got = ember_logits(ember_model(tiny_next_dir), prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_greedy_equals_transformers_batched(tiny_next_dir):
    ps = prompts(8, seed=1, min_len=1, max_len=30)  # includes a one-token prompt: a fresh state on the decode path
    ps, expected = clear_margin(ps, hf_greedy(tiny_next_dir, ps), need=6)
    engine = _engine(tiny_next_dir, num_kv_blocks=64, max_num_seqs=16)
    assert run_greedy(engine, ps, 8) == expected
    assert engine.runner.graph_blocker() is not None


def test_greedy_equals_transformers_chunked_preempted_and_slots_reused(tiny_next_dir):
    """16-token steps chunk the prompts (the state carries across chunks); 14 four-token blocks force preemption
    (the state restarts with the recompute); two slots serve ten requests, the last ones one-token prompts whose
    first step decodes from a slot another request left state in."""
    from ember.engine.params import SamplingParams

    ps = prompts(7, seed=3, min_len=10, max_len=40) + [[5], [77], [901]]
    ps, expected = clear_margin(ps, hf_greedy(tiny_next_dir, ps), need=7)
    assert len(ps[-1]) == 1
    engine = _engine(tiny_next_dir, block_size=4, num_kv_blocks=14, max_num_seqs=2, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in ps]
    got: dict[str, list[int]] = {r: [] for r in ids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        engine.scheduler.check_integrity()
    assert [got[r] for r in ids] == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.last_num_tokens <= 16 < max(len(p) for p in ps)


def test_multi_token_prediction_weights_are_skipped(tiny_next_dir, tmp_path):
    with safe_open(str(tiny_next_dir / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    t["mtp.fc.weight"] = torch.randn(64, 128)
    t["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
    save_file(t, str(tmp_path / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_next_dir / name, tmp_path / name)
    prompt = prompts(1, seed=7, min_len=12, max_len=12)[0]
    assert torch.equal(ember_logits(ember_model(tmp_path), prompt), ember_logits(ember_model(tiny_next_dir), prompt))


def test_two_ranks_generate_transformers_tokens(tiny_next_dir):
    """Tensor parallelism 2 (gloo on CPU): each rank holds one of the two key heads (with its value heads, states and
    conv channels) and half of every attention, MLP, expert and shared-expert projection; a prefix hit restores
    the saved state on every rank."""
    from tests.engine.test_tensor_parallel import _assert_workers_exited

    ps = prompts(6, seed=10, min_len=1, max_len=24)
    ps, expected = clear_margin(ps, hf_greedy(tiny_next_dir, ps, new_tokens=6), need=4)
    engine = _engine(tiny_next_dir, num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=16,
                     tensor_parallel_size=2)
    workers = list(engine.runner.workers)
    try:
        layer = engine.runner.model.model.layers[0].linear_attn
        assert (layer.hk, layer.hv, layer.ssm_state.shape[1]) == (1, 2, 2)
        assert layer.conv_state.shape[1] == 16 + 16 + 16  # this rank's q, k and v channels
        assert run_greedy(engine, ps, 6) == expected
        longest = max(range(len(ps)), key=lambda i: len(ps[i]))
        restores = engine.scheduler.snapshots.num_restores
        assert run_greedy(engine, [ps[longest]], 6) == [expected[longest]]  # again: from the saved state
        assert engine.scheduler.snapshots.num_restores == restores + 1
    finally:
        engine.shutdown()
    _assert_workers_exited(workers)


def test_served_completion_equals_transformers_streamed_or_not(tiny_next_dir, tmp_path):
    """`ember serve` (engine in its own process) on the tiny Qwen3-Next: /v1/completions over token IDs gives
    transformers' greedy text, and the stream's pieces join to the same text."""
    import openai
    from tokenizers import Tokenizer

    from tests.server.processes import serving

    ps = prompts(6, seed=4, min_len=8, max_len=24)
    ps, expected = clear_margin(ps, hf_greedy(tiny_next_dir, ps), need=2)
    tok = Tokenizer.from_file(str(tiny_next_dir / "tokenizer.json"))
    with serving([str(tiny_next_dir), "--dtype", "float32", "--max-num-seqs", "4"], tmp_path / "serve.log") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        for prompt, want in zip(ps[:2], expected[:2]):
            kw = dict(model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
            text = client.completions.create(**kw).choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
            assert text == streamed == tok.decode(want), srv.log_tail()


def test_triton_backend_decodes_the_same_tokens(tiny_next_dir, monkeypatch):
    """With the Triton attention backend (interpreter on CPU) the linear layers decode through the in-place Triton
    kernel and the full-attention layers through the Triton paged attention: transformers' greedy tokens still."""
    ps = prompts(6, seed=6, min_len=1, max_len=20)
    ps, expected = clear_margin(ps, hf_greedy(tiny_next_dir, ps, new_tokens=5), need=4)
    monkeypatch.setenv("EMBER_ATTENTION", "triton")
    engine = _engine(tiny_next_dir, num_kv_blocks=32, max_num_seqs=8)
    from ember.engine.attention import is_triton_backend

    assert is_triton_backend(engine.runner.backend)
    assert run_greedy(engine, ps, 5) == expected


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_graph_path_equals_transformers(tiny_next_dir, monkeypatch, backend):
    """Decode steps through the graph runner's padded static buffers (eager on a CPU: the routing and padding a
    captured graph replays): padding rows write only the scratch state slot, so the tokens stay transformers'."""
    ps = prompts(5, seed=8, min_len=1, max_len=20)
    ps, expected = clear_margin(ps, hf_greedy(tiny_next_dir, ps, new_tokens=6), need=3)
    monkeypatch.setenv("EMBER_ATTENTION", backend)
    engine = _engine(tiny_next_dir, num_kv_blocks=32, max_num_seqs=8)
    runner = engine.runner
    runner.capture_decode_graphs(8, engine.max_model_len)  # sizes 1, 2, 4, 8: 3 or 5 sequences pad
    layer = next(m.linear_attn for m in runner.model.model.layers if m.linear_attn is not None)
    assert runner.state_pad_slot == 8 and layer.ssm_state.shape[0] == 8 + 1 + 8  # running, padding, snapshots
    assert run_greedy(engine, ps, 6) == expected
    assert runner.num_graph_steps >= 4
    assert layer.ssm_state[8].abs().sum() > 0  # the padding rows did write somewhere: the scratch slot


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_decode_step_reads_the_device_once(tiny_next_dir, monkeypatch, backend):
    """The recurrent metadata rides in the staged upload and the linear layers index their slots on the device:
    a decode step's only host read is the sampled IDs (MoE on its graph-safe Triton path)."""
    from ember.engine.params import SamplingParams
    from tests.engine.test_host_syncs import SyncCounter

    monkeypatch.setenv("EMBER_ATTENTION", backend)
    monkeypatch.setenv("EMBER_MOE", "triton")
    engine = _engine(tiny_next_dir, num_kv_blocks=32, max_num_seqs=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for p in ([7], [10, 11, 12], [20, 21, 22, 23, 24]):
        engine.add_request(p, params)
    counter = SyncCounter(monkeypatch)
    engine.step()  # the prefill (the one-token prompt already decodes from a fresh state)
    for _ in range(3):
        outs, calls = counter.step(engine)
        assert sum(len(o.new_token_ids) for o in outs) == 3
        assert calls == {"tolist": 1}, calls


def test_nvfp4_checkpoint_equals_its_dequantized_reference(tiny_next_dir, tmp_path):
    """`ember quantize-nvfp4` of the tiny Qwen3-Next: attention and MLP projections (the shared expert's gate/up
    fused at its own width) and the experts stay packed; greedy tokens equal transformers on the dequantized
    weights."""
    from ember.engine import quantize
    from ember.engine.nvfp4_loading import NVFP4Linear
    from tests.moe.conftest import ember_greedy, write_dequantized

    qdir = tmp_path / "nvfp4"
    assert quantize.main([str(tiny_next_dir), str(qdir)]) == 0
    model = ember_model(qdir)
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, NVFP4Linear)
    assert isinstance(model.model.layers[0].mlp.shared_expert.gate_up_proj, NVFP4Linear)
    assert model.model.layers[0].mlp.experts.quant13 is not None
    ref = write_dequantized(qdir, tmp_path / "dequantized")
    ps = prompts(6, seed=9, min_len=3, max_len=20)
    ps, expected = clear_margin(ps, hf_greedy(ref, ps), need=4)
    assert ember_greedy(qdir, ps) == expected


def test_fp8_checkpoint_keeps_the_linear_attention_output_packed(tiny_next_dir, tmp_path):
    """An FP8 Qwen3-Next (the released layout: every projection e4m3): ``out_proj`` of the linear attention becomes
    an FP8 linear, and the recurrent state keeps the model dtype (it was allocated in out_proj's weight dtype, e4m3,
    which broke the first step). Greedy tokens equal transformers' on the dequantized weights."""
    from ember.engine.fp8_loading import FP8Linear
    from tests.moe.conftest import ember_greedy
    from tests.moe.test_fp8_checkpoint import _write

    _write(tiny_next_dir, tmp_path / "fp8", tmp_path / "ref", (16, 16))
    model = ember_model(tmp_path / "fp8")
    assert isinstance(model.model.layers[0].linear_attn.out_proj, FP8Linear)
    ps = prompts(6, seed=9, min_len=3, max_len=20)
    ps, expected = clear_margin(ps, hf_greedy(tmp_path / "ref", ps), need=4)
    assert ember_greedy(tmp_path / "fp8", ps) == expected


def test_prefix_hits_restore_the_saved_state(tiny_next_dir):
    """Prefix caching: a prompt's state is saved at its last full-block boundary; later prompts sharing that prefix
    (the same prompt again, a longer one, a multi-turn follow-up) skip it, restoring the state, and still decode
    transformers' tokens. A prefix hit past the saved boundary counts only up to it."""
    base = prompts(1, seed=11, min_len=38, max_len=38)[0]
    follow = [base, base[:36] + [5, 6, 7, 8, 9, 10], base + [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    expected = [toks for toks, _ in hf_greedy(tiny_next_dir, [base] + follow, new_tokens=6)]
    engine = _engine(tiny_next_dir, block_size=4, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=16)
    assert engine.scheduler.snapshots is not None and engine.kv.enable_prefix_caching
    assert run_greedy(engine, [base], 6) == expected[:1]
    assert len(engine.scheduler.snapshots) == 2  # at 36, the prompt's last block boundary, and at 40 in the reply
    for prompt, want in zip(follow, expected[1:]):
        hits = engine.kv.prefix_hits
        assert run_greedy(engine, [prompt], 6) == [want]
        assert engine.kv.prefix_hits - hits == 36
    assert engine.scheduler.snapshots.num_restores == 3
    engine.scheduler.check_integrity()


def test_a_follow_up_turn_resumes_from_the_end_of_the_previous_reply(tiny_next_dir):
    """The state is also saved, rolling, at block boundaries inside a reply: a next turn that repeats prompt and
    reply skips up to the reply's last block boundary, not just the first prompt. Decode steps that save still
    replay the decode graph (the copy runs after it), and the tokens stay transformers'."""
    base = prompts(1, seed=16, min_len=30, max_len=30)[0]
    engine = _engine(tiny_next_dir, block_size=4, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=16)
    runner = engine.runner
    runner.capture_decode_graphs(2, engine.max_model_len)
    events = []
    graph_step, save = runner._graph_step, runner.model.save_states
    runner._graph_step = lambda meta: events.append("graph" if graph_step(meta) else "eager") or events[-1] == "graph"
    runner.model.save_states = lambda copies: events.append("save") or save(copies)
    reply = run_greedy(engine, [base], 11)[0]
    assert reply == hf_greedy(tiny_next_dir, [base], new_tokens=11)[0][0]
    assert ("graph", "save") in set(zip(events, events[1:]))  # a replayed decode step saved its state
    snaps = engine.scheduler.snapshots
    assert len(snaps) == 2  # the prompt's (at 28) and the reply's latest (at 40: 30 + 10 computed tokens)
    follow = base + reply + [5, 6, 7, 8, 9]
    hits, restores = engine.kv.prefix_hits, snaps.num_restores
    assert run_greedy(engine, [follow], 6) == [hf_greedy(tiny_next_dir, [follow], new_tokens=6)[0][0]]
    assert engine.kv.prefix_hits - hits == 40 and snaps.num_restores == restores + 1
    engine.scheduler.check_integrity()


def test_prefix_sharing_under_snapshot_eviction_and_preemption(tiny_next_dir):
    """Three conversations' prompts in a mixed order through 2 slots, 2 snapshots and a cache small enough to
    preempt: some hits restore a saved state, some find theirs replaced (the hit shrinks), identical prompts run in
    the same step (a pending save is not yet a hit). Every reply is still transformers'."""
    from ember.engine.params import SamplingParams

    bases = prompts(3, seed=12, min_len=18, max_len=26)
    ps = [bases[i % 3] + [100 + j] * (j % 4) for j, i in enumerate([0, 1, 0, 2, 1, 1, 2, 0, 0, 2])]
    expected = [toks for toks, _ in hf_greedy(tiny_next_dir, ps, new_tokens=5)]
    engine = _engine(tiny_next_dir, block_size=4, num_kv_blocks=12, max_num_seqs=2, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {}
    ids = []
    pending = list(ps)
    while pending or engine.has_unfinished():
        if pending:  # two new requests per step
            for p in pending[:2]:
                ids.append(engine.add_request(p, params))
                got[ids[-1]] = []
            pending = pending[2:]
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        engine.scheduler.check_integrity()
    snaps = engine.scheduler.snapshots
    assert snaps.num_restores > 0 and snaps.num_saves > snaps.count  # saved states were replaced
    assert engine.scheduler.num_preemptions > 0
    assert [got[r] for r in ids] == expected


def test_state_snapshots_setting_sizes_or_turns_off_hybrid_prefix_caching(tiny_next_dir):
    one = _engine(tiny_next_dir, num_kv_blocks=16, max_num_seqs=4, state_snapshots=1)
    layer = one.runner.model.model.layers[0].linear_attn
    assert one.scheduler.snapshots.count == 1 and layer.ssm_state.shape[0] == 4 + 1 + 1
    off = _engine(tiny_next_dir, num_kv_blocks=16, max_num_seqs=4, state_snapshots=0)
    assert off.scheduler.snapshots is None and not off.kv.enable_prefix_caching
    with pytest.raises(ValueError, match="state_snapshots must be >= 0"):
        _engine(tiny_next_dir, num_kv_blocks=16, state_snapshots=-1)


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_embeddings_equal_transformers_through_chunks_and_a_restored_state(tiny_next_dir, kind):
    """Pooling requests on the hybrid model: chunked prompts (linear-attention states carried between chunks) pool
    transformers' ``last_hidden_state``; a second last-token request for the same prompt starts from the saved
    state of its prefix (mean pooling computes the whole prompt)."""
    from transformers import AutoModel

    from ember.engine.params import SamplingParams

    hf = AutoModel.from_pretrained(tiny_next_dir, dtype=torch.float32).eval()
    prompt = prompts(1, seed=21, min_len=38, max_len=38)[0]
    with torch.no_grad():
        h = hf(torch.tensor([prompt])).last_hidden_state[0]
    want = h[-1] if kind == "last" else h.mean(dim=0)
    engine = _engine(tiny_next_dir, block_size=4, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=16)
    for round_ in range(2):
        hits = engine.kv.prefix_hits
        rid = engine.add_request(prompt, SamplingParams(pooling=kind))
        got = None
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    got = torch.tensor(o.embedding)
        assert ((got - want).norm() / want.norm()).item() < 1e-5, round_
    assert (engine.kv.prefix_hits - hits) == (36 if kind == "last" else 0)
    engine.scheduler.check_integrity()


def test_a_failed_step_saves_no_state_a_later_prefix_hit_restores(tiny_next_dir):
    """A forward that fails (a transient CUDA error) ends its request; the snapshot that step was to save was never
    written, so a later request sharing the prefix recomputes it instead of restoring garbage."""
    from ember.engine.params import SamplingParams

    base = prompts(1, seed=21, min_len=10, max_len=10)[0]
    want = hf_greedy(tiny_next_dir, [base + [5]], new_tokens=5)[0][0]
    engine = _engine(tiny_next_dir, block_size=4, num_kv_blocks=32, max_num_seqs=2, max_num_batched_tokens=16)
    execute, calls = engine.runner.execute, []

    def fails_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated transient forward failure")
        return execute(*args)

    engine.runner.execute = fails_once
    rid = engine.add_request(base, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    ends = []
    while engine.has_unfinished():
        ends += [o.finish_reason for o in engine.step() if o.request_id == rid and o.finished]
    assert ends == ["error"]
    assert run_greedy(engine, [base + [5]], 5) == [want]
    restores = engine.scheduler.snapshots.num_restores
    assert run_greedy(engine, [base + [5]], 5) == [want]
    assert engine.scheduler.snapshots.num_restores == restores + 1  # from the state the previous request saved
    engine.scheduler.check_integrity()
