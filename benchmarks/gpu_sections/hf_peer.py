#!/usr/bin/env python
"""The peer a user would try first: transformers ``generate`` (greedy, static cache, so ``torch.compile``d on CUDA)
on a checkpoint folder, decode tokens/s for one batch of equal-length random prompts. Run by gpu_check's scale
section as a subprocess, so its deadline can stop it (compiling may take a minute); writes one JSON object.

    python benchmarks/gpu_sections/hf_peer.py --model DIR --batch 32 --prompt-len 128 --new-tokens 64 --out X.json

Decode time is taken from CUDA events recorded by a logits processor at each generated token (no extra host
synchronisation): from the first token (end of prefill) to the last, over ``new_tokens - 1`` decode forwards.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def prompt_ids(batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """The prompts Ember's run uses too: token IDs in [10, 1270) (the demo tokenizer's range)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1270, (batch, prompt_len), generator=g).tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-compile", action="store_true", help="eager transformers (what a CPU run uses)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto").to(dev).eval()
    ids = torch.tensor(prompt_ids(args.batch, args.prompt_len), device=dev)
    compile_ = cuda and not args.no_compile
    result: dict = {"transformers": transformers.__version__, "torch": torch.__version__, "batch": args.batch,
                    "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "compile": compile_,
                    "dtype": str(model.dtype), "load_s": time.monotonic() - t_start}

    class Stamp(LogitsProcessor):
        """Records when each token's logits are ready (CUDA events, or the wall clock on a CPU)."""

        def __init__(self) -> None:
            self.marks: list = []

        def __call__(self, input_ids, scores):
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.marks.append(ev)
            else:
                self.marks.append(time.perf_counter())
            return scores

    def generate() -> tuple[float, list[int]]:
        stamp = Stamp()
        kw = dict(cache_implementation="static", disable_compile=not compile_)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([stamp]), **kw)
        if cuda:
            torch.cuda.synchronize()
            decode_s = stamp.marks[0].elapsed_time(stamp.marks[-1]) / 1e3
        else:
            decode_s = stamp.marks[-1] - stamp.marks[0]
        return decode_s, out[0, args.prompt_len:].tolist()

    t0 = time.monotonic()
    generate()  # compiles (CUDA) and warms up
    result["warmup_s"] = time.monotonic() - t0
    if compile_:
        try:
            from torch._dynamo.utils import counters

            result["dynamo_unique_graphs"] = int(counters["stats"]["unique_graphs"])
        except Exception as e:  # private API: information only
            result["dynamo_unique_graphs"] = repr(e)
    decode_s, first = generate()
    steps = args.new_tokens - 1
    result.update(decode_s=decode_s, tok_s=args.batch * steps / decode_s if decode_s > 0 else float("nan"),
                  first_tokens=first, total_s=time.monotonic() - t_start)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "first_tokens"}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
