"""Section 2: the engine end to end on the device against the engine on the CPU, greedy, on tiny models.

For the demo Qwen3, a tiny Qwen3-MoE, a tiny Qwen3-Next (its linear attention on the torch path), a tiny GLM-4.5
(partial rotary, grouped routing), a tiny Gemma 3 (sliding windows, two RoPEs), a tiny Gemma 2 (soft-capped
attention scores), a tiny MiniMax-M2 (whole-projection q/k norms, sigmoid routing) and a tiny Llama 4 (chunked
attention, interleaved rotary), and the demo Qwen3 with a LoRA adapter: the same prompts
(shared prefixes for prefix-cache hits, a small token budget for chunked prefill and mixed prefill + decode steps)
through ``Engine`` on the CPU (torch path, fp32) and on the device (fp32, eager): the greedy tokens must be equal, or
first differ only where the reference's top-2 logprobs are a near-tie (fp32 matmuls round differently on another device;
the fused MoE's ``tl.dot`` uses TF32). The engine with decode CUDA graphs must give the eager engine's tokens (and
records how many steps replayed graphs, or why none did); an FP8 KV cache's first tokens must be the fp32 cache's but at
near-ties; a bf16 run's agreement with fp32 is recorded (information). On a CPU run the "device" is the CPU with
``EMBER_ATTENTION=triton`` / ``EMBER_MOE=triton`` (the kernels under the interpreter) and there are no graphs to replay.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
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


NEAR_TIE = 0.02
"""A first difference where the reference's top-2 logprobs are closer than this (nats) is rounding, not a bug."""

BF16_NEAR_TIE = 0.125
"""The same between two bf16 runs (speculative against plain): logits are bf16, whose spacing is 0.0625 between 8 and
16, so two paths that round differently cannot order logits closer than about two of those steps (an H200 run,
2026-12-04, had a first difference at a margin of exactly 0.0625)."""

FP8_NEAR_TIE = 0.5
"""The same for an e4m3 KV cache against a bf16/fp32 one (a few percent per element)."""


@dataclass
class Run:
    tokens: list[list[int]]  # greedy tokens per prompt
    margins: list[list[float]]  # top-1 minus top-2 logprob at each of them
    info: dict[str, Any]  # what the engine did (graph/eager steps, backend)


def greedy(path: Path, device: torch.device, dtype: torch.dtype, ps: list[list[int]], new_tokens: int,
           loras: list[str | None] | None = None, **engine_kw: Any) -> Run:
    """Greedy tokens of every prompt, all in flight together (the i-th under LoRA adapter ``loras[i]``), with their
    top-2 margins and the engine's counters."""
    from ember.engine.engine import Engine
    from ember.engine.params import SamplingParams

    eng = Engine.from_pretrained(path, device=device, dtype=dtype, max_num_seqs=8, max_num_batched_tokens=32,
                                 max_model_len=256, num_kv_blocks=128, **engine_kw)
    try:
        loras = loras or [None] * len(ps)
        ids = [eng.add_request(p, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=2,
                                                 lora=lora)) for p, lora in zip(ps, loras)]
        got: dict[str, list[int]] = {r: [] for r in ids}
        margins: dict[str, list[float]] = {r: [] for r in ids}
        steps = 0
        while eng.has_unfinished():
            steps += 1
            for o in eng.step():
                if o.error:
                    raise RuntimeError(f"request failed: {o.error}")
                got[o.request_id].extend(o.new_token_ids)
                margins[o.request_id].extend(lp.top[0][1] - lp.top[1][1] for lp in o.logprobs or [])
        runner = eng.runner
        info = {"steps": steps, "graph_steps": getattr(runner, "num_graph_steps", None),
                "eager_steps": getattr(runner, "num_eager_steps", None), "cuda_graphs": eng.cuda_graphs,
                "graph_blocker": runner.graph_blocker() if hasattr(runner, "graph_blocker") else None,
                "backend": getattr(runner.backend, "__name__", str(runner.backend)),
                "kv_cache_dtype": str(getattr(runner, "kv_cache_dtype", None)),
                "spec_drafts_kept": eng.stats().spec_accepted_tokens}
        return Run([got[r] for r in ids], [margins[r] for r in ids], info)
    finally:
        eng.shutdown()


def differences(got: Run, want: Run) -> list[dict[str, Any]]:
    """Where each prompt's tokens first differ, with the reference's top-2 margin there."""
    out = []
    for i, (g, w) in enumerate(zip(got.tokens, want.tokens)):
        j = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if j is None and len(g) == len(w):
            continue
        j = min(len(g), len(w)) if j is None else j
        m = want.margins[i]
        out.append({"prompt": i, "position": j, "got": g, "want": w, "margin": m[j] if j < len(m) else None})
    return out


def check_agree(ctx: Ctx, name: str, got: Run, want: Run, near_tie: float = NEAR_TIE) -> bool:
    """Equal tokens, or every first difference at a near-tie of the reference (recorded either way)."""
    diffs = differences(got, want)
    ok = all(d["margin"] is not None and d["margin"] < near_tie for d in diffs)
    ctx.report.add_check(name, ok, exact=not diffs, differences=diffs, near_tie=near_tie)
    return ok


def graphs_run(ctx: Ctx, eager: Run, path: Path, ps: list[list[int]], new: int, **engine_kw: Any) -> Run:
    """The device fp32 run with CUDA graphs allowed. Without CUDA the engine decodes eagerly, so a second run would
    repeat ``eager`` step for step on the interpreter: ``eager`` stands in and only the comparison's code runs."""
    if not ctx.cuda:
        return eager
    return greedy(path, ctx.device, torch.float32, ps, new, **engine_kw)


def _model(ctx: Ctx, name: str, path: Path, fp8_kv: bool = False) -> None:
    rep = ctx.report
    n, new = ctx.pick((2, 3), (6, 8), (8, 12))
    ps = prompts(n, 1280)
    kernels_on_cpu = {} if ctx.cuda else {"EMBER_ATTENTION": "triton", "EMBER_MOE": "triton"}
    want = None
    with ctx.case(f"{name}: cpu reference run"):
        with env(EMBER_ATTENTION=None, EMBER_MOE=None):
            want = greedy(path, torch.device("cpu"), torch.float32, ps, new)
        rep.row(model=name, run="cpu fp32", **want.info)
    if want is None:
        return
    eager = None
    with ctx.case(f"{name}: device fp32 eager == cpu"):
        with env(**kernels_on_cpu):
            eager = greedy(path, ctx.device, torch.float32, ps, new, enforce_eager=True)
        rep.row(model=name, run="device fp32 eager", **eager.info)
        check_agree(ctx, f"{name}: device fp32 eager == cpu", eager, want)
    if eager is not None:
        with ctx.case(f"{name}: cuda graphs == eager"):
            graphs = graphs_run(ctx, eager, path, ps, new)
            rep.row(model=name, run="device fp32 graphs", **graphs.info)
            ok = check_agree(ctx, f"{name}: cuda graphs == eager", graphs, eager)
            ctx.cache.setdefault("graph_equal", []).append(ok)
            if not graphs.info["graph_steps"]:
                rep.log(f"  {name}: no step replayed a CUDA graph ({graphs.info['graph_blocker']})")
    if eager is not None and fp8_kv and _has_kv_cache_dtype():
        with ctx.case(f"{name}: fp8 kv cache run"):
            with env(**kernels_on_cpu):
                fp8 = greedy(path, ctx.device, torch.float32, ps, new, kv_cache_dtype="fp8", enforce_eager=True)
            rep.row(model=name, run="device fp32 fp8-kv eager", **fp8.info)
            # an e4m3 cache moves the logits a little: the first tokens (after a prefill that reads the cache) must
            # agree with the fp32 cache's except at near-ties; a wrong scale or cast gives noise
            firsts = [{"prompt": i, "got": x[0], "want": y[0], "margin": eager.margins[i][0]}
                      for i, (x, y) in enumerate(zip(fp8.tokens, eager.tokens)) if x[:1] != y[:1]]
            rep.add_check(f"{name}: fp8 kv cache first tokens == fp32 cache (but near-ties)",
                          all(d["margin"] < FP8_NEAR_TIE for d in firsts), differences=firsts,
                          near_tie=FP8_NEAR_TIE)
    if ctx.cuda and not ctx.quick and eager is not None:
        with ctx.case(f"{name}: device bf16 run"):
            bf16 = greedy(path, ctx.device, torch.bfloat16, ps, new)
            same = sum(a == b for x, y in zip(bf16.tokens, want.tokens) for a, b in zip(x, y))
            rep.row(model=name, run="device bf16 graphs", token_agreement_with_fp32=same / (n * new), **bf16.info)
            rep.log(f"  {name}: bf16 agrees with fp32 on {same}/{n * new} tokens (information)")


def _lora(ctx: Ctx) -> None:
    """The demo Qwen3 with a LoRA adapter on every projection, every other request under it: the device's tokens
    must be the CPU's (the rows of each adapter are gathered and scattered on the device)."""
    rep = ctx.report
    path, adapter = models.tiny_qwen3(ctx), models.tiny_lora(ctx)
    n, new = ctx.pick((2, 3), (6, 8), (8, 12))
    ps = prompts(n, 1280)
    loras = ["tiny" if i % 2 == 0 else None for i in range(n)]
    kw = dict(loras=loras, lora_modules=(("tiny", str(adapter)),))
    with env(EMBER_ATTENTION=None, EMBER_MOE=None):
        want = greedy(path, torch.device("cpu"), torch.float32, ps, new, **kw)
    base = greedy(path, torch.device("cpu"), torch.float32, ps[:1], new)
    rep.add_check("qwen3 + lora: the adapter changes the cpu reference's tokens", base.tokens[0] != want.tokens[0])
    kernels_on_cpu = {} if ctx.cuda else {"EMBER_ATTENTION": "triton", "EMBER_MOE": "triton"}
    with env(**kernels_on_cpu):
        got = greedy(path, ctx.device, torch.float32, ps, new, enforce_eager=True, **kw)
    rep.row(model="qwen3 + lora", run="device fp32 eager", **got.info)
    check_agree(ctx, "qwen3 + lora: device fp32 eager == cpu", got, want)
    graphs = graphs_run(ctx, got, path, ps, new, **kw)  # decode graphs mask each slot's update to its rows
    rep.row(model="qwen3 + lora", run="device fp32 graphs", **graphs.info)
    check_agree(ctx, "qwen3 + lora: cuda graphs == eager", graphs, got)
    if ctx.cuda and not ctx.quick:
        bf16 = greedy(path, ctx.device, torch.bfloat16, ps, new, **kw)
        same = sum(a == b for x, y in zip(bf16.tokens, want.tokens) for a, b in zip(x, y))
        rep.row(model="qwen3 + lora", run="device bf16", token_agreement_with_fp32=same / (n * new), **bf16.info)


def _speculative(ctx: Ctx) -> None:
    """N-gram speculation on the device (draft chunks through the device attention, every position sampled in the
    one read): greedy tokens must be plain decoding's on the CPU, with drafts kept; in bf16, speculative against
    plain on the device, each first difference at a near-tie."""
    rep = ctx.report
    path = models.tiny_qwen3(ctx)
    n, new = ctx.pick((1, 32), (4, 32), (8, 48))
    ps = [p * 3 for p in prompts(n + 1, 1280)[1:]]  # repeated text: the lookup finds drafts
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with env(EMBER_ATTENTION=None, EMBER_MOE=None):
        want = greedy(path, torch.device("cpu"), torch.float32, ps, new)
    kernels_on_cpu = {} if ctx.cuda else {"EMBER_ATTENTION": "triton", "EMBER_MOE": "triton"}
    with env(**kernels_on_cpu):
        got = greedy(path, ctx.device, torch.float32, ps, new, speculative_config=spec)
    rep.row(model="qwen3 + ngram", run="device fp32 speculative", **got.info)
    check_agree(ctx, "qwen3 + ngram: device fp32 speculative == cpu plain", got, want)
    rep.add_check("qwen3 + ngram: drafts kept on the device", got.info["spec_drafts_kept"] > 0,
                  kept=got.info["spec_drafts_kept"])
    if ctx.cuda and not ctx.quick:
        plain = greedy(path, ctx.device, torch.bfloat16, ps, new)
        fast = greedy(path, ctx.device, torch.bfloat16, ps, new, speculative_config=spec)
        rep.row(model="qwen3 + ngram", run="device bf16 speculative", **fast.info)
        check_agree(ctx, "qwen3 + ngram: device bf16 speculative == plain (but near-ties)", fast, plain,
                    BF16_NEAR_TIE)


def pooled(path: Path, device: torch.device, dtype: torch.dtype, ps: list[list[int]], kind: str) -> torch.Tensor:
    """Every prompt's pooled output (an embedding, or a classifier's logits), all in flight together: ``[n, D]``."""
    from ember.engine.engine import Engine
    from ember.engine.params import SamplingParams

    eng = Engine.from_pretrained(path, device=device, dtype=dtype, max_num_seqs=8, num_kv_blocks=128)
    try:
        ids = [eng.add_request(p, SamplingParams(pooling=kind)) for p in ps]
        out: dict[str, list[float]] = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.error:
                    raise RuntimeError(f"request failed: {o.error}")
                if o.finished:
                    out[o.request_id] = o.embedding
        return torch.tensor([out[r] for r in ids])
    finally:
        eng.shutdown()


def _encoders(ctx: Ctx) -> None:
    """BERT / XLM-RoBERTa embeddings and classifier logits on the device against the CPU's: fp32 within 1e-4, bf16
    within 3e-2 (bidirectional attention over whole prompts, one SDPA per prompt)."""
    rep = ctx.report
    ps = prompts(ctx.pick(2, 6, 8), 1280)
    for arch, kind in (("BertModel", "mean"), ("XLMRobertaModel", "cls"), ("BertForSequenceClassification", "cls"),
                       ("XLMRobertaForSequenceClassification", "cls")):
        if ctx.quick and arch not in ("XLMRobertaModel", "BertForSequenceClassification"):
            continue
        with ctx.case(f"{arch}: device == cpu"):
            path = models.tiny_encoder(ctx, arch)
            want = pooled(path, torch.device("cpu"), torch.float32, ps, kind)
            rep.check(f"{arch}: device fp32 == cpu", pooled(path, ctx.device, torch.float32, ps, kind), want, 1e-4)
            if ctx.cuda:
                rep.check(f"{arch}: device bf16 ~ cpu fp32", pooled(path, ctx.device, torch.bfloat16, ps, kind),
                          want, 3e-2)


def _has_kv_cache_dtype() -> bool:
    import inspect

    from ember.engine.engine import Engine

    return "kv_cache_dtype" in inspect.signature(Engine.from_pretrained).parameters


QUICK_MODELS = ("qwen3-moe", "qwen3-next", "gemma2", "llama4")
"""The tiny models --quick runs: one per distinct device path (MoE, recurrent, soft-capped, chunked-local)."""
_TINY = (("qwen3-moe", models.tiny_qwen3_moe), ("qwen3-next", models.tiny_qwen3_next),
         ("glm4-moe", models.tiny_glm4_moe), ("gemma3", models.tiny_gemma3), ("gemma2", models.tiny_gemma2),
         ("minimax-m2", models.tiny_minimax_m2), ("llama4", models.tiny_llama4))
MODELS = ("qwen3", "lora", "encoders", "ngram", *(name for name, _ in _TINY))
"""The parity section's cases, in run order: the names ``--models`` selects from."""


def run(ctx: Ctx) -> None:
    if ctx.wants("qwen3"):
        with ctx.case("build tiny qwen3"):
            _model(ctx, "qwen3", models.tiny_qwen3(ctx), fp8_kv=True)
    if ctx.wants("lora"):
        with ctx.case("qwen3 + lora"):
            _lora(ctx)
    if ctx.wants("encoders"):
        with ctx.case("encoders"):
            _encoders(ctx)
    if ctx.wants("ngram"):
        with ctx.case("qwen3 + ngram speculation"):
            _speculative(ctx)
    for name, build in _TINY:
        if (ctx.quick and name not in QUICK_MODELS) or not ctx.wants(name):
            continue
        ctx.deadline.check(f"tiny {name}")
        with ctx.case(f"build tiny {name}"):
            _model(ctx, name, build(ctx))
