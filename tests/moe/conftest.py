"""Tiny random Qwen3-MoE checkpoints (saved by transformers), their NVFP4 versions, and the helpers the MoE tests
share: transformers greedy, Ember greedy, one-prefill logits through Ember's model."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import save_with_tokenizer  # noqa: F401  (the MoE and model tests import it from here)
from tests.conftest import tensor_parallel_workers

VOCAB = 1280
NEW_TOKENS = 8
MIN_MARGIN = 1e-3


def compressed_tensors_fp8(strategy: str) -> dict:
    """A compressed-tensors ``quantization_config`` of FP8 weights by ``strategy`` (``channel``, ``tensor``) and
    dynamic per-token FP8 activations, as llm-compressor writes it (``lm_head`` left out)."""
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
    }


def tiny_moe_config(**over):
    from transformers import Qwen3MoeConfig

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
               num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
               max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False)
    cfg.update(over)
    return Qwen3MoeConfig(**cfg)


def save_tiny_moe(path: Path, tokenizer_dir: Path, seed: int = 0, **over) -> Path:
    """A random Qwen3-MoE saved by ``save_pretrained``; routers drawn with std 0.5 so top-k has no near-ties."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config(**over))
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
    return save_with_tokenizer(model, path, tokenizer_dir)


def save_hybrid(model, path: Path, tokenizer_dir: Path) -> Path:
    """Save a random Qwen3-Next / Qwen3.5 transformers ``model`` with the tokenizer of ``tokenizer_dir``, after moving
    its zero-centred norm offsets, ``A_log`` and ``dt_bias`` off their initial values and drawing its routers wide
    (so the ``1 + w`` norms and the decays are exercised, and top-k has no near-ties)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")) and "visual" not in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return save_with_tokenizer(model, path, tokenizer_dir)


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[tuple[list[int], float]]:
    """transformers' greedy tokens and the smallest top-1/top-2 logit margin on the way, per prompt (fp32,
    eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            top2 = torch.stack(g.scores).squeeze(1).topk(2, dim=-1).values
            out.append((g.sequences[0, len(p):].tolist(), float((top2[:, 0] - top2[:, 1]).min())))
    return out


def hf_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def prompts(n: int, seed: int, min_len: int = 3, max_len: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.linspace(min_len, max_len, n).round().long().tolist()
    return [torch.randint(0, VOCAB - 10, (int(n_),), generator=g).tolist() for n_ in lens]


def clear_margin(ps: list[list[int]], hf: list[tuple[list[int], float]], need: int):
    keep = [(p, toks) for p, (toks, margin) in zip(ps, hf) if margin > MIN_MARGIN]
    assert len(keep) >= need, f"only {len(keep)} prompts have a clear greedy margin"
    return [p for p, _ in keep], [t for _, t in keep]


def run_greedy(engine, ps: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``engine``'s greedy tokens for ``ps``, all prompts added at once (EOS ignored)."""
    from ember.engine.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in ps]
    got: dict[str, list[int]] = {r: [] for r in ids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
    return [got[r] for r in ids]


def ember_greedy(path: Path, ps: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Ember's greedy tokens, all prompts in flight together (fp32, CPU)."""
    from ember.engine.engine import Engine

    engine = Engine.from_pretrained(path, dtype=torch.float32, device="cpu", num_kv_blocks=64, max_num_seqs=16)
    out = run_greedy(engine, ps, new_tokens)
    assert engine.last_batch_size >= 1
    return out


def assert_two_ranks_match_one(model_dir, ps: list[list[int]], new_tokens: int, check=None, **options) -> None:
    """Greedy tokens over 2 CPU ranks (gloo) equal 1 process's; ``check(engine)`` inspects the split model first;
    every worker exits cleanly (the suite runs torch on one thread, so each rank gets one)."""
    from ember.engine.engine import Engine

    opts = dict(dtype=torch.float32, device="cpu", max_model_len=128, max_num_batched_tokens=32, num_kv_blocks=64,
                **options)
    expected = run_greedy(Engine.from_pretrained(model_dir, **opts), ps, new_tokens)
    engine = Engine.from_pretrained(model_dir, tensor_parallel_size=2, **opts)
    workers = list(engine.runner.workers)
    try:
        if check is not None:
            check(engine)
        assert run_greedy(engine, ps, new_tokens) == expected
    finally:
        engine.shutdown()
    for p in workers:
        p.join(timeout=10)
        assert p.exitcode == 0
    assert not tensor_parallel_workers()


def assert_prefill_logits_match_transformers(path: Path) -> None:
    """One 30-token prefill's logits within 1e-5 (relative) of transformers'."""
    prompt = prompts(1, seed=5, min_len=30, max_len=30)[0]
    want = hf_logits(path, prompt)
    got = ember_logits(ember_model(path), prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def assert_greedy_matches_transformers_chunked_and_cached(path: Path) -> None:
    """Greedy tokens equal transformers' (prompts with a clear top-2 margin) with prompts chunked to a 16-token step
    budget, then for a new prompt whose first 24 tokens (six 4-token blocks) come from the prefix cache."""
    from ember.engine.engine import Engine

    ps = prompts(8, seed=1, min_len=10, max_len=40)
    ps, expected = clear_margin(ps, hf_greedy(path, ps), need=6)
    engine = Engine.from_pretrained(path, dtype=torch.float32, device="cpu", block_size=4, num_kv_blocks=128,
                                    max_num_seqs=16, max_num_batched_tokens=16)
    assert run_greedy(engine, ps, 8) == expected
    assert engine.runner.last_num_tokens <= 16 < max(len(p) for p in ps)
    longest = max(ps, key=len)
    shared = longest[:24] + prompts(1, seed=2, min_len=7, max_len=7)[0]
    hits = engine.kv.prefix_hits
    got = run_greedy(engine, [shared], 8)
    assert engine.kv.prefix_hits - hits == 24
    assert got == [hf_greedy(path, [shared])[0][0]]


def ember_model(path: Path, quantization: str | None = None):
    from ember.engine import loader
    from ember.engine.engine import load_model

    cfg = loader.load_model_config(path)
    return load_model(path, cfg, 256, torch.device("cpu"), torch.float32, quantization=quantization)


def save_fused_experts(src: Path, dst: Path, transposed: bool = False) -> Path:
    """Checkpoint ``src`` (per-expert keys, one file) with each layer's experts fused as transformers 5 holds them
    (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) or, ``transposed``, as Qwen3-VL-MoE and Llama 4
    release them (``[E, H, 2I]``, ``[E, I, H]``)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, v in t.items():
        m = re.fullmatch(r"(.*\.experts\.)(\d+)\.(gate|up|down)_proj\.weight", name)
        if m is None:
            out[name] = v
        else:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = v
    for prefix, by_expert in experts.items():
        ws = [by_expert[e] for e in sorted(by_expert)]
        gate_up = torch.stack([torch.cat((w["gate"], w["up"])) for w in ws])
        down = torch.stack([w["down"] for w in ws])
        if transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out[prefix + "gate_up_proj"], out[prefix + "down_proj"] = gate_up.contiguous(), down.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def ember_logits(model, prompt: list[int]) -> torch.Tensor:
    """Logits at every position of one prefill of ``prompt`` through Ember's model (fresh paged cache)."""
    from ember.engine.attention import AttentionMetadata, RecurrentMetadata
    from ember.kernels import reference

    cfg = model.config
    t, bs = len(prompt), 16
    nb = (t + bs - 1) // bs
    shape = (nb, bs, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_kv_layers)]
    recurrent = None
    if hasattr(model, "allocate_recurrent_state"):  # one fresh sequence in state slot 0
        model.allocate_recurrent_state(1, torch.device("cpu"))
        recurrent = RecurrentMetadata.one_prefill(t, torch.device("cpu"))
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, t], dtype=torch.int32), seq_lens=torch.tensor([t], dtype=torch.int32),
        block_table=torch.arange(nb, dtype=torch.int32).unsqueeze(0), slot_mapping=torch.arange(t),
        positions=torch.arange(t), logits_indices=torch.arange(t), max_seqlen_q=t, max_seqlen_k=t,
        recurrent=recurrent)
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), meta, caches, reference)
        return model.compute_logits(hidden).float()


def write_dequantized(qdir: Path, out: Path) -> Path:
    """The torch reference for an NVFP4 checkpoint: every NVFP4 module dequantized to fp32, saved under the same
    names with the quantization config removed, so transformers can load and run it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ember.kernels import nvfp4

    out.mkdir(parents=True, exist_ok=True)
    with safe_open(str(qdir / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    deq = {}
    for name, v in t.items():
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        m = name[: -len(".weight")] if name.endswith(".weight") else None
        if m is not None and f"{m}.weight_scale" in t:
            deq[name] = nvfp4.dequantize(v, t[f"{m}.weight_scale"], t[f"{m}.weight_scale_2"])
        else:
            deq[name] = v
    save_file(deq, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((qdir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qdir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory, demo_model_dir) -> Path:
    return save_tiny_moe(tmp_path_factory.mktemp("tiny-moe"), demo_model_dir)


@pytest.fixture(scope="session")
def tiny_moe_nvfp4_dir(tmp_path_factory, tiny_moe_dir) -> Path:
    from ember.engine import quantize

    dst = tmp_path_factory.mktemp("tiny-moe-nvfp4")
    assert quantize.main([str(tiny_moe_dir), str(dst)]) == 0
    return dst

