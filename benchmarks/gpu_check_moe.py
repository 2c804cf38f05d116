#!/usr/bin/env python
"""GPU check of the fused-MoE and NVFP4 kernels at the Qwen3-30B-A3B layer shape (E=128, H=2048, I=768, top-8).

For M in {1, 64, 512, 4096} tokens: the bf16 Triton fused MoE, the NVFP4 W4A16 Triton fused MoE (and W4A4 on
Blackwell) against the bf16 torch reference loop: relative error, median time, and time over the bytes-moved floor
(distinct experts touched x bytes per expert, plus activations, over the measured copy rate; target <= 1.5x). Also
the dense NVFP4 linear against bf16 ``F.linear`` and whether ``tl.dot_scaled`` with NVFP4 scales works on this GPU
and Triton.

``run(report, smoke=False)`` is what ``benchmarks/gpu_check.py`` calls: ``report`` needs ``log(*parts)``, ``save()``
and a ``data`` dict (``data["copy_gbps"]`` is reused when present). Alone: ``python benchmarks/gpu_check_moe.py
--out DIR`` (writes ``gpu_check_moe.json`` / ``.log``), or ``--smoke`` on a CPU (tiny shapes, interpreter, fp16).
Imports only torch, triton and Ember's kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

if __name__ == "__main__":
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit module is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from ember.kernels import moe, nvfp4  # noqa: E402
from ember.kernels import moe_reference as ref  # noqa: E402
from ember.kernels.nvfp4 import NVFP4Tensor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402
from gpu_check import Report, rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


def bench_ms(fn, rep: int = 50) -> float:
    return gpu_check.bench_ms(fn, rep=rep, warmup=10)


def _copy_gbps(report) -> float:
    if report.data.get("copy_gbps"):
        return float(report.data["copy_gbps"])
    n = (1 << 30) if CUDA else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    gbps = 2 * n / bench_ms(lambda: dst.copy_(src)) / 1e6
    report.data["copy_gbps"] = gbps
    return gbps


def quantize_stack(w: torch.Tensor, parts: int) -> NVFP4Tensor:
    """Per-expert NVFP4 of ``[E, N, K]`` (``parts=2``: gate and up share the tensor scale, as ModelOpt writes)."""
    qs = [nvfp4.quantize(w[e]) for e in range(w.shape[0])]
    s2 = torch.stack([q.weight_scale_2 for q in qs])
    return NVFP4Tensor(torch.stack([q.weight for q in qs]), torch.stack([q.weight_scale for q in qs]),
                       s2.unsqueeze(1).expand(-1, 2).contiguous() if parts == 2 else s2)


def _check(report, name: str, out: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    nan_free = not out.isnan().any().item()
    err = rel_err(out, want) if nan_free else float("nan")
    ok = nan_free and err < tol
    report.data.setdefault("checks", []).append({"name": name, "rel_err": err, "nan_free": nan_free, "tol": tol,
                                                 "ok": ok})
    report.log(f"check {name:<44} rel_err {err:.2e} {'ok' if ok else 'FAIL'}")
    return err


def run(report, smoke: bool = False) -> None:
    """The MoE section: fills ``report.data["moe"]``, ``["moe_linear"]``, ``["moe_env"]`` and appends checks."""
    dtype = torch.bfloat16 if CUDA else torch.float16
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    e, h, i, k = (8, 64, 32, 2) if smoke else (128, 2048, 768, 8)
    ms_list = (1, 16) if smoke else (1, 64, 512, 4096)
    copy = _copy_gbps(report)
    cap = list(torch.cuda.get_device_capability()) if CUDA else None
    env = {"triton": triton.__version__, "capability": cap, "w4a4": moe.w4a4_available(DEV),
           "dot_scaled_nvfp4_works": moe.dot_scaled_nvfp4_works(str(DEV)), "shape": [e, h, i, k]}
    report.data["moe_env"] = env
    report.log("moe env:", json.dumps(env))
    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(DEV)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(DEV)
    q13, q2 = quantize_stack(w13, 2), quantize_stack(w2, 1)
    w13b, w2b = w13.to(dtype), w2.to(dtype)
    del w13, w2
    bytes_bf16 = 3 * i * h * 2
    bytes_fp4 = 3 * i * h * (0.5 + 1 / 16)
    rows = report.data.setdefault("moe", [])
    for m in ms_list:
        x = torch.randn(m, h, generator=g).to(DEV, dtype)
        tw, ti = ref.topk_routing(torch.randn(m, e, generator=g).to(DEV), k, True)
        touched = int(torch.unique(ti).numel())
        act = m * h * 2 * 2 + m * k * h * 4  # x in, output, the fp32 per-pair partials
        floor_bf16 = (touched * bytes_bf16 + act) / copy / 1e6
        floor_fp4 = (touched * bytes_fp4 + act) / copy / 1e6
        want = ref.fused_moe(x.float(), w13b.float(), w2b.float(), tw, ti)
        want_fp4 = ref.fused_moe_nvfp4(x.float(), q13, q2, tw, ti)
        out_bf16 = moe.fused_moe(x, w13b, w2b, tw, ti)
        out_fp4 = moe.fused_moe_nvfp4(x, q13, q2, tw, ti, w4a4=False)
        row = {"M": m, "experts_touched": touched, "floor_bf16_ms": floor_bf16, "floor_nvfp4_ms": floor_fp4,
               "err_bf16": _check(report, f"moe bf16 M={m}", out_bf16, want, tol),
               "err_nvfp4": _check(report, f"moe nvfp4 w4a16 M={m}", out_fp4, want_fp4, tol)}
        row["torch_ms"] = bench_ms(lambda: ref.fused_moe(x, w13b, w2b, tw, ti), rep=20)
        row["bf16_ms"] = bench_ms(lambda: moe.fused_moe(x, w13b, w2b, tw, ti))
        row["nvfp4_ms"] = bench_ms(lambda: moe.fused_moe_nvfp4(x, q13, q2, tw, ti, w4a4=False))
        if env["w4a4"]:
            out4 = moe.fused_moe_nvfp4(x, q13, q2, tw, ti, w4a4=True)
            row["err_w4a4"] = _check(report, f"moe nvfp4 w4a4 M={m}", out4,
                                     ref.fused_moe_nvfp4_w4a4(x.float(), q13, q2, tw, ti), 5e-2)
            row["w4a4_ms"] = bench_ms(lambda: moe.fused_moe_nvfp4(x, q13, q2, tw, ti, w4a4=True))
        row["bf16_over_floor"] = row["bf16_ms"] / floor_bf16
        row["nvfp4_over_floor"] = row["nvfp4_ms"] / floor_fp4
        rows.append(row)
        report.log(f"moe M={m:<5} experts {touched:>3}  torch {row['torch_ms']:8.3f} ms  bf16 {row['bf16_ms']:7.3f} ms "
                   f"({row['bf16_over_floor']:.1f}x floor)  nvfp4 {row['nvfp4_ms']:7.3f} ms "
                   f"({row['nvfp4_over_floor']:.1f}x floor {floor_fp4:.3f} ms)")
        report.save()
    lin = report.data.setdefault("moe_linear", [])
    n_out, k_in = (48, 64) if smoke else (4096, 4096)
    w = (torch.randn(n_out, k_in, generator=g) / k_in**0.5).to(DEV)
    qw = nvfp4.quantize(w)
    wb = w.to(dtype)
    for m in ms_list:
        x = torch.randn(m, k_in, generator=g).to(DEV, dtype)
        err = _check(report, f"nvfp4 linear M={m}", moe.nvfp4_linear(x, qw), ref.nvfp4_linear(x.float(), qw), tol)
        floor = (n_out * k_in * (0.5 + 1 / 16) + m * (k_in + n_out) * 2) / copy / 1e6
        r = {"M": m, "N": n_out, "K": k_in, "err": err, "nvfp4_ms": bench_ms(lambda: moe.nvfp4_linear(x, qw)),
             "bf16_ms": bench_ms(lambda: F.linear(x, wb)), "floor_ms": floor}
        lin.append(r)
        report.log(f"nvfp4 linear M={m:<5} {r['nvfp4_ms']:.4f} ms ({str(dtype)[6:]} F.linear {r['bf16_ms']:.4f} ms, "
                   f"floor {floor:.4f} ms)")
    report.save()


def print_table(report) -> None:
    d = report.data
    lines = ["", "=" * 78, f"MoE {d.get('moe_env', {})}",
             f"{'M':>5} {'exp':>4} {'torch ms':>9} {'bf16 ms':>8} {'x floor':>7} {'nvfp4 ms':>9} {'x floor':>7}"
             f" {'w4a4 ms':>8}"]
    for r in d.get("moe", []):
        lines.append(f"{r['M']:>5} {r['experts_touched']:>4} {r['torch_ms']:>9.3f} {r['bf16_ms']:>8.3f} "
                     f"{r['bf16_over_floor']:>7.1f} {r['nvfp4_ms']:>9.3f} {r['nvfp4_over_floor']:>7.1f} "
                     f"{r.get('w4a4_ms', float('nan')):>8.3f}")
    for r in d.get("moe_linear", []):
        lines.append(f"nvfp4 linear {r['N']}x{r['K']} M={r['M']:<5} {r['nvfp4_ms']:.4f} ms vs bf16 "
                     f"{r['bf16_ms']:.4f} ms (floor {r['floor_ms']:.4f})")
    lines += [f"FAIL {c['name']}: {c['rel_err']:.2e}" for c in d.get("checks", []) if not c["ok"]]
    lines += [f"ERROR {x.splitlines()[0]}" for x in d.get("errors", [])]
    lines.append("=" * 78)
    for line in lines:
        report.log(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path.cwd())
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on a CPU under the Triton interpreter")
    args = ap.parse_args()
    report = Report(args.out, "gpu_check_moe", sections=("checks", "errors"))
    try:
        run(report, args.smoke)
    except Exception:
        report.data["errors"].append(traceback.format_exc())
        report.log(f"moe FAILED:\n{traceback.format_exc()}")
    print_table(report)
    report.save()
    return 1 if report.data["errors"] or not all(c["ok"] for c in report.data["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
