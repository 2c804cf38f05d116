"""What every gpu_check section shares: the per-section `Report`, the `Deadline`, the run context `Ctx`, timing
(`bench_ms`, `graph_ms`), error measures (`rel_err`) and random paged attention batches (`paged_batch`).

A section is a function ``run(ctx)``; it records checks, rows and targets in ``ctx.report`` and calls
``ctx.report.save()`` whenever it has something worth keeping, so a later crash or timeout leaves its data on disk.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch


class OutOfTime(BaseException):
    """A section's (or the whole run's) deadline passed; what it recorded so far stays. A BaseException, so code
    that catches ``Exception`` (the engine's step, a check) cannot swallow the hard deadline's alarm."""


@dataclass
class Deadline:
    """A point on the ``time.monotonic()`` clock; sections check it before each batch, shape or token count."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> "Deadline":
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        return self.at - time.monotonic()

    def check(self, what: str, need_s: float = 0.0) -> None:
        """Raise `OutOfTime` unless at least ``need_s`` seconds remain for ``what``."""
        left = self.left()
        if left < need_s:
            raise OutOfTime(f"{what}: {max(left, 0.0):.1f} s left, needs ~{need_s:.0f} s" if need_s > 0
                            else f"{what}: the section's time ran out (0.0 s left)")

    def within(self, seconds: float) -> "Deadline":
        """This deadline or ``seconds`` from now, whichever comes first."""
        return Deadline(min(self.at, time.monotonic() + seconds))


class Report:
    """One section's results: ``<out>/<name>.json`` rewritten on every `save`, and its lines in the shared log."""

    def __init__(self, out: Path, name: str, log_file=None, **meta: Any) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.json_path = out / f"{name}.json"
        self.log_file = log_file
        self.started = time.monotonic()
        self.data: dict[str, Any] = {"section": name, "status": "running", "checks": [], "rows": [], "targets": [],
                                     "errors": [], **meta}

    def log(self, *parts: Any) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        if self.log_file is not None:
            self.log_file.write(line + "\n")
            self.log_file.flush()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.started, 2)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default))
        tmp.replace(self.json_path)

    def row(self, **row: Any) -> dict[str, Any]:
        self.data["rows"].append(row)
        return row

    def check(self, name: str, out: torch.Tensor, ref: torch.Tensor, tol: float, **extra: Any) -> bool:
        """Record ``rel_err(out, ref) < tol`` (and no NaN/inf in ``out``) as a check."""
        finite = bool(torch.isfinite(out.float()).all().item()) if out.numel() else True
        err = rel_err(out, ref) if finite else float("nan")
        ok = finite and err < tol
        diff = (out.float() - ref.float()).abs()
        self.add_check(name, ok, rel_err=err, max_abs=diff.max().item() if diff.numel() else 0.0, finite=finite,
                       tol=tol, **extra)
        return ok

    def check_equal(self, name: str, got: Any, want: Any, **extra: Any) -> bool:
        """Record ``got == want`` (e.g. token lists) as a check; on mismatch both are kept."""
        ok = got == want
        if not ok:
            extra.update(got=got, want=want)
        self.add_check(name, ok, **extra)
        return ok

    def add_check(self, name: str, ok: bool, **fields: Any) -> None:
        self.data["checks"].append({"name": name, "ok": bool(ok), **fields})
        err = fields.get("rel_err")
        detail = f"rel_err {err:.2e} (tol {fields.get('tol', 0):.0e})" if isinstance(err, float) else ""
        self.log(f"  check {name:<52} {detail} {'ok' if ok else 'FAIL'}")

    def target(self, name: str, value: float, goal: str, ok: bool, **extra: Any) -> None:
        """A performance target for the summary table: ``value`` (a ratio) against ``goal`` (e.g. ``">= 0.70"``)."""
        self.data["targets"].append({"name": name, "value": value, "goal": goal, "ok": bool(ok), **extra})
        self.log(f"  target {name}: {value:.3f} (goal {goal}) {'met' if ok else 'MISSED'}")


@dataclass
class Ctx:
    """What a section runs with. ``tiny``: a CPU run (Triton interpreter, fp16, toy shapes); ``quick``: the subset
    for ``--quick``. ``cache`` holds things several sections share (checkpoint folders, quantized weights)."""

    out: Path
    device: torch.device
    dtype: torch.dtype
    tiny: bool
    quick: bool
    deadline: Deadline
    report: Report
    sweeps: bool = True  # the tuning sweeps of a full run (``--no-sweeps``: off)
    models: frozenset[str] | None = None  # the parity section's cases to run (``--models``); None: all
    env: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)
    tmp: Path = Path("/tmp")

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def pick(self, tiny: Any, quick: Any, full: Any) -> Any:
        """The parameter for this run's size."""
        return tiny if self.tiny else quick if self.quick else full

    def wants(self, model: str) -> bool:
        """Whether the parity case ``model`` (one of ``parity.MODELS``) is selected by ``--models``."""
        return self.models is None or model in self.models

    def cached(self, key: str, build: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    def case(self, name: str, need_s: float = 0.0) -> contextlib.AbstractContextManager[None]:
        """One independent check: the deadline is checked first (`OutOfTime` ends the section), and any other
        exception inside is recorded as a failed check with its traceback, so the section goes on with the next."""
        return self._guarded(name, need_s, lambda e: self.report.add_check(
            name, False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()))

    def diagnostic(self, name: str, need_s: float = 0.0) -> contextlib.AbstractContextManager[None]:
        """A measurement that only informs (a profile): the deadline is checked first, and an exception inside is
        logged under ``diagnostic_errors`` without failing the section."""
        def note(e: Exception) -> None:
            self.report.data.setdefault("diagnostic_errors", []).append(f"{name}: {type(e).__name__}: {e}")
            self.report.log(f"  {name}: {type(e).__name__}: {e}")

        return self._guarded(name, need_s, note)

    @contextlib.contextmanager
    def _guarded(self, name: str, need_s: float, on_error: Callable[[Exception], None]) -> Iterator[None]:
        self.deadline.check(name, need_s)
        try:
            yield
        except OutOfTime:
            raise
        except Exception as e:
            on_error(e)
        finally:
            self.report.save()


def bench_ms(fn: Callable[[], Any], rep: int = 100, warmup: int = 25) -> float:
    """Median milliseconds per call: ``triton.testing.do_bench`` on a GPU, one timed call (after one untimed) on a
    CPU, where the interpreter's timings mean nothing."""
    if torch.cuda.is_available():
        import triton

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def graph_ms(fn: Callable[[], Any], rep: int = 100, warmup: int = 25) -> float:
    """Median milliseconds per call of ``fn`` captured in a CUDA graph and replayed, as the engine's decode steps run:
    the device time without Python's launch cost (which ``bench_ms`` of an eager call can measure instead when a
    kernel is shorter than the host's work to launch it). L2 is flushed before each replay as in ``bench_ms``. On a
    CPU: ``bench_ms``."""
    if not torch.cuda.is_available():
        return bench_ms(fn, rep, warmup)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return bench_ms(graph.replay, rep, warmup)
    finally:
        del graph


def time_by_kernel(fn: Callable[[], Any], calls: int = 3, top: int = 12) -> dict[str, Any]:
    """Where ``fn``'s time goes, per call: ``torch.profiler`` over ``calls`` calls (after one untimed), grouped by
    name. On a GPU the device time of each kernel (the same inside a CUDA graph, less the gaps between launches); on
    a CPU each aten op's own time. Returns ``{"total_us", "kernels": [{"name", "us", "count", "share"}...]}`` per
    call, the ``top`` longest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()

    def own_us(ev: Any) -> float:
        if cuda:
            return float(getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0))
        return float(ev.self_cpu_time_total)

    events = [ev for ev in prof.key_averages()
              if (ev.device_type == DeviceType.CUDA) == cuda and (cuda or ev.key.startswith("aten::")) and own_us(ev)]
    total = sum(own_us(ev) for ev in events) / calls
    events.sort(key=own_us, reverse=True)
    return {"total_us": total, "kernels": [
        {"name": ev.key[:120], "us": own_us(ev) / calls, "count": ev.count / calls,
         "share": own_us(ev) / calls / total if total else 0.0} for ev in events[:top]]}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp32."""
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def paged_batch(specs: list[tuple[int, int]], hq: int, hkv: int, d: int, *, device: torch.device,
                dtype: torch.dtype, cache_dtype: torch.dtype | None = None, block: int = 16, seed: int = 0,
                shuffle: bool = True, num_blocks: int | None = None, at_end: bool = False):
    """Random q and paged K/V for ``(context_len, query_len)`` per sequence.

    Blocks are scattered through the cache (``shuffle``), or, with ``at_end``, are the last blocks of a cache of
    ``num_blocks`` (only those are filled): what catches 32-bit offset overflow in a cache past 2^31 elements.
    Returns ``q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table``.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    gd = torch.Generator(device=device).manual_seed(seed)  # large tensors are drawn where they live

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gd, device=device).to(dtype)

    need = [(c + q + block - 1) // block for c, q in specs]
    total = sum(need)
    nb = max(num_blocks or 0, total + 1)
    if at_end:
        k_cache = torch.empty(nb, block, hkv, d, device=device, dtype=cache_dtype or dtype)
        v_cache = torch.empty_like(k_cache)
        ids = torch.arange(nb - total, nb)
        for cache in (k_cache, v_cache):
            cache[nb - total:] = randn(total, block, hkv, d).to(cache.dtype)
    else:
        k_cache, v_cache = randn(nb, block, hkv, d), randn(nb, block, hkv, d)
        if cache_dtype is not None:
            k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
        ids = torch.randperm(nb, generator=g) if shuffle else torch.arange(nb)
    table = torch.zeros(len(specs), max(need), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[used:used + n].int()
        used += n
    cu = torch.zeros(len(specs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([q for _, q in specs]), 0)
    seq_lens = torch.tensor([c + q for c, q in specs], dtype=torch.int32)
    q = randn(int(cu[-1]), hq, d)
    return q, k_cache, v_cache, cu.to(device), seq_lens.to(device), table.to(device)


def free_cuda() -> None:
    """Return cached CUDA memory between sections (a no-op without CUDA). Never raises: after a kernel fault the
    CUDA context is broken, and the run must still write its summary (the fault is in the section's record)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # e.g. "an illegal memory access was encountered", raised again at every sync
            print(f"free_cuda: {type(e).__name__}: {e}", flush=True)


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    if isinstance(o, torch.Tensor):
        return o.tolist()
    return repr(o)
