#!/usr/bin/env python
"""Cost of Qwen3-Next's gated delta rule (`ember.kernels.gated_delta_rule`) on this machine's device.

    python benchmarks/gated_delta.py [--device cpu|cuda] [--lengths 64,512,4096] [--batch 1,16,64] [--repeat 3]
                                     [--batch-prefill 256x8]

Qwen3-Next-80B's per-layer shapes (16 key heads, 32 value heads, head dims 128): for each prefill length, the
token-by-token reference against the chunked form (64-token blocks), in microseconds per token and the chunked form's
speed-up; a flat µs/token column means linear cost. Then the batched one-token decode step at each batch size, in
microseconds per step. Also ``--batch-prefill`` prompts' prefills one call each against one batched call (what the
model does for the prefill chunks of a step). Best of ``--repeat``; fp32 state, as the model runs it.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ember.kernels import gated_delta_rule as gdr  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128


def _inputs(n: int, device: torch.device, batch: int | None = None):
    lead = (n,) if batch is None else (batch,)
    q, k = torch.randn(*lead, HK, DK, device=device), torch.randn(*lead, HK, DK, device=device)
    v = torch.randn(*lead, HV, DV, device=device)
    g, beta = -torch.rand(*lead, HV, device=device), torch.rand(*lead, HV, device=device)
    state = torch.randn(*(() if batch is None else (batch,)), HV, DK, DV, device=device)
    return q, k, v, g, beta, state


def _best(fn, repeat: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", default="64,512,4096")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch-prefill", type=lambda t: tuple(int(x) for x in t.split("x")), default=(256, 8),
                    metavar="TOKENSxSEQS", help="prefills timed one call each and as one batched call")
    ap.add_argument("--reference-max", type=int, default=512,
                    help="longest prefill the token-by-token reference is timed on")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"device {device}, threads {torch.get_num_threads()}, hk={HK} hv={HV} dk={DK} dv={DV}")
    print(f"{'prefill T':>10} | {'reference µs/tok':>16} | {'chunked µs/tok':>14} | {'speed-up':>8}")
    print("-" * 58)
    with torch.inference_mode():
        for n in (int(x) for x in args.lengths.split(",")):
            x = _inputs(n, device)
            chunked = _best(lambda: gdr.chunked(*x), args.repeat, device) / n * 1e6
            if n <= args.reference_max:
                ref = _best(lambda: gdr.recurrent(*x), 1, device) / n * 1e6
                print(f"{n:>10} | {ref:>16.1f} | {chunked:>14.1f} | {ref / chunked:>7.1f}x")
            else:
                print(f"{n:>10} | {'-':>16} | {chunked:>14.1f} | {'-':>8}")
        print()
        n, b = args.batch_prefill
        seqs = [_inputs(n, device) for _ in range(b)]
        one_by_one = _best(lambda: [gdr.chunked(*x) for x in seqs], args.repeat, device)
        stacked = [torch.stack([x[j] for x in seqs]) for j in range(6)]
        batched = _best(lambda: gdr.chunked(*stacked), args.repeat, device)
        print(f"{b} prefills of {n} tokens: one call each {one_by_one * 1e3:.1f} ms, one batched call "
              f"{batched * 1e3:.1f} ms ({one_by_one / batched:.1f}x)")
        print()
        print(f"{'decode B':>10} | {'µs/step':>10} | {'µs/seq':>8}")
        print("-" * 34)
        for b in (int(x) for x in args.batch.split(",")):
            x = _inputs(1, device, batch=b)
            step = _best(lambda: gdr.decode_step(*x), args.repeat, device) * 1e6
            print(f"{b:>10} | {step:>10.1f} | {step / b:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
