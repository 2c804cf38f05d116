"""N-gram speculative decoding against plain decoding, offline in the engine; prints a table.

    python benchmarks/speculative.py                        # stories260K (../shared) and a random 4-layer Qwen3
    python benchmarks/speculative.py --batch 1,8 --max-tokens 256 --k 4

Per model and batch size: decode tokens/s without and with ``--speculative-config`` (ngram, ``--k`` draft tokens,
lookup 2..3; medians of ``--repeat`` alternating runs), engine steps, draft tokens accepted / proposed, and, greedy,
whether both runs emitted the same tokens (in fp32 they must: speculation keeps only what greedy decoding would emit;
in bf16 a position computed beside others may round differently, as it may between batch sizes). ``--temperature`` samples instead (unseeded).
``--json`` puts every request under a JSON schema (ten records with the same keys; replies end with the document).
stories260K is llama2.c's tiny trained model, whose stories repeat names and phrases; the random model shows the
cost where little repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _stories(tmp: Path) -> Path | None:
    src = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "stories260K"
    if not src.exists():
        return None
    from ember.engine import convert_llama2c

    out = tmp / "stories260K"
    convert_llama2c.main([str(src / "stories260K.bin"), str(src / "tok512.bin"), str(out)])
    return out


def _random_qwen3(tmp: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ember.engine import demo

    cfg = Qwen3Config(vocab_size=1280, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048)
    torch.manual_seed(0)
    out = tmp / "qwen3-4x1024"
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    demo_dir = demo.ensure()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_bytes((demo_dir / name).read_bytes())
    return out


def _prompts(path: Path, batch: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    starts = ["Once upon a time", "One day, Lily", "Tom and his dog", "The little bird", "Sue went to the park",
              "There was a big tree", "Ben had a red ball", "The sun was"]
    return [tok.encode(starts[i % len(starts)]) for i in range(batch)]


JSON_SCHEMA = {"type": "array", "minItems": 10, "maxItems": 10, "x-guidance": {"whitespace_flexible": False},
               "items": {"type": "object", "required": ["name", "qty"], "additionalProperties": False,
                         "properties": {"name": {"enum": ["apple", "pear", "plum"]},
                                        "qty": {"type": "integer", "minimum": 0, "maximum": 9}}}}
"""``--json``: ten objects with the same two keys, the shape of a typical structured answer (a list of records)."""


def _run(path: Path, prompts: list[list[int]], max_tokens: int, spec: dict | None, temperature: float,
         dtype: str | None = None, schema: dict | None = None) -> dict:
    from ember.engine.engine import Engine
    from ember.engine.params import SamplingParams

    backend = None
    if schema is not None:
        from ember.engine.eos import end_of_turn_ids
        from ember.grammar import GrammarBackend
        from ember.grammar.compiler import GrammarPlan

        backend = GrammarBackend.from_pretrained(path, eos_ids=end_of_turn_ids(None, path))
        plan = GrammarPlan(grammar=json.dumps({"grammars": [{"json_schema": schema}]}), budget=None)
    eng = Engine.from_pretrained(path, max_num_seqs=len(prompts), speculative_config=spec, dtype=dtype,
                                 bitmask_filler=backend.bitmask_filler() if backend else None)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=backend is None)
    ids = [eng.add_request(p, params, constraint=backend.constraint(plan) if backend else None) for p in prompts]
    eng.step()  # the prefills
    out: dict[str, list[int]] = {r: [] for r in ids}
    t0, steps0 = time.perf_counter(), eng.num_steps
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    wall = time.perf_counter() - t0
    s = eng.stats()
    return {"tokens": [out[r] for r in ids], "tok_s": sum(map(len, out.values())) / wall,
            "steps": eng.num_steps - steps0, "drafted": s.spec_draft_tokens, "accepted": s.spec_accepted_tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the two runs must agree)")
    ap.add_argument("--dtype", default=None, help="model dtype (default: the checkpoint's)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each, alternating; the table shows medians")
    ap.add_argument("--json", action="store_true", help="every request under a JSON schema (a list of records)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        models = [("stories260K", _stories(tmp)), ("random qwen3 4x1024", _random_qwen3(tmp))]
        print(f"{'model':<22}{'batch':>6}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}{'steps':>13}"
              f"{'accepted':>16}{'same':>6}")
        for name, path in models:
            if path is None:
                print(f"{name:<22} skipped: ../shared/data is absent")
                continue
            for b in (int(x) for x in args.batch.split(",")):
                prompts = _prompts(path, b)
                schema = JSON_SCHEMA if args.json else None
                runs = [(_run(path, prompts, args.max_tokens, None, args.temperature, args.dtype, schema),
                         _run(path, prompts, args.max_tokens, spec, args.temperature, args.dtype, schema))
                        for _ in range(args.repeat)]
                plain, fast = runs[0]
                plain_tok_s = statistics.median(r[0]["tok_s"] for r in runs)
                fast_tok_s = statistics.median(r[1]["tok_s"] for r in runs)
                same = str(plain["tokens"] == fast["tokens"]) if args.temperature == 0 else "-"
                acc = f"{fast['accepted']}/{fast['drafted']}"
                print(f"{name:<22}{b:>6}{plain_tok_s:>13.0f}{fast_tok_s:>12.0f}"
                      f"{fast_tok_s / plain_tok_s:>8.2f}x{plain['steps']:>6}->{fast['steps']:<6}{acc:>16}"
                      f"{same:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
