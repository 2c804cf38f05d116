#!/usr/bin/env python
"""Host time per decode step, by stage: what a GPU waits for between two steps.

    python benchmarks/step_host.py [--batches 8,32,128] [--contexts 128,2048] [--async-scheduling]

Without asynchronous scheduling the device idles while the host records a step's tokens, builds its outputs,
schedules the next step and writes its metadata: that time adds to every step however fast the forward is. This
runs the real engine on a one-layer random Qwen3 (hidden 32, vocab 1024, fp32, CPU) so the forward and the
sampler's device work are small, decodes with B sequences at a context of about C tokens (greedy, EOS ignored), and
prints the milliseconds per step of `Scheduler.schedule`, `ModelRunner.prepare`, the forward, the sampler (on a
CPU its argmax over the logits is in it), `Scheduler.update` and the rest of `Engine.step` (outputs, stop checks).
With ``--async-scheduling`` each row is measured again with it on: the same host work, which a GPU would then
overlap with its step (a CPU computes synchronously, so here the column shows only what the bookkeeping costs).
Host-side numbers move with the machine and its load: compare rows of one run.
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
import tempfile
import time
from collections import defaultdict
from typing import Any, Callable

import torch

STAGES = ("schedule", "prepare", "forward", "sampler", "update")


def build_model(path: pathlib.Path, max_position: int) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ember.engine import demo

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                 max_position_embeddings=max_position, tie_word_embeddings=True)).save_pretrained(path)
    tok = pathlib.Path(tempfile.mkdtemp(prefix="ember-step-host-tok-"))
    demo.build(tok)  # the benchmark deals in token IDs; any tokenizer will do
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, path / name)
    shutil.rmtree(tok, ignore_errors=True)


class _Timed:
    """Calls through to ``fn`` and adds its wall time to ``totals[key]`` (attribute reads pass through)."""

    def __init__(self, fn: Callable[..., Any], totals: dict[str, float], key: str) -> None:
        self._fn, self._totals, self._key = fn, totals, key

    def __call__(self, *args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._fn(*args, **kw)
        finally:
            self._totals[self._key] += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


def measure(path: pathlib.Path, batch: int, context: int, steps: int, async_scheduling: bool = False
            ) -> dict[str, float]:
    """Milliseconds per decode step by stage, over ``steps`` steps once every sequence decodes."""
    from ember.engine.engine import Engine
    from ember.engine.params import SamplingParams

    max_len = context + steps + 64
    eng = Engine.from_pretrained(str(path), max_num_seqs=batch, max_model_len=max_len,
                                 max_num_batched_tokens=max(2048, context), device="cpu",
                                 num_kv_blocks=batch * (max_len // 16 + 2),  # every sequence runs at once
                                 async_scheduling=async_scheduling)
    totals: dict[str, float] = defaultdict(float)
    eng.scheduler.schedule = _Timed(eng.scheduler.schedule, totals, "schedule")
    eng.scheduler.update = _Timed(eng.scheduler.update, totals, "update")
    eng.runner.prepare = _Timed(eng.runner.prepare, totals, "prepare")
    eng.runner.forward = _Timed(eng.runner.forward, totals, "forward")
    eng.sampler = _Timed(eng.sampler, totals, "sampler")
    g = torch.Generator().manual_seed(batch + context)
    for _ in range(batch):
        eng.add_request(torch.randint(0, 1024, (context,), generator=g).tolist(),
                        SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True))
    while not (len(eng.scheduler.running) == batch and all(s.num_output_tokens >= 2 for s in eng.scheduler.running)):
        eng.step()
    totals.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    out = {k: totals[k] / steps * 1e3 for k in STAGES}
    out["rest"] = step_ms - sum(out.values())
    out["step"] = step_ms
    eng.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--batches", default="8,32", help="decoding sequences per step")
    ap.add_argument("--contexts", default="128,2048", help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per row")
    ap.add_argument("--async-scheduling", action="store_true", help="also measure each row with it on")
    a = ap.parse_args()
    torch.set_num_threads(1)
    batches = [int(x) for x in a.batches.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    path = pathlib.Path(tempfile.mkdtemp(prefix="ember-step-host-"))
    build_model(path, max(contexts) + a.steps + 128)
    print("Host milliseconds per decode step (one-layer model on the CPU; the forward and sampler columns include "
          "their small CPU compute)\n")
    print("| B | context | async | schedule | prepare | update | rest (outputs, stops) | host total | sampler | "
          "forward |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for context in contexts:
        for batch in batches:
            for overlap in (False, True) if a.async_scheduling else (False,):
                r = measure(path, batch, context, a.steps, overlap)
                host = r["schedule"] + r["prepare"] + r["update"] + r["rest"]
                print(f"| {batch} | {context} | {'on' if overlap else 'off'} | {r['schedule']:.3f} | "
                      f"{r['prepare']:.3f} | {r['update']:.3f} | {r['rest']:.3f} | {host:.3f} | {r['sampler']:.3f} | "
                      f"{r['forward']:.3f} |")
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
