"""Greedy generation of tiny random Qwen3 and Llama models equals transformers' generate, token for token, with
prompts submitted at staggered steps, under preemption and under chunked prefill."""
from __future__ import annotations


import pytest
import torch

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from tests.conftest import save_with_tokenizer

NEW_TOKENS = 12
MIN_MARGIN = 1e-3


def _save_tiny(kind: str, path, tokenizer_dir) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  initializer_range=0.1, rope_theta=10000.0)
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=False, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, rms_norm_eps=1e-5, **common))
    save_with_tokenizer(model, path, tokenizer_dir)


def _hf_greedy(model, prompts: list[list[int]]) -> list[tuple[list[int], float]]:
    """HF tokens and the smallest top-1/top-2 logit margin along the way, per prompt."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            # an explicit mask: token 0 in a prompt must not be taken for padding
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            scores = torch.stack(g.scores).squeeze(1)
            top2 = scores.topk(2, dim=-1).values
            out.append((g.sequences[0, len(p):].tolist(), float((top2[:, 0] - top2[:, 1]).min())))
    return out


def _prompts(n: int, seed: int, min_len: int, max_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.linspace(min_len, max_len, n).round().long().tolist()
    return [torch.randint(0, 1270, (int(L),), generator=g).tolist() for L in lens]


def _run_staggered(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    results: dict[str, list[int]] = {}
    ids: list[str] = []
    batch_sizes: list[int] = []
    pending = list(prompts)
    while pending or engine.has_unfinished():
        if pending:  # one new request per step
            rid = engine.add_request(pending.pop(0), params)
            ids.append(rid)
            results[rid] = []
        for o in engine.step():
            results[o.request_id].extend(o.new_token_ids)
        batch_sizes.append(engine.last_batch_size)
    return [results[r] for r in ids], batch_sizes


def _good(prompts, hf):
    keep = [(p, toks) for p, (toks, margin) in zip(prompts, hf) if margin > MIN_MARGIN]
    assert len(keep) >= 8, f"only {len(keep)} prompts have a clear greedy margin"
    return [p for p, _ in keep], [t for _, t in keep]



@pytest.fixture(scope="module")
def tiny(tmp_path_factory, demo_model_dir):
    """kind -> (checkpoint dir, the same model loaded by transformers)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for kind in ("qwen3", "llama"):
        d = tmp_path_factory.mktemp(f"tiny-{kind}")
        _save_tiny(kind, d, demo_model_dir)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        out[kind] = (d, hf)
    return out


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_greedy_equals_transformers_with_preemption(tiny, kind):
    path, hf = tiny[kind]
    prompts = _prompts(10, seed=1, min_len=3, max_len=40)
    prompts, expected = _good(prompts, _hf_greedy(hf, prompts))
    # 4-token blocks, 24 of them: the longest request needs 13, eight together need far more -> preemption
    engine = Engine.from_pretrained(path, block_size=4, num_kv_blocks=24, max_num_seqs=8,
                                    enable_prefix_caching=False)
    got, sizes = _run_staggered(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert max(sizes) > 1
    assert got == expected
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_greedy_equals_transformers_with_chunked_prefill(tiny, kind):
    path, hf = tiny[kind]
    prompts = _prompts(10, seed=2, min_len=5, max_len=60)
    prompts, expected = _good(prompts, _hf_greedy(hf, prompts))
    engine = Engine.from_pretrained(path, block_size=16, max_num_batched_tokens=16, max_num_seqs=16)
    got, _ = _run_staggered(engine, prompts)
    assert max(len(p) for p in prompts) > 16  # prompts longer than a step's budget were chunked
    assert engine.runner.last_num_tokens <= 16
    assert got == expected
