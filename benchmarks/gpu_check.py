#!/usr/bin/env python
"""The one device check of Ember: every kernel, the engine end to end, and the timings that have targets.

    python benchmarks/gpu_check.py --out DIR            # under 6 minutes on an H100/H200 (--budget-s 330)
    python benchmarks/gpu_check.py --out DIR --quick    # under 2 minutes (--budget-s 110)

Sections, in order of value (``benchmarks/gpu_sections/``), each writing ``DIR/<n>_<name>.json`` before the next
starts: 1 ``kernels`` (bf16 correctness of every kernel against its torch reference), 2 ``parity`` (engine greedy
tokens on the device == on the CPU, tiny Qwen3, Qwen3-MoE, Qwen3-Next, GLM-4.5, Gemma 3, Gemma 2, MiniMax-M2, Llama
4; CUDA-graph replay == eager), 3 ``attention`` (decode vs a copy of the same bytes, prefill vs SDPA, row kernels), 4
``moe`` (fused MoE / NVFP4 vs the bytes floor), 5 ``graphs`` (padded graph replay == eager on an 8-layer
Qwen3-8B-shaped model), 6 ``scale`` (a KV cache past 2^31 elements, an Engine sized by ``gpu_memory_utilization``,
e2e decode tokens/s vs compiled transformers).

A hard deadline (``--budget-s``) is passed into every section, which checks it per batch / token count; a section
out of time is recorded as ``timeout`` with what it measured, later ones as ``skipped``. A failing check, an
exception or a NaN is recorded with its traceback and never stops the next check or section; after a kernel fault
that breaks the CUDA context, the later sections run in a fresh process. ``DIR/summary.json``
and the table printed last hold every section's status, every failed check and the targets as ratios. Without a GPU
the same script runs a smoke subset: Triton interpreter, fp16, toy shapes (timings there mean nothing).
Exit status 1 when a check failed or a section raised.
"""
from __future__ import annotations

import time

_T0 = time.monotonic()  # the budget counts from process start when run as a script (imports take seconds)

import sys

_MODULES_AT_START = set(sys.modules)  # run as a script: the check's whole import closure is what comes after

import argparse
import contextlib
import json
import os
import platform
import signal
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit module is imported

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _ember_importable() -> None:
    """Run from a plain checkout too (no ``pip install -e .``): the subpackages live at the repository root."""
    try:
        import ember.kernels  # noqa: F401
    except ImportError:
        sys.modules.pop("ember", None)
        sys.path.insert(0, str(ROOT))
        import ember

        ember.__path__.append(str(ROOT))  # ember.kernels -> ROOT/kernels, as pyproject's package-dir maps it


_ember_importable()

import triton  # noqa: E402

from gpu_sections import attention_timing, correctness, graphs, moe_timing, parity, scale  # noqa: E402
from gpu_sections.common import (Ctx, Deadline, OutOfTime, Report, bench_ms, free_cuda,  # noqa: E402,F401
                                 paged_batch, rel_err)

NOT_ON_GPU_IMAGE = frozenset({"llguidance", "fastapi", "uvicorn", "pydantic", "zmq", "httptools", "openai",
                              "anthropic"})
"""Ember's dependencies (import names) missing from the GPU image's package list (KINDS.md, 2026-11-17): the check
must not import them."""

GRACE_S = 15.0
"""How long past ``--budget-s`` a section stuck in one long call may run before the alarm interrupts it."""


@dataclass
class Section:
    name: str
    run: Callable[[Ctx], None]
    weight: float  # a section may use (time left) * weight / (weights of the sections still to run)
    quick_weight: float  # the same for --quick
    releases: tuple[str, ...] = ()  # ctx.cache entries dropped after it (run or not), to free device memory


SECTIONS: list[Section] = [
    Section("kernels", correctness.run, 3.0, 4.0),
    Section("parity", parity.run, 1.5, 2.0),
    Section("attention", attention_timing.run, 1.0, 1.0),
    Section("moe", moe_timing.run, 1.0, 1.0, releases=("moe_weights",)),
    Section("graphs", graphs.run, 1.0, 1.0),
    Section("scale", scale.run, 3.0, 2.0),  # the transformers peer compiles for about a minute (not in --quick)
]


def measure_env(quick: bool, commit: str | None = None) -> dict[str, Any]:
    """Versions, the device, and the two denominators: device copy GB/s (read + write) and matmul TFLOP/s."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float16
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "triton": triton.__version__, "dtype": str(dtype), "quick": quick,
                           "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"}
    try:
        import subprocess

        env["commit"] = commit or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                                 capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:
        env["commit"] = None
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(sm_count=props.multi_processor_count, capability=list(torch.cuda.get_device_capability()),
                   memory_gib=round(props.total_memory / 2**30, 1))
    nbytes = (1 << 30) if cuda else (4 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    env["copy_gbps"] = 2 * nbytes / bench_ms(lambda: dst.copy_(src), rep=50) / 1e6
    del src, dst
    n = 8192 if cuda else 128
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    env["matmul_tflops"] = 2 * n**3 / bench_ms(lambda: a @ b, rep=50) / 1e9
    return env


class _Alarm:
    """Raises `OutOfTime` in the main thread at the hard deadline (budget + grace), even inside a long loop, but
    only while `armed` (inside a section), so the bookkeeping between sections is never interrupted. An interval
    timer already set (e.g. pytest-timeout's) is restored with its remaining time on `cancel`."""

    def __init__(self, at: float) -> None:
        self.armed = False
        self.on = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")
        if self.on:
            self.set_at = time.monotonic()
            self.saved = signal.signal(signal.SIGALRM, self._fire)
            self.saved_delay = signal.setitimer(signal.ITIMER_REAL, max(at - time.monotonic(), 0.01))[0]

    def _fire(self, signum, frame) -> None:
        if self.armed:
            self.armed = False
            raise OutOfTime("hard deadline (budget + grace) passed")

    @contextlib.contextmanager
    def arm(self) -> Iterator[None]:
        self.armed = True
        try:
            yield
        finally:
            self.armed = False

    def cancel(self) -> None:
        if self.on:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.saved)
            if self.saved_delay > 0:
                signal.setitimer(signal.ITIMER_REAL, max(self.saved_delay - (time.monotonic() - self.set_at), 0.01))


def run_section(sec: Section, ctx: Ctx) -> None:
    rep = ctx.report
    rep.log(f"== {rep.json_path.stem}: {ctx.deadline.left():.0f} s for it")
    rep.save()
    try:
        sec.run(ctx)
        status = "ok"
    except OutOfTime as e:
        status = "timeout"
        rep.data["timeout"] = str(e)
        rep.log(f"  {sec.name}: out of time ({e})")
    except Exception as e:
        status = "error"
        rep.data["errors"].append(traceback.format_exc())
        rep.log(f"  {sec.name} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    failed = [c["name"] for c in rep.data["checks"] if not c["ok"]]
    rep.data["status"] = "fail" if status == "ok" and failed else status
    rep.save()


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """The check (see the module doc); ``started``: the ``time.monotonic()`` the budget counts from (default: now)."""
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="folder for the JSON files and the log")
    ap.add_argument("--quick", action="store_true", help="the subset that runs in under 2 minutes")
    ap.add_argument("--budget-s", type=float, default=None, help="hard deadline in seconds (330; --quick: 110)")
    ap.add_argument("--sections", default="", help="comma-separated subset of " + ",".join(s.name for s in SECTIONS))
    ap.add_argument("--models", default="",
                    help="comma-separated subset of the parity section's cases (default all): "
                    + ",".join(parity.MODELS))
    ap.add_argument("--no-sweeps", action="store_true",
                    help="skip the tuning sweeps (decode attention tiles and segments, NVFP4 MoE tiles) of a full run")
    ap.add_argument("--commit", default=None,
                    help="the commit to record (default: git rev-parse HEAD, stale where the tree was copied "
                         "without its history)")
    ap.add_argument("--from-section", type=int, default=1, help=argparse.SUPPRESS)  # a resumed run (see resume)
    args = ap.parse_args(argv)
    start = started if started is not None else time.monotonic()
    budget = args.budget_s if args.budget_s is not None else (110.0 if args.quick else 330.0)
    deadline = Deadline(start + budget)
    chosen = set(filter(None, args.sections.split(","))) or {s.name for s in SECTIONS}
    unknown = chosen - {s.name for s in SECTIONS}
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    models = frozenset(filter(None, args.models.split(","))) or None
    if models is not None and models - set(parity.MODELS):
        ap.error(f"unknown models {sorted(models - set(parity.MODELS))}")
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    if args.from_section == 1:
        (args.out / "gpu_check.log").write_text("")
    log_file = open(args.out / "gpu_check.log", "a")  # appending: a resumed run writes to the same log
    summary: dict[str, Any] = {"budget_s": budget, "sections": []}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        alarm = _Alarm(deadline.at + GRACE_S)
        try:
            try:
                with alarm.arm():
                    summary["env"] = measure_env(args.quick, args.commit)
            except OutOfTime as e:
                summary["env"] = {"error": str(e)}
            print(f"env: {json.dumps(summary['env'])}", flush=True)
            log_file.write(f"env: {json.dumps(summary['env'])}\n")
            ctx = Ctx(out=args.out, device=torch.device("cuda" if cuda else "cpu"),
                      dtype=torch.bfloat16 if cuda else torch.float16, tiny=not cuda, quick=args.quick,
                      sweeps=not args.no_sweeps, models=models,
                      deadline=deadline, report=None, env=summary["env"], tmp=Path(tmp))  # type: ignore[arg-type]
            for i, sec in enumerate(SECTIONS, 1):
                if i < args.from_section:
                    continue
                rep = Report(args.out, f"{i}_{sec.name}", log_file, section=sec.name)
                ctx.report = rep
                try:
                    if sec.name not in chosen:
                        rep.data.update(status="skipped", reason="not selected (--sections)")
                    elif deadline.left() < 1.0:
                        rep.data.update(status="skipped", reason=f"out of time (budget {budget:.0f} s)")
                        rep.log(f"== {rep.json_path.stem}: skipped, out of time")
                    else:
                        weight = (lambda s: s.quick_weight) if args.quick else (lambda s: s.weight)
                        rest = sum(weight(s) for s in SECTIONS[i - 1:] if s.name in chosen)
                        ctx.deadline = deadline.within(deadline.left() * weight(sec) / rest)
                        with alarm.arm():
                            run_section(sec, ctx)
                            free_cuda()
                except OutOfTime as e:  # the alarm fired outside the section's own handlers
                    if rep.data["status"] == "running":
                        rep.data.update(status="timeout", timeout=str(e))
                for key in sec.releases:
                    ctx.cache.pop(key, None)
                rep.save()
                summary["sections"].append(_section_summary(rep.data))
                if i < len(SECTIONS) and context_broken():
                    rep.log(f"== the CUDA context is broken after {sec.name}: sections {i + 1}.. go on in a fresh process")
                    resumed, summary["_resumed_forbidden"] = resume(args, i + 1, deadline)
                    summary["sections"] += resumed
                    break
        finally:
            alarm.cancel()
    summary["elapsed_s"] = round(time.monotonic() - start, 1)
    summary["targets"] = [t for s in summary["sections"] for t in s.pop("_targets")]
    imported = {m.split(".")[0] for m in set(sys.modules) - _MODULES_AT_START}
    forbidden = sorted(imported & NOT_ON_GPU_IMAGE | set(summary.pop("_resumed_forbidden", [])))
    if forbidden:  # the GPU image lacks them: an import here breaks the check there
        summary["import_error"] = f"imported {forbidden}, which the GPU image does not have"
        summary["forbidden_imports"] = forbidden
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for line in summary_table(summary):
        print(line, flush=True)
        log_file.write(line + "\n")
    log_file.close()
    bad = any(s["status"] in ("fail", "error") or s["failed"] for s in summary["sections"])
    return 1 if bad or forbidden else 0


def context_broken() -> bool:
    """After a kernel fault (illegal address, ...) every later CUDA call of this process fails."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() != 2.0
    except Exception:
        return True


def resume(args: argparse.Namespace, first: int, deadline: Deadline) -> tuple[list[dict[str, Any]], list[str]]:
    """Run sections ``first..`` in a fresh process (same options, the time left); return their summaries and the
    modules it imported that the GPU image lacks."""
    import subprocess

    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), "--budget-s",
           f"{max(deadline.left(), 1.0):.1f}", "--from-section", str(first)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--sections", args.sections] if args.sections else []
    cmd += ["--no-sweeps"] if args.no_sweeps else []
    cmd += ["--commit", args.commit] if args.commit else []
    (args.out / "summary.json").unlink(missing_ok=True)  # the child writes its own
    try:
        subprocess.run(cmd, timeout=max(deadline.left(), 1.0) + GRACE_S + 30.0)
    except subprocess.TimeoutExpired:
        pass
    out = []
    for i, sec in enumerate(SECTIONS[first - 1:], first):
        path = args.out / f"{i}_{sec.name}.json"
        data = json.loads(path.read_text()) if path.exists() else {
            "section": sec.name, "status": "error", "errors": ["the resumed run wrote nothing for this section"]}
        if data.get("status") == "running":
            data.update(status="error", errors=data.get("errors", []) + ["the resumed run died in this section"])
        out.append(_section_summary(data))
    child = args.out / "summary.json"
    forbidden = json.loads(child.read_text()).get("forbidden_imports", []) if child.exists() else []
    return out, forbidden


def _section_summary(data: dict[str, Any]) -> dict[str, Any]:
    checks = data.get("checks", [])
    return {"name": data["section"], "status": data["status"], "elapsed_s": data.get("elapsed_s", 0.0),
            "checks_ok": sum(c["ok"] for c in checks), "checks": len(checks),
            "failed": [c["name"] + (f": {c['error']}" if c.get("error") else "") for c in checks if not c["ok"]],
            "note": data.get("timeout") or data.get("reason") or
            (data["errors"][-1].strip().splitlines()[-1] if data.get("errors") else ""),
            "_targets": data.get("targets", [])}


def summary_table(summary: dict[str, Any]) -> list[str]:
    env = summary.get("env", {})
    lines = ["", "=" * 100,
             f"Ember gpu_check on {env.get('device')} (torch {env.get('torch')}, triton {env.get('triton')}, "
             f"commit {env.get('commit')}): {summary['elapsed_s']} s of {summary['budget_s']:.0f} s",
             f"copy {env.get('copy_gbps', float('nan')):.0f} GB/s (read+write)   matmul "
             f"{env.get('matmul_tflops', float('nan')):.1f} TFLOP/s",
             f"{'section':<12} {'status':<8} {'checks':>9} {'s':>7}  note"]
    for s in summary["sections"]:
        lines.append(f"{s['name']:<12} {s['status']:<8} {s['checks_ok']:>4}/{s['checks']:<4} {s['elapsed_s']:>7.1f}  "
                     f"{s['note'][:60]}")
        lines += [f"    FAIL {f[:120]}" for f in s["failed"]]
    lines.append(f"{'target':<58} {'value':>8} {'goal':>8}  met")
    for t in summary["targets"]:
        lines.append(f"{t['name'][:58]:<58} {t['value']:>8.3f} {t['goal']:>8}  {'yes' if t['ok'] else 'NO'}")
    measured = {t["name"].split(" ")[0] for t in summary["targets"]}
    for name in ("decode", "graph", "NVFP4", "e2e"):
        if name not in measured:
            lines.append(f"{name + ' target':<58} {'not measured (section skipped, failed or out of time)'}")
    if summary.get("import_error"):
        lines.append(f"ERROR {summary['import_error']}")
    lines.append("=" * 100)
    return lines


if __name__ == "__main__":
    sys.exit(main(started=_T0))
