"""LoRA adapters (PEFT folders) served beside the base model: a request under an adapter computes what the
checkpoint with that adapter merged into its weights computes, in the same batches as base-model requests and other
adapters, and its KV is never reused by a request under another adapter."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.engine.config import ConfigError
from ember.engine.engine import Engine
from ember.engine.client import UnknownAdapterError
from ember.engine.params import SamplingParams
from tests.conftest import save_tiny_qwen3, save_with_tokenizer
from tests.lora_adapters import ALL, ATTENTION, merged_copy, save_adapter

OPTIONS = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=64, dtype="float32",
               device="cpu")


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, demo_model_dir):
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_qwen3(root / "base", demo_model_dir, seed=21)
    sql = save_adapter(root / "sql", seed=1, rank=8, alpha=16, modules=ALL)
    chat = save_adapter(root / "chat", seed=2, rank=4, alpha=4, modules=ATTENTION, rslora=True)
    return {"base": base, "sql": root / "sql", "chat": root / "chat",
            "merged_sql": merged_copy(base, sql, 16 / 8, root / "merged-sql"),
            "merged_chat": merged_copy(base, chat, 4 / 2, root / "merged-chat")}  # rsLoRA: alpha / sqrt(r)


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None
            out[o.request_id] += o.new_token_ids
    return out


def _greedy(lora: str | None = None, n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, lora=lora)


def test_adapters_and_the_base_model_share_batches_and_each_decodes_its_merged_model(lora_setup):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 1270, (n,), generator=g).tolist() for n in (23, 5, 17)]
    engine = Engine.from_pretrained(lora_setup["base"], lora_modules=(("sql", str(lora_setup["sql"])),
                                                                      ("chat", str(lora_setup["chat"]))), **OPTIONS)
    mixed = _run(engine, {f"{who}-{i}": (p, _greedy(None if who == "base" else who))
                          for i, p in enumerate(prompts) for who in ("base", "sql", "chat")})
    for who, ref in (("base", lora_setup["base"]), ("sql", lora_setup["merged_sql"]),
                     ("chat", lora_setup["merged_chat"])):
        want = _run(Engine.from_pretrained(ref, **OPTIONS), {str(i): (p, _greedy()) for i, p in enumerate(prompts)})
        assert [mixed[f"{who}-{i}"] for i in range(3)] == [want[str(i)] for i in range(3)], who
    assert mixed["sql-0"] != mixed["base-0"] and mixed["chat-0"] != mixed["base-0"]


def test_an_adapters_logprobs_equal_transformers_on_the_merged_checkpoint(lora_setup):
    from transformers import AutoModelForCausalLM

    prompt = list(range(30, 60))
    engine = Engine.from_pretrained(lora_setup["base"], lora_modules=(("sql", str(lora_setup["sql"])),), **OPTIONS)
    engine.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0, lora="sql"), request_id="s")
    scored = []
    while engine.has_unfinished():
        for o in engine.step():
            scored += o.prompt_logprobs or []
    hf = AutoModelForCausalLM.from_pretrained(lora_setup["merged_sql"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    want = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), prompt[1:]]
    assert float((torch.tensor([t.logprob for t in scored]) - want).abs().max()) < 1e-4


def test_kv_cached_under_one_adapter_is_not_reused_by_another(lora_setup):
    engine = Engine.from_pretrained(lora_setup["base"], lora_modules=(("sql", str(lora_setup["sql"])),), **OPTIONS)
    prompt = list(range(100, 150))  # three full blocks
    cached = {}
    for rid, lora in (("a", "sql"), ("b", None), ("c", "sql"), ("d", None)):
        engine.add_request(prompt, _greedy(lora, 1), request_id=rid)
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    cached[rid] = o.num_cached_tokens
    assert cached == {"a": 0, "b": 0, "c": 48, "d": 48}
    with pytest.raises(UnknownAdapterError, match="unknown LoRA adapter 'nope'.*loaded: sql"):
        engine.add_request([1, 2], _greedy("nope"))
    with pytest.raises(ValueError, match="serves no adapters"):
        Engine.from_pretrained(lora_setup["base"], **OPTIONS).add_request([1, 2], _greedy("sql"))


@pytest.mark.parametrize("change, message", [
    ({"r": 32}, "rank 32 exceeds --max-lora-rank 16"),
    ({"use_dora": True}, "DoRA is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias 'all' is not supported"),
    ({"alora_invocation_tokens": [20, 23]}, "activated LoRA"),  # it was served on every token: other logits
])
def test_an_adapter_ember_cannot_serve_fails_naming_the_field(lora_setup, tmp_path, change, message):
    folder = tmp_path / "bad"
    save_adapter(folder, seed=4, rank=4, alpha=8, modules=ATTENTION, **change)
    with pytest.raises(ConfigError, match=message):
        Engine.from_pretrained(lora_setup["base"], lora_modules=(("bad", str(folder)),), **OPTIONS)


def test_an_adapter_config_without_lora_alpha_scales_as_peft_reads_it(lora_setup, tmp_path):
    """peft reads a missing ``lora_alpha`` as its default, 8; Ember took the rank (scaling 1 instead of 2 here)."""
    import json

    folder = tmp_path / "no-alpha"
    save_adapter(folder, seed=2, rank=4, alpha=8, modules=ATTENTION)  # the chat adapter's tensors, unscaled by rsLoRA
    config = json.loads((folder / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    prompt = list(range(60, 100))
    got = _run(Engine.from_pretrained(lora_setup["base"], lora_modules=(("x", str(folder)),), **OPTIONS),
               {"x": (prompt, _greedy("x"))})["x"]
    want = _run(Engine.from_pretrained(lora_setup["merged_chat"], **OPTIONS), {"x": (prompt, _greedy())})["x"]
    assert got == want  # 8 / 4, the merged copy's scaling


def test_the_refusal_names_what_this_model_takes():
    """A hybrid model's own attention layers (Qwen3-Next's gated attention) take no adapter: the refusal does not
    offer q/k/v/o there."""
    from ember.engine.lora import _target_kinds

    shared = {"model.layers.3.mlp.shared_expert.gate_up_proj": None, "model.layers.3.mlp.shared_expert.down_proj": None}
    assert _target_kinds(shared) == "MLP gate/up, MLP down projections only"
    assert _target_kinds({}) == "no projection"


def test_an_adapter_for_a_module_ember_does_not_adapt_is_refused_by_name(lora_setup, tmp_path):
    folder = tmp_path / "embed"
    save_adapter(folder, seed=5, rank=4, alpha=8, modules=ATTENTION)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.randn(4, 64)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.randn(1280, 4)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match=r"targets lm_head, which Ember does not apply LoRA to \(on this model: "
                                          r"attention q/k/v, attention o, MLP gate/up, MLP down projections only\)"):
        Engine.from_pretrained(lora_setup["base"], lora_modules=(("embed", str(folder)),), **OPTIONS)
    import multiprocessing

    with pytest.raises(ConfigError, match="targets lm_head"):  # under tensor parallelism: rank 0 refuses it first
        Engine.from_pretrained(lora_setup["base"], lora_modules=(("x", str(folder)),), tensor_parallel_size=2,
                               **OPTIONS)
    workers = [p for p in multiprocessing.active_children() if p.name.startswith("ember-tp-worker")]
    for p in workers:
        p.join(timeout=10)
    assert not any(p.is_alive() for p in workers)  # and the worker is stopped


def test_adapters_load_and_unload_between_steps(lora_setup):
    """A freed slot is refilled whole: an attention-only adapter loaded where an all-projection one was decodes
    its own merged model, not a mix of the two."""
    engine = Engine.from_pretrained(lora_setup["base"], enable_lora=True, max_loras=1, **OPTIONS)
    prompt = list(range(60, 100))
    engine.load_lora("sql", str(lora_setup["sql"]))
    with pytest.raises(ConfigError, match="all 1 adapter slots are in use"):
        engine.load_lora("chat", str(lora_setup["chat"]))
    engine.add_request(prompt, _greedy("sql", 2), request_id="running")
    with pytest.raises(ValueError, match="in use by 1 unfinished request"):
        engine.unload_lora("sql")
    while engine.has_unfinished():
        engine.step()
    engine.unload_lora("sql")
    engine.load_lora("chat", str(lora_setup["chat"]))
    got = _run(engine, {"c": (prompt, _greedy("chat"))})["c"]
    want = _run(Engine.from_pretrained(lora_setup["merged_chat"], **OPTIONS), {"c": (prompt, _greedy())})["c"]
    assert got == want
    engine.unload_lora("chat")
    engine.load_lora("chat", str(lora_setup["sql"]))  # the same name, other weights: no stale KV reused
    engine.add_request(prompt, _greedy("chat", 1), request_id="again")
    cached = []
    while engine.has_unfinished():
        cached += [o.num_cached_tokens for o in engine.step() if o.finished]
    assert cached == [0]
    with pytest.raises(ValueError, match="started without LoRA support"):
        Engine.from_pretrained(lora_setup["base"], **OPTIONS).load_lora("sql", str(lora_setup["sql"]))


def test_the_in_process_engine_client_loads_and_unloads_adapters(lora_setup):
    import asyncio

    from ember.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_pretrained(lora_setup["base"], enable_lora=True, max_loras=2, **OPTIONS)
    path = str(lora_setup["sql"])

    async def go() -> None:
        await engine.update_lora("sql", path)
        assert engine.model_info.lora_adapters == (("sql", path),)
        await engine.update_lora("sql", path)  # a second load replaces it (the HTTP route asks for load_inplace)
        assert engine.model_info.lora_adapters == (("sql", path),)
        with pytest.raises(ValueError, match="not a directory"):
            await engine.update_lora("sql", path + "-missing")
        assert engine.model_info.lora_adapters == (("sql", path),)  # a failed replacement keeps it
        async for out in engine.generate([5, 6, 7], _greedy("sql", 2)):
            assert out.error is None
        await engine.update_lora("sql", None)
        assert engine.model_info.lora_adapters == ()

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()


def test_decode_graphs_mask_each_adapters_rows_as_the_eager_path_groups_them(lora_setup):
    """The static-shape form a CUDA graph captures (every slot's update, masked to its rows; on a CPU the same
    forward runs over the graph runner's padded buffers) decodes what the eager grouped form does."""
    modules = (("sql", str(lora_setup["sql"])), ("chat", str(lora_setup["chat"])))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 1270, (n,), generator=g).tolist() for n in (6, 11, 4, 9, 13)]
    work = {str(i): (p, _greedy([None, "sql", "chat"][i % 3], 10)) for i, p in enumerate(prompts)}
    want = _run(Engine.from_pretrained(lora_setup["base"], lora_modules=modules, **OPTIONS), work)
    engine = Engine.from_pretrained(lora_setup["base"], lora_modules=modules, max_loras=3, **OPTIONS)
    engine.runner.capture_decode_graphs(4, engine.max_model_len)
    assert _run(engine, work) == want
    assert engine.runner.num_graph_steps > 0  # decode steps of up to 4 sequences went through the graph runner


def _prompt_logprobs(engine: Engine, prompt: list[int], lora: str | None = None) -> torch.Tensor:
    engine.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0, lora=lora), request_id="p")
    scored = []
    while engine.has_unfinished():
        for o in engine.step():
            scored += o.prompt_logprobs or []
    return torch.tensor([t.logprob for t in scored])


def test_an_adapter_of_fused_projections_scores_as_its_merged_checkpoint(tmp_path, demo_model_dir):
    """Phi-3's checkpoints fuse q/k/v and gate/up, so its PEFT adapters target ``qkv_proj`` / ``gate_up_proj``: one
    ``lora_A`` and a ``lora_B`` over every part's rows (they were refused as the shape of the first part)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from tests.engine.test_phi3 import CONFIG

    torch.manual_seed(0)
    base = save_with_tokenizer(Phi3ForCausalLM(Phi3Config(**CONFIG)), tmp_path / "phi3", demo_model_dir)
    g = torch.Generator().manual_seed(6)
    adapter = {}
    for layer in range(2):
        for module, (n_in, n_out) in {"self_attn.qkv_proj": (64, 128), "mlp.gate_up_proj": (64, 192),
                                      "self_attn.o_proj": (64, 64)}.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            adapter[f"{key}.lora_A.weight"] = torch.randn(4, n_in, generator=g) * 0.2
            adapter[f"{key}.lora_B.weight"] = torch.randn(n_out, 4, generator=g) * 0.2
    folder = tmp_path / "fused"
    folder.mkdir()
    save_file(adapter, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, '
                                                '"target_modules": ["qkv_proj", "gate_up_proj", "o_proj"]}')
    prompt = list(range(40, 64))
    got = _prompt_logprobs(Engine.from_pretrained(base, lora_modules=(("phi", str(folder)),), **OPTIONS), prompt,
                           "phi")
    want = _prompt_logprobs(Engine.from_pretrained(merged_copy(base, adapter, 2.0, tmp_path / "merged"), **OPTIONS),
                            prompt)
    assert float((got - want).abs().max()) < 1e-4
