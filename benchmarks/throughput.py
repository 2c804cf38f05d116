"""Offline throughput: Ember's engine vs transformers `generate` (sequential, and one padded batch).

A random-weight Qwen3 of about 40M parameters (hidden 512, 8 layers, vocab 32k, fp32), or with ``--arch qwen3-next``
a Qwen3-Next of the same widths (6 of the 8 layers Gated DeltaNet, dense MLPs; transformers runs its torch fallback
for the delta rule, as it does without flash-linear-attention); N concurrent requests of ``--prompt`` prompt tokens
and exactly ``--output`` generated tokens each (EOS ignored). Prints one table of output tokens/s and Ember's ratio to
each baseline.

    python benchmarks/throughput.py                 # N = 1, 8, 32; 128 + 128 tokens
    python benchmarks/throughput.py --ns 1,8 --output 32 --hf-sequential-max 2   # a short run
    python benchmarks/throughput.py --arch qwen3-next

HF sequential runs ``min(N, --hf-sequential-max)`` requests one after another and reports their rate (a request's
rate does not depend on how many others wait behind it).
"""
from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch


def build_model(path: Path, seed: int = 0, arch: str = "qwen3") -> int:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

    from ember.engine import demo

    common = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                  tie_word_embeddings=True)
    torch.manual_seed(seed)
    if arch == "qwen3-next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**common, num_experts=0, linear_num_key_heads=4,
                                                     linear_num_value_heads=8, linear_key_head_dim=64,
                                                     linear_value_head_dim=64, full_attention_interval=4))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, rope_theta=1e6))
    model.save_pretrained(path)
    tok_dir = Path(tempfile.mkdtemp(prefix="ember-bench-tok-"))
    demo.build(tok_dir)  # any tokenizer will do: the benchmark deals in token IDs
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, path / name)
    shutil.rmtree(tok_dir, ignore_errors=True)
    return sum(p.numel() for p in model.parameters())


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32000, (length,), generator=g).tolist() for _ in range(n)]


def run_ember(engine, batch: list[list[int]], output: int) -> float:
    from ember.engine.params import SamplingParams

    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for p in batch:
        engine.add_request(p, params)
    n = 0
    while engine.has_unfinished():
        n += sum(len(o.new_token_ids) for o in engine.step())
    dt = time.perf_counter() - t0
    assert n == len(batch) * output, n
    return n / dt


def run_hf(model, batch: list[list[int]], output: int) -> float:
    ids = torch.tensor(batch)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output,
                             min_new_tokens=output, do_sample=False, eos_token_id=None, pad_token_id=0)
    dt = time.perf_counter() - t0
    n = (out.shape[1] - ids.shape[1]) * len(batch)
    assert n == len(batch) * output
    return n / dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--ns", default="1,8,32", help="comma-separated concurrency levels")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--hf-sequential-max", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--arch", choices=("qwen3", "qwen3-next"), default="qwen3")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ns = [int(x) for x in args.ns.split(",")]

    from transformers import AutoModelForCausalLM

    from ember.engine.engine import Engine

    work = Path(tempfile.mkdtemp(prefix="ember-bench-"))
    try:
        nparams = build_model(work, arch=args.arch)
        engine = Engine.from_pretrained(work, max_num_seqs=max(ns), max_num_batched_tokens=2048,
                                        max_model_len=args.prompt + args.output + 16)
        hf = AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32, attn_implementation="eager").eval()
        run_ember(engine, prompts(2, args.prompt, 99), 4)  # warm-up
        run_hf(hf, prompts(1, args.prompt, 99), 4)
        rows = []
        for n in ns:
            batch = prompts(n, args.prompt, seed=n)
            e = run_ember(engine, batch, args.output)
            seq_n = min(n, args.hf_sequential_max)
            t0 = time.perf_counter()
            for p in batch[:seq_n]:
                run_hf(hf, [p], args.output)
            hs = seq_n * args.output / (time.perf_counter() - t0)
            hb = run_hf(hf, batch, args.output)
            rows.append((n, e, hs, hb))
            print(f"N={n}: ember {e:.1f} tok/s, HF sequential {hs:.1f}, HF batch {hb:.1f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"model: random {args.arch}, {nparams / 1e6:.1f}M params, fp32; {args.prompt} prompt + {args.output} output "
          f"tokens per request; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")
    print("| N | Ember tok/s | HF sequential tok/s | HF padded batch tok/s | Ember / HF seq | Ember / HF batch |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, e, hs, hb in rows:
        print(f"| {n} | {e:.1f} | {hs:.1f} | {hb:.1f} | {e / hs:.2f}x | {e / hb:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
