"""Section 3: attention and row-kernel timings against what the hardware and torch do with the same bytes.

Decode: paged attention over B sequences of ctx tokens (32 q / 8 kv heads, hd 128) against a torch copy of the same
number of bytes (read + write = the KV bytes the kernel reads): ``frac_copy = copy_ms / attention_ms``. Target:
>= 0.70 at B=64, ctx=4k. Also SDPA (``enable_gqa``) on contiguous K/V. Prefill: one causal 4k-token sequence against
causal SDPA (``sdpa_ms / ms`` > 1 means faster than SDPA). Then a tile/segment/warp sweep and the row kernels'
GB/s. Decode times are of CUDA-graph replays (``graph_ms``), as the engine runs decode; ``eager_ms`` adds Python's
launch cost, which exceeds the kernels' time at small batches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.kernels import activation, attention, norm, reference_ops, rotary

from gpu_sections.common import Ctx, bench_ms, graph_ms, paged_batch

DECODE_TARGET = 0.70
TARGET_SHAPE = (64, 4096)
TINY_TARGET_SHAPE = (2, 70)  # stands in for the target shape on a CPU run, so the target's code path runs there


def copy_ms(ctx: Ctx, nbytes: int, rep: int = 50) -> float:
    """Milliseconds of a device copy that reads and writes ``nbytes`` in all (``nbytes / 2`` each way)."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), rep=rep)
    del src, dst
    return ms


def _heads(ctx: Ctx) -> tuple[int, int, int]:
    return ctx.pick((8, 2, 32), (32, 8, 128), (32, 8, 128))


def decode(ctx: Ctx) -> None:
    hq, hkv, hd = _heads(ctx)
    target = ctx.pick(TINY_TARGET_SHAPE, TARGET_SHAPE, TARGET_SHAPE)
    shapes = ctx.pick([TINY_TARGET_SHAPE, (1, 40)], [TARGET_SHAPE, (1, 4096), (8, 16384)],
                      [TARGET_SHAPE] + [(b, c) for b in (1, 8, 64) for c in (1024, 4096, 16384) if (b, c) != TARGET_SHAPE])
    for i, (b, ctx_len) in enumerate(shapes):
        ctx.deadline.check(f"decode B={b} ctx={ctx_len}", 2.0)
        q, kc, vc, cu, sl, bt = paged_batch([(ctx_len - 1, 1)] * b, hq, hkv, hd, device=ctx.device, dtype=ctx.dtype,
                                            seed=b + ctx_len)
        out = torch.empty_like(q)
        kv_bytes = 2 * b * ctx_len * hkv * hd * kc.element_size()
        split = b * hkv <= attention.SPLIT_KV_MAX_PROGRAMS
        def call() -> None:
            attention.paged_attention(q=q, k_cache=kc, v_cache=vc, out=out, cu_seqlens_q=cu, seq_lens=sl,
                                      block_table=bt, max_seqlen_q=1, max_seqlen_k=ctx_len, softmax_scale=hd ** -0.5)

        ms = graph_ms(call)
        cms = copy_ms(ctx, kv_bytes)
        row = ctx.report.row(kind="decode", B=b, ctx=ctx_len, path="split-kv" if split else "2d", ms=ms,
                             gbps=kv_bytes / ms / 1e6, copy_ms=cms, frac_copy=cms / ms, eager_ms=bench_ms(call))
        del kc, vc
        k = torch.randn(b, hkv, ctx_len, hd, device=ctx.device, dtype=ctx.dtype)
        v = torch.randn_like(k)
        qs = q.view(b, hq, 1, hd)
        try:
            sdpa = graph_ms(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True))
            row.update(sdpa_ms=sdpa, sdpa_over_ours=sdpa / ms)
        except Exception as e:  # an SDPA without enable_gqa on this torch
            row["sdpa_error"] = f"{type(e).__name__}: {e}"
        del k, v
        ctx.report.log(f"  decode B={b:<3} ctx={ctx_len:<6} {row['path']:<8} {ms * 1e3:8.1f} us "
                       f"{row['gbps']:7.0f} GB/s = {100 * row['frac_copy']:.0f}% of copy; "
                       f"sdpa {row.get('sdpa_ms', float('nan')) * 1e3:8.1f} us; eager {row['eager_ms'] * 1e3:8.1f} us")
        if (b, ctx_len) == target:
            ctx.report.target(f"decode attention B={b} ctx={ctx_len} / copy bandwidth", row["frac_copy"],
                              f">= {DECODE_TARGET}", row["frac_copy"] >= DECODE_TARGET)
        ctx.report.save()


def prefill(ctx: Ctx) -> None:
    hq, hkv, hd = _heads(ctx)
    s = ctx.pick(40, 4096, 4096)
    ctx.deadline.check(f"prefill {s}", 3.0)
    q, kc, vc, cu, sl, bt = paged_batch([(0, s)], hq, hkv, hd, device=ctx.device, dtype=ctx.dtype, seed=1,
                                        shuffle=False)
    out = torch.empty_like(q)
    flops = 2 * s * s * hq * hd  # causal: half of 4 s^2 hq hd
    k = kc.view(-1, hkv, hd)[:s].transpose(0, 1).unsqueeze(0).contiguous()
    v = vc.view(-1, hkv, hd)[:s].transpose(0, 1).unsqueeze(0).contiguous()
    qs = q.transpose(0, 1).unsqueeze(0).contiguous()
    sdpa = bench_ms(lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True), rep=50)
    ctx.report.row(kind="prefill", seq=s, impl="sdpa", ms=sdpa, tflops=flops / sdpa / 1e9)
    full = [(None, None, None, None), (64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 32, 8, 3),
            (128, 64, 8, 3), (128, 64, 8, 2), (64, 128, 4, 2), (128, 128, 8, 2)]
    variants = ctx.pick([(None, None, None, None)], full[:2], full)
    for bm, tile, warps, stages in variants:
        ctx.deadline.check(f"prefill block_m={bm}", 2.0)
        ms = bench_ms(lambda: attention.paged_attention(
            q=q, k_cache=kc, v_cache=vc, out=out, cu_seqlens_q=cu, seq_lens=sl, block_table=bt, max_seqlen_q=s,
            max_seqlen_k=s, softmax_scale=hd ** -0.5, block_m=bm, tile_size=tile, num_warps=warps,
            num_stages=stages), rep=50)
        impl = f"block_m={bm} tile={tile}" + (f" w{warps}s{stages}" if warps else "")
        row = ctx.report.row(kind="prefill", seq=s, impl=impl, ms=ms, tflops=flops / ms / 1e9,
                             sdpa_over_ours=sdpa / ms)
        ctx.report.log(f"  prefill {s} {row['impl']:<22} {ms:8.3f} ms {row['tflops']:6.1f} TFLOP/s "
                       f"(sdpa {sdpa:.3f} ms: {row['sdpa_over_ours']:.2f}x)")
        ctx.report.save()


def sweep(ctx: Ctx) -> None:
    """Tile size, warps, split and segment count at decode shapes (graph replays), to tune the defaults (full runs
    only)."""
    if ctx.quick or not ctx.sweeps:
        return
    hq, hkv, hd = _heads(ctx)
    two_d = [(False, None, t, w) for t in (16, 32, 64) for w in (4, 8)]
    split = [(True, s, t, 4) for s in (8, 16, 32, 64) for t in (16, 32, 64)]
    for b, ctx_len in ctx.pick([(2, 70)], [], [(64, 4096), (16, 4096), (8, 4096), (1, 16384), (1, 1024)]):
        q, kc, vc, cu, sl, bt = paged_batch([(ctx_len - 1, 1)] * b, hq, hkv, hd, device=ctx.device, dtype=ctx.dtype,
                                            seed=ctx_len)
        out = torch.empty_like(q)
        kv_bytes = 2 * b * ctx_len * hkv * hd * kc.element_size()
        variants = two_d[:2] if ctx.tiny else two_d + (split if b * hkv <= 2 * attention.SPLIT_KV_MAX_PROGRAMS else [])
        for is_split, segs, tile, warps in variants:
            ctx.deadline.check(f"sweep B={b} ctx={ctx_len}", 1.0)
            ms = graph_ms(lambda: attention.paged_attention(
                q=q, k_cache=kc, v_cache=vc, out=out, cu_seqlens_q=cu, seq_lens=sl, block_table=bt, max_seqlen_q=1,
                max_seqlen_k=ctx_len, softmax_scale=hd ** -0.5, split_kv=is_split, num_segments=segs, tile_size=tile,
                num_warps=warps), rep=50, warmup=5)
            ctx.report.row(kind="sweep", B=b, ctx=ctx_len, split=is_split, segments=segs, tile=tile, warps=warps,
                           ms=ms, gbps=kv_bytes / ms / 1e6)
        mine = [r for r in ctx.report.data["rows"] if r.get("kind") == "sweep" and (r["B"], r["ctx"]) == (b, ctx_len)]
        best = min(mine, key=lambda r: r["ms"])
        ctx.report.log(f"  sweep B={b:<3} ctx={ctx_len:<6} best: split={best['split']} segments={best['segments']} "
                       f"tile={best['tile']} warps={best['warps']} {best['ms'] * 1e3:.1f} us")
        ctx.report.save()


def row_kernels(ctx: Ctx) -> None:
    t = ctx.pick(7, 4096, 4096)
    h, inter, hd, hq, hkv = ctx.pick((96, 200, 32, 8, 2), (4096, 12288, 128, 32, 8), (4096, 12288, 128, 32, 8))
    el = torch.finfo(ctx.dtype).bits // 8
    dev, dt = ctx.device, ctx.dtype
    x, r, w = torch.randn(t, h, device=dev, dtype=dt), torch.randn(t, h, device=dev, dtype=dt), torch.randn(
        h, device=dev, dtype=dt)
    xx = torch.randn(t, 2 * inter, device=dev, dtype=dt)
    cache = reference_ops.rotary_cos_sin_cache(hd, 40960, 1e6, device=dev)
    pos = torch.randint(0, 40960, (t,), device=dev)
    q, k = torch.randn(t, hq, hd, device=dev, dtype=dt), torch.randn(t, hkv, hd, device=dev, dtype=dt)
    cases = [("rms_norm", lambda: norm.rms_norm(x, w, 1e-6), lambda: reference_ops.rms_norm(x, w, 1e-6), 2 * t * h),
             ("fused_add_rms_norm", lambda: norm.fused_add_rms_norm(x, r, w, 1e-6),
              lambda: reference_ops.fused_add_rms_norm(x, r, w, 1e-6), 4 * t * h),
             ("offset_rms_norm", lambda: norm.rms_norm(x, w, 1e-6, offset=True),
              lambda: reference_ops.rms_norm(x, w, 1e-6, offset=True), 2 * t * h),
             ("fused_add_offset_rms_norm", lambda: norm.fused_add_rms_norm(x, r, w, 1e-6, offset=True),
              lambda: reference_ops.fused_add_rms_norm(x, r, w, 1e-6, offset=True), 4 * t * h),
             ("rotary_neox", lambda: rotary.rotary_neox(pos, q, k, cache),
              lambda: reference_ops.rotary_neox(pos, q, k, cache), 2 * t * (hq + hkv) * hd),
             ("silu_and_mul", lambda: activation.silu_and_mul(xx), lambda: reference_ops.silu_and_mul(xx),
              3 * t * inter),
             ("gelu_tanh_and_mul", lambda: activation.gelu_tanh_and_mul(xx),
              lambda: reference_ops.gelu_tanh_and_mul(xx), 3 * t * inter)]
    for name, fn, ref_fn, elems in cases:
        ctx.deadline.check(f"op {name}", 1.0)
        ms, ref_ms = bench_ms(fn, rep=30), bench_ms(ref_fn, rep=30)
        row = ctx.report.row(kind="op", name=name, tokens=t, ms=ms, gbps=elems * el / ms / 1e6, torch_ms=ref_ms,
                             speedup=ref_ms / ms)
        ctx.report.log(f"  op {name:<25} {ms * 1e3:8.1f} us {row['gbps']:7.0f} GB/s ({row['speedup']:.1f}x torch)")
    ctx.report.save()


def run(ctx: Ctx) -> None:
    decode(ctx)
    prefill(ctx)
    row_kernels(ctx)
    sweep(ctx)
