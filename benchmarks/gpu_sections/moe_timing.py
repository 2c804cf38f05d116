"""The fused-MoE, NVFP4 and block-FP8 kernels at the Qwen3-30B-A3B layer shape (E=128, H=2048, I=768, top-8).

`correctness_checks` (part of section 1): the bf16 Triton fused MoE, block-FP8 W8A16 (128x128 blocks, as the
``-FP8`` releases, and per-channel scales), NVFP4 W4A16 (and W4A4 where
`kernels.moe.w4a4_available`) and the dense NVFP4 linear against the torch references, by relative error, at each
token count M the timings use (each M has its own tile config). `run` (section 4): median time of each against the
bf16 torch reference loop and against its **bytes floor**: distinct experts touched x bytes per expert plus the
activations, over the measured copy rate. Target: NVFP4 W4A16 <= 1.5x its floor at the decode sizes (M <= 64);
at M = 512 and 4096 the GEMMs are compute-bound and the bytes floor is reported only. Kernel times are of CUDA-graph
replays (``graph_ms``: the routing sort and both GEMMs, as a captured decode step runs them); ``nvfp4_eager_ms`` adds
Python's launch cost; at decode sizes ``nvfp4_by_kernel`` splits the NVFP4 MoE's device time by kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ember.kernels import fp8_block, moe, moe_routing, nvfp4
from ember.kernels import moe_reference as ref
from ember.kernels.fp8_block import FP8BlockTensor
from ember.kernels.nvfp4 import NVFP4Tensor

from gpu_sections.common import Ctx, bench_ms, graph_ms, time_by_kernel

NVFP4_FLOOR_TARGET = 1.5


@dataclass
class MoeWeights:
    e: int
    h: int
    i: int
    k: int
    w13: torch.Tensor  # bf16/fp16 [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    q13: NVFP4Tensor
    q2: NVFP4Tensor
    f13: FP8BlockTensor
    f2: FP8BlockTensor
    c13: FP8BlockTensor  # per-channel scales (compressed-tensors' -FP8-dynamic releases; per-tensor runs the same)
    c2: FP8BlockTensor


def quantize_stack(w: torch.Tensor, parts: int) -> NVFP4Tensor:
    """Per-expert NVFP4 of ``[E, N, K]`` (``parts=2``: gate and up share the tensor scale, as ModelOpt writes)."""
    qs = [nvfp4.quantize(w[e]) for e in range(w.shape[0])]
    s2 = torch.stack([q.weight_scale_2 for q in qs])
    return NVFP4Tensor(torch.stack([q.weight for q in qs]), torch.stack([q.weight_scale for q in qs]),
                       s2.unsqueeze(1).expand(-1, 2).contiguous() if parts == 2 else s2)


def weights(ctx: Ctx) -> MoeWeights:
    """The layer's random weights and their NVFP4 and block-FP8 quantizations, built once per run."""
    def build() -> MoeWeights:
        e, h, i, k = ctx.pick((8, 64, 32, 2), (128, 2048, 768, 8), (128, 2048, 768, 8))
        block = ctx.pick((16, 16), (128, 128), (128, 128))
        g = torch.Generator(device=ctx.device).manual_seed(0)
        w13 = torch.randn(e, 2 * i, h, generator=g, device=ctx.device) / h ** 0.5
        w2 = torch.randn(e, h, i, generator=g, device=ctx.device) / i ** 0.5
        return MoeWeights(e, h, i, k, w13.to(ctx.dtype), w2.to(ctx.dtype), quantize_stack(w13, 2),
                          quantize_stack(w2, 1), fp8_block.quantize(w13, block), fp8_block.quantize(w2, block),
                          *(fp8_block.quantize(w, (1, fp8_block.CHANNEL)) for w in (w13, w2)))

    return ctx.cached("moe_weights", build)


def token_counts(ctx: Ctx) -> tuple[int, ...]:
    """Token counts M: each has its own tile config (decode sizes first)."""
    return ctx.pick((1, 16), (1, 64), (1, 64, 512, 4096))


def _inputs(ctx: Ctx, w: MoeWeights, m: int):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, w.h, generator=g).to(ctx.device, ctx.dtype)
    tw, ti = ref.topk_routing(torch.randn(m, w.e, generator=g).to(ctx.device), w.k, True)
    return x, tw, ti


def correctness_checks(ctx: Ctx) -> None:
    tol = 2e-2 if ctx.dtype == torch.bfloat16 else 5e-3
    w = weights(ctx)
    ctx.report.data["moe_w4a4_available"] = moe.w4a4_available(ctx.device)
    for m in token_counts(ctx):
        x, tw, ti = _inputs(ctx, w, m)
        with ctx.case(f"moe bf16 M={m}"):
            want = ref.fused_moe(x.float(), w.w13.float(), w.w2.float(), tw, ti)
            ctx.report.check(f"moe bf16 M={m}", moe.fused_moe(x, w.w13, w.w2, tw, ti), want, tol)
        with ctx.case(f"moe fp8 w8a16 M={m}"):
            want = ref.fused_moe(x.float(), w.f13, w.f2, tw, ti)
            ctx.report.check(f"moe fp8 w8a16 M={m}", moe.fused_moe(x, w.f13, w.f2, tw, ti), want, tol)
        with ctx.case(f"moe fp8 per-channel M={m}"):
            want = ref.fused_moe(x.float(), w.c13, w.c2, tw, ti)
            ctx.report.check(f"moe fp8 per-channel M={m}", moe.fused_moe(x, w.c13, w.c2, tw, ti), want, tol)
        with ctx.case(f"moe nvfp4 w4a16 M={m}"):
            want = ref.fused_moe_nvfp4(x.float(), w.q13, w.q2, tw, ti)
            got = moe.fused_moe_nvfp4(x, w.q13, w.q2, tw, ti, w4a4=False)
            ctx.report.check(f"moe nvfp4 w4a16 M={m}", got, want, tol)
        if moe.w4a4_available(ctx.device):
            with ctx.case(f"moe nvfp4 w4a4 M={m}"):
                want = ref.fused_moe_nvfp4_w4a4(x.float(), w.q13, w.q2, tw, ti)
                got = moe.fused_moe_nvfp4(x, w.q13, w.q2, tw, ti, w4a4=True)
                ctx.report.check(f"moe nvfp4 w4a4 M={m}", got, want, 5e-2)
    mxfp4_checks(ctx, w, tol)
    exact_decode_check(ctx)
    with ctx.case("moe routing softmax top-k"):  # the engine's one-launch router against the torch routing
        for m in token_counts(ctx):
            g = torch.Generator().manual_seed(m)  # distinct logits in every dtype: no ties for top-k to break
            logits = torch.stack([torch.randperm(w.e, generator=g) for _ in range(m)]).float() * 0.05 - 3.0
            logits = logits.to(ctx.device, ctx.dtype)
            got_w, got_ids = moe_routing.softmax_topk(logits, w.k, True, round_through_dtype=True)
            want_w, want_ids = ref.topk_routing(logits, w.k, True)
            ctx.report.add_check(f"moe routing M={m}", bool(torch.equal(got_ids, want_ids)) and bool(
                torch.equal(got_w, want_w.to(ctx.dtype).float())), max_weight_diff=float((got_w - want_w).abs().max()))
    n_out, k_in = ctx.pick((48, 64), (4096, 4096), (4096, 4096))
    g = torch.Generator().manual_seed(1)
    wd = (torch.randn(n_out, k_in, generator=g) / k_in ** 0.5).to(ctx.device)
    qw, fw = nvfp4.quantize(wd), fp8_block.quantize(wd, w.f13.block)
    for m in token_counts(ctx):
        with ctx.case(f"nvfp4 linear M={m}"):
            x = torch.randn(m, k_in, generator=g).to(ctx.device, ctx.dtype)
            ctx.report.check(f"nvfp4 linear M={m}", moe.nvfp4_linear(x, qw), ref.nvfp4_linear(x.float(), qw), tol)
        with ctx.case(f"fp8 linear M={m}"):
            ctx.report.check(f"fp8 linear M={m}", moe.block_fp8_linear(x, fw), x.float() @ fw.dequantize().T, tol)


def exact_decode_check(ctx: Ctx) -> None:
    """x = I through the NVFP4 linear in the run's dtype: the output is the dequantized weight, bit for bit, with
    every byte at every word position and every E4M3 scale from the smallest subnormal up (the 16-bit decode reads
    a bf16 code of 0.5 as a subnormal until its multiply: a device that flushed it would show here)."""
    with ctx.case("nvfp4 decode x = I exact"):
        g = torch.Generator().manual_seed(4)
        n, k = ctx.pick((64, 128), (256, 512), (256, 512))
        packed = torch.cat([torch.randperm(256, generator=g) for _ in range(n * k // 512)]).to(torch.uint8)
        scales = torch.randint(1, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        w = NVFP4Tensor(packed.view(n, k // 2).to(ctx.device), scales.to(ctx.device),
                        torch.tensor(0.75, device=ctx.device))
        got = moe.nvfp4_linear(torch.eye(k, dtype=ctx.dtype, device=ctx.device), w)
        bad = int((got != w.dequantize().T.to(ctx.dtype)).sum())
        ctx.report.add_check("nvfp4 decode x = I exact", bad == 0, mismatched=bad, of=got.numel())


def mxfp4_checks(ctx: Ctx, w: MoeWeights, tol: float) -> None:
    """gpt-oss's experts: MXFP4 weights (E8M0 per 32), per-expert biases, the clamped GLU (limit 7, alpha 1.702)."""
    from ember.kernels import mxfp4

    q13, q2 = mxfp4.quantize(w.w13.float()), mxfp4.quantize(w.w2.float())
    g = torch.Generator().manual_seed(2)
    b13 = (0.1 * torch.randn(w.e, 2 * w.i, generator=g)).to(ctx.device, ctx.dtype)
    b2 = (0.1 * torch.randn(w.e, w.h, generator=g)).to(ctx.device, ctx.dtype)
    for m in token_counts(ctx)[:1 if ctx.quick else 2]:
        name = f"moe mxfp4 bias clamped-glu M={m}"
        with ctx.case(name):
            x, tw, ti = _inputs(ctx, w, m)
            want = ref.fused_moe(x.float(), q13, q2, tw, ti, b13=b13, b2=b2,
                                 activation=lambda t: ref.clamped_swiglu(t, 7.0, 1.702))
            got = moe.fused_moe(x, q13, q2, tw, ti, b13=b13, b2=b2, swiglu=(7.0, 1.702))
            ctx.report.check(name, got, want, tol)


def run(ctx: Ctx) -> None:
    """Section 4: MoE timings against the torch loop and the bytes floor; the dense NVFP4 linear against bf16."""
    rep = ctx.report
    copy = ctx.env["copy_gbps"]
    w = weights(ctx)
    bytes_bf16 = 3 * w.i * w.h * torch.finfo(ctx.dtype).bits // 8
    bytes_fp4 = 3 * w.i * w.h * (0.5 + 1 / 16)
    bytes_fp8 = 3 * w.i * w.h * (1 + 4 / (w.f13.block[0] * w.f13.block[1]))
    w4a4 = moe.w4a4_available(ctx.device)
    rep.data.update(shape=dict(E=w.e, H=w.h, I=w.i, top_k=w.k), w4a4=w4a4)
    try:
        rep.data["dot_scaled_nvfp4_works"] = moe.dot_scaled_nvfp4_works(str(ctx.device))
    except Exception as e:  # information only
        rep.data["dot_scaled_nvfp4_works"] = f"probe raised {type(e).__name__}: {e}"
    worst = None
    for m in token_counts(ctx):
        ctx.deadline.check(f"moe timing M={m}", 3.0)
        x, tw, ti = _inputs(ctx, w, m)
        touched = int(torch.unique(ti).numel())
        act = m * w.h * 2 * 2 + m * w.k * w.h * 4  # x in, output, the fp32 per-pair partials
        row = rep.row(kind="moe", M=m, experts_touched=touched, floor_bf16_ms=(touched * bytes_bf16 + act) / copy / 1e6,
                      floor_nvfp4_ms=(touched * bytes_fp4 + act) / copy / 1e6,
                      floor_fp8_ms=(touched * bytes_fp8 + act) / copy / 1e6)
        row["torch_ms"] = bench_ms(lambda: ref.fused_moe(x, w.w13, w.w2, tw, ti), rep=20, warmup=3)
        row["bf16_ms"] = graph_ms(lambda: moe.fused_moe(x, w.w13, w.w2, tw, ti), rep=50, warmup=10)
        row["fp8_ms"] = graph_ms(lambda: moe.fused_moe(x, w.f13, w.f2, tw, ti), rep=50, warmup=10)
        row["nvfp4_ms"] = graph_ms(lambda: moe.fused_moe_nvfp4(x, w.q13, w.q2, tw, ti, w4a4=False), rep=50,
                                   warmup=10)
        row["nvfp4_eager_ms"] = bench_ms(lambda: moe.fused_moe_nvfp4(x, w.q13, w.q2, tw, ti, w4a4=False), rep=50,
                                         warmup=10)
        block_m = max(16, moe.default_config(m, w.e, w.k, ctx.device, nvfp4=True).block_m)  # (1: no sort runs)
        row["align_ms"] = graph_ms(lambda: moe.moe_align_block_size(ti, block_m, w.e), rep=50, warmup=10)
        if w4a4:
            row["w4a4_ms"] = graph_ms(lambda: moe.fused_moe_nvfp4(x, w.q13, w.q2, tw, ti, w4a4=True), rep=50,
                                      warmup=10)
        packed = moe.default_config(m, w.e, w.k, ctx.device, nvfp4=True)
        splits = moe.moe_splits(m, w.k, w.e, w.h, w.i, packed, ctx.device)
        def packed_ms(name: str, cfg: moe.GemmConfig) -> str:
            """NVFP4 and block-FP8 MoE times with an explicit config (its split K on both GEMMs) into the row."""
            row[f"nvfp4_{name}_ms"] = graph_ms(lambda: moe.fused_moe_nvfp4(x, w.q13, w.q2, tw, ti, w4a4=False,
                                                                           config=cfg), rep=50, warmup=10)
            row[f"fp8_{name}_ms"] = graph_ms(lambda: moe.fused_moe(x, w.f13, w.f2, tw, ti,
                                                                   config=moe.block_fp8_config(cfg)),
                                             rep=50, warmup=10)
            return f"nvfp4 {row[f'nvfp4_{name}_ms']:.4f} ms, fp8 {row[f'fp8_{name}_ms']:.4f} ms"

        if splits != (1, 1):  # what the default's split K buys: the same tiles unsplit (split_k=1 on both GEMMs)
            row["splits"] = list(splits)
            rep.log(f"    split K {splits[0]} (gate/up), {splits[1]} (down); unsplit: {packed_ms('unsplit', packed)}")
        if packed.block_m == 1:  # what one program per routed pair buys: the 16-row tiles after the routing sort
            rep.log("    one program per pair; 16-row tiles unsplit: "
                    f"{packed_ms('tiles', replace(packed, block_m=16))}")
        row["bf16_over_floor"] = row["bf16_ms"] / row["floor_bf16_ms"]
        row["nvfp4_over_floor"] = row["nvfp4_ms"] / row["floor_nvfp4_ms"]
        row["fp8_over_floor"] = row["fp8_ms"] / row["floor_fp8_ms"]
        if m <= 64:
            worst = max(worst or 0.0, row["nvfp4_over_floor"])
        rep.log(f"  moe M={m:<5} experts {touched:>3}  torch {row['torch_ms']:8.3f} ms  bf16 {row['bf16_ms']:7.3f} ms "
                f"({row['bf16_over_floor']:.1f}x floor)  fp8 {row['fp8_ms']:7.3f} ms "
                f"({row['fp8_over_floor']:.1f}x floor)  nvfp4 {row['nvfp4_ms']:7.3f} ms "
                f"({row['nvfp4_over_floor']:.1f}x floor {row['floor_nvfp4_ms']:.3f} ms; "
                f"eager {row['nvfp4_eager_ms']:.3f}, "
                f"routing sort {row['align_ms']:.3f})")
        if m <= 64:
            with ctx.diagnostic(f"moe nvfp4 time by kernel M={m}", need_s=2.0):
                prof = time_by_kernel(lambda: moe.fused_moe_nvfp4(x, w.q13, w.q2, tw, ti, w4a4=False), top=6)
                row["nvfp4_by_kernel"] = prof
                rep.log("    nvfp4 by kernel: " + "; ".join(f"{k['name'][:40]} {k['us']:.1f} us x{k['count']:.0f}"
                                                          for k in prof["kernels"]))
        rep.save()
    if worst is not None:
        rep.target("NVFP4 MoE time / bytes floor (worst of M<=64)", worst, f"<= {NVFP4_FLOOR_TARGET}",
                   worst <= NVFP4_FLOOR_TARGET)
    n_out, k_in = ctx.pick((48, 64), (4096, 4096), (4096, 4096))
    g = torch.Generator().manual_seed(1)
    wd = (torch.randn(n_out, k_in, generator=g) / k_in ** 0.5).to(ctx.device)
    qw, fw, wb = nvfp4.quantize(wd), fp8_block.quantize(wd, w.f13.block), wd.to(ctx.dtype)
    for m in token_counts(ctx):
        ctx.deadline.check(f"nvfp4 linear timing M={m}", 1.0)
        x = torch.randn(m, k_in, generator=g).to(ctx.device, ctx.dtype)
        floor = (n_out * k_in * (0.5 + 1 / 16) + m * (k_in + n_out) * 2) / copy / 1e6
        r = rep.row(kind="nvfp4_linear", M=m, N=n_out, K=k_in, floor_ms=floor,
                    nvfp4_ms=graph_ms(lambda: moe.nvfp4_linear(x, qw), rep=50, warmup=10),
                    fp8_ms=graph_ms(lambda: moe.block_fp8_linear(x, fw), rep=50, warmup=10),
                    bf16_ms=graph_ms(lambda: F.linear(x, wb), rep=50, warmup=10))
        rep.log(f"  nvfp4 linear {n_out}x{k_in} M={m:<5} {r['nvfp4_ms']:.4f} ms (fp8 {r['fp8_ms']:.4f} ms, "
                f"F.linear {r['bf16_ms']:.4f} ms, floor {floor:.4f} ms)")
        split = moe.linear_config(m, ctx.device, n_out, k_in).split_k
        if split > 1:  # what the default's split K buys: the same launch unsplit
            one = replace(moe.linear_config(m, ctx.device, n_out, k_in), split_k=1)
            r.update(split_k=split, nvfp4_unsplit_ms=graph_ms(lambda: moe.nvfp4_linear(x, qw, config=one), rep=50,
                                                              warmup=10),
                     fp8_unsplit_ms=graph_ms(lambda: moe.block_fp8_linear(x, fw, config=moe.block_fp8_config(one)),
                                             rep=50, warmup=10))
            rep.log(f"    split K {split}; unsplit: nvfp4 {r['nvfp4_unsplit_ms']:.4f} ms, fp8 "
                    f"{r['fp8_unsplit_ms']:.4f} ms")
    rep.save()
    sweep(ctx)


SWEEP = ((1, 32, 128, 4, 3, 1), (1, 32, 128, 4, 3, 2), (1, 64, 128, 4, 3, 1), (1, 16, 128, 4, 3, 1),
         (1, 32, 256, 4, 2, 1), (16, 64, 128, 4, 2, 1), (16, 128, 128, 4, 2, 1), (16, 64, 256, 4, 2, 1),
         (16, 32, 128, 4, 3, 1), (16, 128, 64, 4, 3, 1), (16, 64, 128, 8, 2, 1), (16, 64, 64, 4, 4, 1),
         (16, 16, 128, 4, 3, 1), (16, 32, 128, 2, 3, 1), (16, 32, 256, 4, 2, 1), (16, 32, 64, 4, 4, 1),
         (16, 32, 128, 4, 3, 2), (16, 32, 128, 4, 3, 4), (16, 64, 128, 4, 2, 4), (16, 16, 128, 4, 3, 2))
"""NVFP4 W4A16 tiles tried at the decode sizes (block_m, block_n, block_k, warps, stages, split K of both GEMMs;
block_m 1 is one program per routed pair), full runs only. At M=1 the 16x32 tiles give only 192 programs for the
gate/up GEMM on 132 SMs (8 experts x 24 column tiles): the 16-column, 2-warp and split-K rows try more programs or
more of them per SM."""


def sweep(ctx: Ctx) -> None:
    """Graph-replay time of the NVFP4 W4A16 fused MoE per tile config at M = 1 and 64, to tune the table."""
    if ctx.quick or not ctx.sweeps:
        return
    w = weights(ctx)
    for m in (1, 64):
        x, tw, ti = _inputs(ctx, w, m)
        default = moe.default_config(m, w.e, w.k, ctx.device, nvfp4=True)
        for bm, bn, bk, warps, stages, split in SWEEP:
            ctx.deadline.check(f"moe sweep M={m}", 3.0)
            cfg = moe.GemmConfig(bm, bn, bk, 1, warps, stages, split)
            try:
                ms = graph_ms(lambda: moe.fused_moe_nvfp4(x, w.q13, w.q2, tw, ti, w4a4=False, config=cfg), rep=30,
                              warmup=5)
            except Exception as e:  # a config that does not compile or fit is a finding, not a stop
                ctx.report.row(kind="moe_sweep", M=m, config=str(cfg), error=f"{type(e).__name__}: {str(e)[:200]}")
                continue
            ctx.report.row(kind="moe_sweep", M=m, config=str(cfg), default=cfg == default, ms=ms)
            ctx.report.log(f"  moe sweep M={m:<3} nvfp4 {bm}x{bn}x{bk} w{warps}s{stages} split {split}: {ms:.4f} ms")
        ctx.report.save()
