"""Section 2: the engine end to end on the device against the engine on the CPU, greedy, on tiny models.

For the demo Qwen3 and a tiny Qwen3-MoE: the same prompts (shared prefixes for prefix-cache hits, a small token
budget for chunked prefill and mixed prefill + decode steps) through ``Engine`` on the CPU (torch path, fp32) and on
the device (fp32, eager): the greedy tokens must be equal. Then on CUDA the device engine with decode CUDA graphs
must give the tokens of the eager one (and is recorded as having replayed graphs, or why not), and a bf16 run's
agreement with fp32 is recorded (information, not a check). On a CPU run the "device" is the CPU with
``EMBER_ATTENTION=triton`` / ``EMBER_MOE=triton`` (the kernels under the interpreter).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from gpu_sections import models
from gpu_sections.common import Ctx


@contextlib.contextmanager
def env(**values: str | None) -> Iterator[None]:
    """Set (or with None, unset) environment variables for the duration."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def prompts(n: int, vocab: int) -> list[list[int]]:
    """``n`` prompts; the first half share a 21-token prefix (prefix-cache hits once the first is in)."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(10, vocab - 10, (21,), generator=g).tolist()
    out = []
    for i in range(n):
        own = torch.randint(10, vocab - 10, (3 + 7 * i,), generator=g).tolist()
        out.append(shared + own if i % 2 == 0 else own)
    return out


def greedy(path: Path, device: torch.device, dtype: torch.dtype, ps: list[list[int]], new_tokens: int,
           **engine_kw: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy tokens of every prompt, all in flight together, and what the engine did (graph/eager steps)."""
    from ember.engine.engine import Engine
    from ember.engine.params import SamplingParams

    eng = Engine.from_pretrained(path, device=device, dtype=dtype, max_num_seqs=8, max_num_batched_tokens=32,
                                 max_model_len=256, num_kv_blocks=128, **engine_kw)
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        ids = [eng.add_request(p, params) for p in ps]
        got: dict[str, list[int]] = {r: [] for r in ids}
        steps = 0
        while eng.has_unfinished():
            steps += 1
            for o in eng.step():
                if o.error:
                    raise RuntimeError(f"request failed: {o.error}")
                got[o.request_id].extend(o.new_token_ids)
        runner = eng.runner
        info = {"steps": steps, "graph_steps": getattr(runner, "num_graph_steps", None),
                "eager_steps": getattr(runner, "num_eager_steps", None), "cuda_graphs": eng.cuda_graphs,
                "graph_blocker": runner.graph_blocker() if hasattr(runner, "graph_blocker") else None,
                "backend": getattr(runner.backend, "__name__", str(runner.backend))}
        return [got[r] for r in ids], info
    finally:
        eng.shutdown()


def _model(ctx: Ctx, name: str, path: Path) -> None:
    rep = ctx.report
    n, new = ctx.pick((2, 3), (6, 8), (8, 12))
    ps = prompts(n, 1280)
    kernels_on_cpu = {} if ctx.cuda else {"EMBER_ATTENTION": "triton", "EMBER_MOE": "triton"}
    want = None
    with ctx.case(f"{name}: cpu reference run"):
        with env(EMBER_ATTENTION=None, EMBER_MOE=None):
            want, info = greedy(path, torch.device("cpu"), torch.float32, ps, new)
        rep.row(model=name, run="cpu fp32", **info)
    if want is None:
        return
    eager = None
    with ctx.case(f"{name}: device fp32 eager == cpu"):
        with env(**kernels_on_cpu):
            eager, info = greedy(path, ctx.device, torch.float32, ps, new, enforce_eager=True)
        rep.row(model=name, run="device fp32 eager", **info)
        rep.check_equal(f"{name}: device fp32 eager == cpu", eager, want)
    if ctx.cuda and eager is not None:
        with ctx.case(f"{name}: cuda graphs == eager"):
            graphs, info = greedy(path, ctx.device, torch.float32, ps, new)
            rep.row(model=name, run="device fp32 graphs", **info)
            rep.check_equal(f"{name}: cuda graphs == eager", graphs, eager, graph_steps=info["graph_steps"],
                            graph_blocker=info["graph_blocker"])
            ctx.cache.setdefault("graph_equal", []).append(graphs == eager)
        with ctx.case(f"{name}: device bf16 run"):
            bf16, info = greedy(path, ctx.device, torch.bfloat16, ps, new)
            same = sum(a == b for x, y in zip(bf16, want) for a, b in zip(x, y))
            rep.row(model=name, run="device bf16 graphs", token_agreement_with_fp32=same / (n * new), **info)
            rep.log(f"  {name}: bf16 agrees with fp32 on {same}/{n * new} tokens (information)")


def run(ctx: Ctx) -> None:
    with ctx.case("build tiny qwen3"):
        _model(ctx, "qwen3", models.tiny_qwen3(ctx))
    ctx.deadline.check("tiny qwen3-moe")
    with ctx.case("build tiny qwen3-moe"):
        _model(ctx, "qwen3-moe", models.tiny_qwen3_moe(ctx))
