#!/usr/bin/env python
"""Device launches per decode step on the CUDA path, counted on a CPU: no GPU needed.

    python benchmarks/decode_launches.py [--batch 4]

A CUDA-graph replay of a decode step costs a few microseconds per launch however little the launch does, so the
count of launches per layer is a number to push down between device runs. The engine runs a tiny Qwen3 (q/k norms),
a tiny Gemma 3 (zero-centred q/k norms, sliding windows), a tiny Qwen3-MoE (two of three layers MoE) and the tiny
Qwen3 quantized to NVFP4 (its linears W4A16 through the grouped GEMM), and a tiny Qwen3-Next (hybrid) with the CUDA
path's kernels (Triton attention, row and MoE kernels, under ``TRITON_INTERPRET=1``), once with the fused attention
prologue (`ember.kernels.qk_norm_rope_cache`) and once without, and counts one decode forward's Triton launches and
the aten ops that would launch a kernel (views and ``empty`` do not; ``reshape``, ``to``, ``contiguous`` count only
when they copy). Prints one row per model and prologue.
"""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "1"
os.environ["EMBER_ROW_OPS"] = "triton"
os.environ["EMBER_ATTENTION"] = "triton"
os.environ["EMBER_MOE"] = "triton"
REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from ember.engine import demo, quantize  # noqa: E402
from ember.engine.engine import Engine  # noqa: E402
from ember.engine.models.layers import Attention  # noqa: E402
from ember.engine.params import SamplingParams  # noqa: E402

NO_KERNEL = {"view", "_unsafe_view", "split", "split_with_sizes", "slice", "select", "unsqueeze", "squeeze", "expand",
             "permute", "transpose", "t", "as_strided", "alias", "detach", "unbind", "chunk", "narrow",
             "_reshape_alias", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty"}

MAYBE_NO_COPY = {"reshape", "to", "contiguous", "flatten"}
"""Ops that launch a copy only when they return new memory."""


class LaunchCounter(TorchDispatchMode):
    """Counts, while ``active``, the aten ops that launch a device kernel and every Triton launch, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.launches: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.active and name not in NO_KERNEL:
            same = isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor) and out.data_ptr() == args[
                0].data_ptr()
            if name not in MAYBE_NO_COPY or not same:
                self.launches[name] += 1
        return out


def count(path: pathlib.Path, batch: int, fused: bool) -> tuple[collections.Counter, int]:
    """One decode step's launches with ``batch`` sequences decoding, and the model's attention layers."""
    eng = Engine.from_pretrained(path, max_num_seqs=batch, max_num_batched_tokens=256, max_model_len=128,
                                 num_kv_blocks=64, dtype="bfloat16", device="cpu")
    counter = LaunchCounter()
    run = InterpretedFunction.run

    def counted_run(self, *args, **kw):
        if counter.active:
            counter.launches["triton " + self.fn.__name__] += 1
        active, counter.active = counter.active, False
        try:
            return run(self, *args, **kw)
        finally:
            counter.active = active

    saved = Attention._fused_prologue
    if not fused:
        Attention._fused_prologue = lambda self, rope, backend: False
    InterpretedFunction.run = counted_run
    try:
        for i in range(batch):
            eng.add_request(list(range(10 + i, 30 + i)), SamplingParams(max_tokens=8, temperature=0.0,
                                                                           ignore_eos=True))
        forward = eng.runner.forward
        counted = []

        def counted_forward(ids, meta):
            decode = meta.max_seqlen_q == 1 and meta.num_tokens == batch and not counted
            counter.active = decode  # the first step whose every sequence decodes (after chunked prefills)
            try:
                return forward(ids, meta)
            finally:
                counter.active = False
                counted.append(decode) if decode else None

        eng.runner.forward = counted_forward
        with counter:
            while not counted and eng.has_unfinished():
                eng.step()
        if not counted:
            raise RuntimeError(f"{path.name}: no decode-only step")
        layers = sum(isinstance(m, Attention) for m in eng.runner.model.modules())
    finally:
        InterpretedFunction.run = run
        Attention._fused_prologue = saved
        eng.shutdown()
    return counter.launches, layers


def _tiny_qwen3_next(tmp: pathlib.Path) -> pathlib.Path:
    from transformers import Qwen3NextForCausalLM

    from tests.moe.conftest import save_hybrid
    from tests.moe.test_qwen3_next import tiny_next_config

    torch.manual_seed(0)
    return save_hybrid(Qwen3NextForCausalLM(tiny_next_config()), tmp / "qwen3-next", tmp / "demo")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4, help="sequences in the decode step")
    a = ap.parse_args()
    from tests.conftest import save_tiny_qwen3
    from tests.engine.test_gemma3 import save_tiny_gemma3
    from tests.moe.conftest import save_tiny_moe

    tmp = pathlib.Path(tempfile.mkdtemp())
    demo.build(tmp / "demo")
    models = {"Qwen3 (q/k norms)": save_tiny_qwen3(tmp / "qwen3", tmp / "demo", seed=0),
              "Gemma 3 (offset q/k norms)": save_tiny_gemma3(tmp / "gemma3", tmp / "demo", seed=0),
              "Qwen3-MoE (2 of 3 layers MoE)": save_tiny_moe(tmp / "moe", tmp / "demo", seed=0)}
    if quantize.main([str(models["Qwen3 (q/k norms)"]), str(tmp / "qwen3-nvfp4")]) == 0:
        models["Qwen3 NVFP4 (W4A16 linears)"] = tmp / "qwen3-nvfp4"
    models["Qwen3-Next (2 linear-attention, 2 attention layers)"] = _tiny_qwen3_next(tmp)
    print(f"Device launches in one decode forward of {a.batch} sequences (CUDA path's kernels, counted on a CPU)\n")
    print("| model | prologue | launches per step | per attention layer | most frequent |")
    print("| --- | --- | ---: | ---: | --- |")
    for name, path in models.items():
        for fused in (False, True):
            launches, layers = count(path, a.batch, fused)
            total = sum(launches.values())
            common = ", ".join(f"{k} {v}" for k, v in launches.most_common(4))
            print(f"| {name} | {'fused' if fused else 'unfused'} | {total} | {total / layers:.1f} | {common} |")


if __name__ == "__main__":
    main()
