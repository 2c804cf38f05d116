"""LoRA serving cost: engine decode throughput of one batch with no adapter, every request under one adapter, and
the requests spread over several adapters plus the base model; prints a table.

    python benchmarks/lora.py                                   # a random 4-layer, 1024-wide Qwen3 on this machine
    python benchmarks/lora.py --hidden 2048 --layers 8 --rank 16 --adapters 4 --batch 32 --tokens 64

The model and the adapters (rank ``--rank`` on every attention and MLP projection) are random and built in a
temporary folder. Each row times ``--batch`` greedy requests of ``--tokens`` new tokens after 32-token prompts,
after one warm-up run; "vs base" is the row's tokens/s over the base row's.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_sections.models import write_lora_adapter  # noqa: E402


def _model(folder: Path, hidden: int, layers: int) -> Path:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from ember.engine import demo

    demo.build(folder / "demo")
    cfg = Qwen3Config(vocab_size=1280, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(folder / "model")
    AutoTokenizer.from_pretrained(folder / "demo").save_pretrained(folder / "model")
    return folder / "model"


def _run(engine, loras: list[str | None], tokens: int) -> float:
    from ember.engine.params import SamplingParams

    for i, lora in enumerate(loras):
        prompt = [(7 * i + j) % 1200 + 1 for j in range(32)]
        engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, lora=lora),
                           request_id=str(i))
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from ember.engine.engine import Engine

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = _model(root, args.hidden, args.layers)
        names = [f"a{i}" for i in range(args.adapters)]
        modules = tuple((n, str(write_lora_adapter(root / n, model, args.rank, i, scale=0.01)))
                        for i, n in enumerate(names))
        options = dict(max_num_seqs=args.batch, max_num_batched_tokens=args.batch * 32, max_model_len=256,
                       num_kv_blocks=args.batch * 16 + 16, dtype="float32", device="cpu",
                       enable_prefix_caching=False)
        rows = [("base model (no adapters loaded)", None, [None] * args.batch),
                ("base requests, adapters loaded", modules, [None] * args.batch),
                ("every request under one adapter", modules, [names[0]] * args.batch),
                (f"spread over {args.adapters} adapters + base", modules,
                 [([None] + names)[i % (args.adapters + 1)] for i in range(args.batch)])]
        print(f"Qwen3 random {args.layers} layers x {args.hidden}, rank {args.rank}, batch {args.batch}, "
              f"{args.tokens} new tokens each, CPU ({torch.get_num_threads()} threads)\n")
        print(f"| {'case':<36} | {'tokens/s':>9} | {'vs base':>7} |")
        print(f"|{'-' * 38}|{'-' * 11}|{'-' * 9}|")
        base_rate = None
        for label, lora_modules, loras in rows:
            engine = Engine.from_pretrained(model, lora_modules=lora_modules or (), **options)
            _run(engine, loras, 4)  # warm-up
            rate = args.batch * args.tokens / _run(engine, loras, args.tokens)
            base_rate = base_rate or rate
            print(f"| {label:<36} | {rate:>9.0f} | {rate / base_rate:>6.2f}x |")


if __name__ == "__main__":
    main()
