#!/usr/bin/env python
"""One-shot GPU check of Ember's Triton kernels: correctness in bf16 against the torch references, then timings.

Run on a GPU (about 4-6 minutes on an H200):

    pip install --no-deps --no-build-isolation -e .
    PYTHONUNBUFFERED=1 timeout 420 python benchmarks/gpu_check.py --out /some/dir

or on a CPU, to check that it runs at all (tiny shapes, Triton interpreter, fp16): ``python benchmarks/gpu_check.py
--smoke``. Writes ``gpu_check.json`` and ``gpu_check.log`` into ``--out`` (default: the current directory) after
every section, and prints a short table last. Imports only torch, triton, numpy and Ember's engine/kernels.

Sections: environment and the measured device-to-device copy rate and bf16 matmul rate (the denominators); kernel
correctness (relative error, poisoned outputs) for reshape_and_cache (bf16, FP8), paged attention (prefill, mixed
chunked prefill + decode, decode with split-KV on and off, GQA 4/8, FP8 KV) and the row kernels; decode attention
bandwidth for (B, ctx) in {1, 8, 64} x {1k, 4k, 16k} with 32 q / 8 kv heads, hd 128, against SDPA on contiguous
K/V; a tile/segment sweep; a 4k prefill against causal SDPA; the row kernels' bandwidth; a CUDA-graph decode check;
and end-to-end decode tokens/s of a random-weight Qwen3-8B-shaped model at batch 1, 32, 128 if the engine exists.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit module is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # noqa: E402

from ember.kernels import activation, attention, norm, reference, reference_ops, rotary  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float16  # the interpreter's bf16 tl.dot is broken
TOL = 1e-2 if DTYPE == torch.bfloat16 else 2e-3
START = time.time()


class Report:
    """Results as JSON plus a log, both rewritten after every section so a timeout still leaves data."""

    def __init__(self, out: Path, name: str = "gpu_check",
                 sections: tuple[str, ...] = ("checks", "decode", "decode_sweep", "prefill", "ops", "graphs", "e2e",
                                              "errors")) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.json_path = out / f"{name}.json"
        self.log_file = open(out / f"{name}.log", "w")
        self.data: dict = {key: [] for key in sections}

    def log(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.time() - START, 1)
        self.json_path.write_text(json.dumps(self.data, indent=1, default=str))


def bench_ms(fn, rep: int = 100, warmup: int = 25) -> float:
    """Median milliseconds per call: ``triton.testing.do_bench`` on a GPU, one timed call otherwise."""
    if CUDA:
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def paged_batch(specs, hq, hkv, d, *, dtype=None, cache_dtype=None, block=16, seed=0, shuffle=True):
    """Random q and paged K/V for (context_len, query_len) per sequence; blocks scattered through the cache."""
    dtype = dtype or DTYPE
    g = torch.Generator(device="cpu").manual_seed(seed)
    need = [(c + q + block - 1) // block for c, q in specs]
    nb = sum(need) + 1
    max_blocks = max(need)
    k_cache = torch.randn(nb, block, hkv, d, device=DEV, dtype=dtype)
    v_cache = torch.randn(nb, block, hkv, d, device=DEV, dtype=dtype)
    if cache_dtype is not None:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    perm = torch.randperm(nb, generator=g) if shuffle else torch.arange(nb)
    table = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n].int()
        used += n
    cu = torch.zeros(len(specs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([q for _, q in specs]), 0)
    seq_lens = torch.tensor([c + q for c, q in specs], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, device=DEV, dtype=dtype)
    return q, k_cache, v_cache, cu.to(DEV), seq_lens.to(DEV), table.to(DEV)


# --------------------------------------------------------------------------------------------------------------------


def section_env(rep: Report, smoke: bool) -> None:
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "numpy": np.__version__, "device": torch.cuda.get_device_name() if CUDA else "cpu (interpreter)",
           "dtype": str(DTYPE), "smoke": smoke}
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        env["sm_count"] = props.multi_processor_count
        env["capability"] = list(torch.cuda.get_device_capability())
        env["memory_gib"] = round(props.total_memory / 2**30, 1)
    rep.data["env"] = env
    rep.log("env:", json.dumps(env))
    nbytes = (2 << 30) if CUDA and not smoke else (4 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    rep.data["copy_gbps"] = 2 * nbytes / ms / 1e6
    del src, dst
    n = 8192 if CUDA and not smoke else 128
    a = torch.randn(n, n, device=DEV, dtype=DTYPE)
    b = torch.randn(n, n, device=DEV, dtype=DTYPE)
    ms = bench_ms(lambda: a @ b)
    rep.data["matmul_tflops"] = 2 * n**3 / ms / 1e9
    rep.log(f"copy {rep.data['copy_gbps']:.0f} GB/s (read+write), {DTYPE} matmul {n}^3 {rep.data['matmul_tflops']:.1f} TFLOP/s")
    del a, b


def _check(rep: Report, name: str, out: torch.Tensor, ref: torch.Tensor, tol: float = TOL, **extra) -> None:
    nan_free = not out.isnan().any().item()
    err = rel_err(out, ref) if nan_free else float("nan")
    ok = nan_free and err < tol
    rep.data["checks"].append({"name": name, "rel_err": err, "max_abs": (out.float() - ref.float()).abs().max().item(),
                               "nan_free": nan_free, "tol": tol, "ok": ok, **extra})
    rep.log(f"check {name:<44} rel_err {err:.2e} {'ok' if ok else 'FAIL'}")


def section_correctness(rep: Report, smoke: bool) -> None:
    hd = 64 if smoke else 128
    ctx = [(3, 1), (37, 1), (20, 1)] if smoke else [(3, 1), (1000, 1), (4100, 1), (77, 1)]
    mixed = [(21, 13), (37, 1), (0, 0), (0, 17), (5, 1)] if smoke else [(500, 300), (2000, 1), (0, 0), (0, 777), (45, 1)]
    prefill = [(0, 23), (0, 9)] if smoke else [(0, 2048), (0, 333)]
    g4, g8 = ((8, 2), (8, 1)) if smoke else ((32, 8), (32, 4))
    cases = [("prefill gqa4", prefill, g4, None), ("mixed chunked+prefix+decode gqa4", mixed, g4, None),
             ("mixed gqa8", mixed, g8, None), ("decode gqa4 2d", ctx, g4, False),
             ("decode gqa4 split", ctx, g4, True), ("decode gqa8 2d", ctx, g8, False),
             ("decode gqa8 split", ctx, g8, True)]
    for name, specs, (hq, hkv), split in cases:
        q, kc, vc, cu, sl, bt = paged_batch(specs, hq, hkv, hd, seed=len(name))
        mq = max(x for _, x in specs)
        mk = int(sl.max())
        ref = torch.zeros_like(q)
        reference.paged_attention(q, kc, vc, ref, cu, sl, bt, mq, mk, hd ** -0.5)
        out = torch.full_like(q, float("nan"))
        attention.paged_attention(q, kc, vc, out, cu, sl, bt, mq, mk, hd ** -0.5, split_kv=split)
        _check(rep, f"attention {name} hd{hd}", out, ref)
    for split in (False, True):
        specs = ctx if split else mixed
        q, kc, vc, cu, sl, bt = paged_batch(specs, 8, 2, hd, cache_dtype=torch.float8_e4m3fn, seed=9)
        mq = max(x for _, x in specs)
        ref = torch.zeros_like(q)
        reference.paged_attention(q, kc, vc, ref, cu, sl, bt, mq, int(sl.max()), hd ** -0.5, 0.05, 0.3)
        out = torch.full_like(q, float("nan"))
        attention.paged_attention(q, kc, vc, out, cu, sl, bt, mq, int(sl.max()), hd ** -0.5, 0.05, 0.3,
                                  split_kv=split)
        _check(rep, f"attention fp8-kv {'split' if split else 'mixed'} hd{hd}", out, ref)

    # KV writes: exact against the reference, padding slots untouched
    for cache_dtype, scale in ((DTYPE, None), (torch.float8_e4m3fn, 0.04)):
        t, hkv = (9, 2) if smoke else (4096, 8)
        key = torch.randn(t, hkv, hd, device=DEV, dtype=DTYPE)
        value = torch.randn(t, hkv, hd, device=DEV, dtype=DTYPE)
        if scale is not None and not CUDA:
            # the interpreter's fp32->fp8 cast misrounds near binade edges: feed it values exact in e4m3
            key = (key.float() / scale).to(cache_dtype).float().mul(scale).to(DTYPE)
            value = (value.float() / scale).to(cache_dtype).float().mul(scale).to(DTYPE)
        nb = (2 * t) // 16 + 1
        slots = torch.randperm(nb * 16, device=DEV)[:t]
        slots[::3] = -1
        kc = torch.randn(nb, 16, hkv, hd, device=DEV, dtype=DTYPE).to(cache_dtype)
        vc = torch.randn(nb, 16, hkv, hd, device=DEV, dtype=DTYPE).to(cache_dtype)
        kr, vr = kc.clone(), vc.clone()
        reference.reshape_and_cache(key, value, kr, vr, slots, scale, scale)
        attention.reshape_and_cache(key, value, kc, vc, slots, scale, scale)
        mismatched = int((kc.view(torch.uint8) != kr.view(torch.uint8)).sum() + (vc.view(torch.uint8) != vr.view(torch.uint8)).sum())
        _check(rep, f"reshape_and_cache {str(cache_dtype).removeprefix('torch.')}", kc.float(), kr.float(),
               mismatched_bytes=mismatched)

    t = 7 if smoke else 4096
    h = 96 if smoke else 4096
    x = torch.randn(t, h, device=DEV, dtype=DTYPE)
    r = torch.randn(t, h, device=DEV, dtype=DTYPE)
    w = torch.randn(h, device=DEV, dtype=DTYPE)
    _check(rep, "rms_norm", norm.rms_norm(x, w, 1e-6), reference_ops.rms_norm(x, w, 1e-6))
    o, nr = norm.fused_add_rms_norm(x, r, w, 1e-6)
    ro, rr = reference_ops.fused_add_rms_norm(x, r, w, 1e-6)
    _check(rep, "fused_add_rms_norm (out)", o, ro)
    _check(rep, "fused_add_rms_norm (residual)", nr, rr)
    hq, hkv = (8, 2) if smoke else (32, 8)
    cache = reference_ops.rotary_cos_sin_cache(hd, 40960, 1e6, device=DEV)
    pos = torch.randint(0, 40960, (t,), device=DEV)
    qkv = torch.randn(t, hq + 2 * hkv, hd, device=DEV, dtype=DTYPE)
    qq, kk = qkv[:, :hq], qkv[:, hq:hq + hkv]
    got_q, got_k = rotary.rotary_neox(pos, qq, kk, cache)
    ref_q, ref_k = reference_ops.rotary_neox(pos, qq, kk, cache)
    _check(rep, "rotary_neox q", got_q, ref_q)
    _check(rep, "rotary_neox k", got_k, ref_k)
    inter = 200 if smoke else 12288
    xx = torch.randn(t, 2 * inter, device=DEV, dtype=DTYPE)
    _check(rep, "silu_and_mul", activation.silu_and_mul(xx), reference_ops.silu_and_mul(xx))


def section_decode(rep: Report, smoke: bool) -> None:
    hq, hkv, hd = (8, 2, 64) if smoke else (32, 8, 128)
    shapes = [(1, 40), (2, 70)] if smoke else [(b, c) for b in (1, 8, 64) for c in (1024, 4096, 16384)]
    copy = rep.data.get("copy_gbps") or float("nan")
    for b, ctx in shapes:
        q, kc, vc, cu, sl, bt = paged_batch([(ctx - 1, 1)] * b, hq, hkv, hd, seed=b + ctx)
        out = torch.empty_like(q)
        kv_bytes = 2 * b * ctx * hkv * hd * kc.element_size()
        split = b * hkv <= attention.SPLIT_KV_MAX_PROGRAMS
        ms = bench_ms(lambda: attention.paged_attention(q, kc, vc, out, cu, sl, bt, 1, ctx, hd ** -0.5))
        row = {"B": b, "ctx": ctx, "path": "split-kv" if split else "2d", "ms": ms, "gbps": kv_bytes / ms / 1e6}
        row["frac_copy"] = row["gbps"] / copy
        # the same KV, contiguous, through torch's SDPA
        k = torch.randn(b, hkv, ctx, hd, device=DEV, dtype=DTYPE)
        v = torch.randn(b, hkv, ctx, hd, device=DEV, dtype=DTYPE)
        qs = q.view(b, hq, 1, hd)
        try:
            sdpa = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True))
            row["sdpa_ms"], row["sdpa_gbps"] = sdpa, kv_bytes / sdpa / 1e6
        except Exception as e:  # an SDPA without enable_gqa on this torch
            row["sdpa_error"] = repr(e)
        rep.data["decode"].append(row)
        rep.log(f"decode B={b:<3} ctx={ctx:<6} {row['path']:<8} {ms * 1e3:8.1f} us {row['gbps']:7.0f} GB/s "
                f"({100 * row['frac_copy']:.0f}% of copy)  sdpa {row.get('sdpa_gbps', float('nan')):7.0f} GB/s")
        del q, kc, vc, k, v
        rep.save()


def section_decode_sweep(rep: Report, smoke: bool) -> None:
    """Tile size, split and segment count at two decode shapes, to tune the defaults."""
    hq, hkv, hd = (8, 2, 64) if smoke else (32, 8, 128)
    shapes = [(2, 70)] if smoke else [(64, 4096), (1, 16384), (8, 4096)]
    variants = [(False, None, 16), (False, None, 32), (False, None, 64), (True, 8, 16), (True, 16, 16),
                (True, 16, 32), (True, 32, 32)]
    if smoke:
        variants = variants[:2] + variants[3:4]
    for b, ctx in shapes:
        q, kc, vc, cu, sl, bt = paged_batch([(ctx - 1, 1)] * b, hq, hkv, hd, seed=ctx)
        out = torch.empty_like(q)
        kv_bytes = 2 * b * ctx * hkv * hd * kc.element_size()
        for split, segs, tile in variants:
            ms = bench_ms(lambda: attention.paged_attention(q, kc, vc, out, cu, sl, bt, 1, ctx, hd ** -0.5,
                                                            split_kv=split, num_segments=segs, tile_size=tile))
            row = {"B": b, "ctx": ctx, "split": split, "segments": segs, "tile": tile, "ms": ms,
                   "gbps": kv_bytes / ms / 1e6}
            rep.data["decode_sweep"].append(row)
            rep.log(f"sweep B={b:<3} ctx={ctx:<6} split={split!s:<5} segs={segs!s:<4} tile={tile:<3} "
                    f"{ms * 1e3:8.1f} us {row['gbps']:7.0f} GB/s")
        rep.save()


def section_prefill(rep: Report, smoke: bool) -> None:
    hq, hkv, hd = (8, 2, 64) if smoke else (32, 8, 128)
    s = 40 if smoke else 4096
    q, kc, vc, cu, sl, bt = paged_batch([(0, s)], hq, hkv, hd, seed=1, shuffle=False)
    out = torch.empty_like(q)
    flops = 2 * s * s * hq * hd  # causal: half of 4*s^2*hq*hd
    variants = [(None, None), (64, 32), (128, 32), (128, 64)] if not smoke else [(None, None), (32, 16)]
    for bm, tile in variants:
        ms = bench_ms(lambda: attention.paged_attention(q, kc, vc, out, cu, sl, bt, s, s, hd ** -0.5,
                                                        block_m=bm, tile_size=tile), rep=50)
        row = {"seq": s, "block_m": bm, "tile": tile, "ms": ms, "tflops": flops / ms / 1e9}
        rep.data["prefill"].append(row)
        rep.log(f"prefill {s} block_m={bm!s:<4} tile={tile!s:<4} {ms:8.3f} ms {row['tflops']:6.1f} TFLOP/s")
    k = kc.view(-1, hkv, hd)[:s].transpose(0, 1).unsqueeze(0).contiguous()
    v = vc.view(-1, hkv, hd)[:s].transpose(0, 1).unsqueeze(0).contiguous()
    qs = q.transpose(0, 1).unsqueeze(0).contiguous()
    try:
        ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, is_causal=True,
                                                                               enable_gqa=True), rep=50)
        rep.data["prefill"].append({"seq": s, "sdpa": True, "ms": ms, "tflops": flops / ms / 1e9})
        rep.log(f"prefill {s} sdpa causal          {ms:8.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s")
    except Exception as e:
        rep.data["errors"].append(f"prefill sdpa: {e!r}")
    rep.save()


def section_ops(rep: Report, smoke: bool) -> None:
    t = 7 if smoke else 4096
    h, inter, hd, hq, hkv = (96, 200, 64, 8, 2) if smoke else (4096, 12288, 128, 32, 8)
    el = torch.finfo(DTYPE).bits // 8
    x = torch.randn(t, h, device=DEV, dtype=DTYPE)
    r = torch.randn(t, h, device=DEV, dtype=DTYPE)
    w = torch.randn(h, device=DEV, dtype=DTYPE)
    xx = torch.randn(t, 2 * inter, device=DEV, dtype=DTYPE)
    cache = reference_ops.rotary_cos_sin_cache(hd, 40960, 1e6, device=DEV)
    pos = torch.randint(0, 40960, (t,), device=DEV)
    q = torch.randn(t, hq, hd, device=DEV, dtype=DTYPE)
    k = torch.randn(t, hkv, hd, device=DEV, dtype=DTYPE)
    cases = [
        ("rms_norm", lambda: norm.rms_norm(x, w, 1e-6), lambda: reference_ops.rms_norm(x, w, 1e-6), 2 * t * h * el),
        ("fused_add_rms_norm", lambda: norm.fused_add_rms_norm(x, r, w, 1e-6),
         lambda: reference_ops.fused_add_rms_norm(x, r, w, 1e-6), 4 * t * h * el),
        ("rotary_neox", lambda: rotary.rotary_neox(pos, q, k, cache),
         lambda: reference_ops.rotary_neox(pos, q, k, cache), 2 * t * (hq + hkv) * hd * el),
        ("silu_and_mul", lambda: activation.silu_and_mul(xx), lambda: reference_ops.silu_and_mul(xx),
         3 * t * inter * el),
    ]
    for name, fn, ref_fn, nbytes in cases:
        ms = bench_ms(fn)
        ref_ms = bench_ms(ref_fn)
        row = {"name": name, "tokens": t, "ms": ms, "gbps": nbytes / ms / 1e6, "torch_ms": ref_ms}
        rep.data["ops"].append(row)
        rep.log(f"op {name:<20} {ms * 1e3:8.1f} us {row['gbps']:7.0f} GB/s  (torch reference {ref_ms * 1e3:8.1f} us)")
    rep.save()


QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)
QWEN3_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32)


def _random_model(cfg, max_position: int):
    """The engine's model class for ``cfg`` with random weights, built directly on the device (no checkpoint IO)."""
    from ember.engine.models import get_model_class

    with torch.device(DEV):
        model = get_model_class(cfg.architecture)(cfg, max_position).to(DTYPE)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
    if hasattr(model.rope, "build_cache"):
        model.rope.build_cache(DEV, DTYPE)
    return model.eval()


def _random_qwen3(smoke: bool):
    from ember.engine.config import ModelConfig

    cfg = ModelConfig(architecture="Qwen3ForCausalLM", model_type="qwen3", rms_norm_eps=1e-6, rope_theta=1e6,
                      rope_scaling=None, max_position_embeddings=40960, tie_word_embeddings=False,
                      **(QWEN3_TINY if smoke else QWEN3_8B))
    return cfg, _random_model(cfg, 4096)


def section_graphs(rep: Report, smoke: bool) -> None:
    """DecodeGraphRunner on the random model: padded replay equals eager, and what graphs save per step."""
    from ember.engine.attention import AttentionMetadata
    from ember.engine.cuda_graphs import DecodeGraphRunner

    cfg, model = _random_qwen3(smoke)
    backend = attention
    ctx, bs = (40, 16) if smoke else (1024, 16)
    batches = (1, 3) if smoke else (1, 32, 100)
    max_seqs = 4 if smoke else 128  # B=3 (smoke) and B=100 replay a padded graph
    blocks_per_seq = (ctx + 1 + bs - 1) // bs
    nb = max_seqs * blocks_per_seq + 1
    kv = [(torch.randn(nb, bs, cfg.num_key_value_heads, cfg.head_dim, device=DEV, dtype=DTYPE) * 0.5,
           torch.randn(nb, bs, cfg.num_key_value_heads, cfg.head_dim, device=DEV, dtype=DTYPE) * 0.5)
          for _ in range(cfg.num_hidden_layers)]

    def forward(ids, meta):
        return model.compute_logits(model(ids, meta, kv, backend))

    def meta_for(n):
        table = torch.arange(n * blocks_per_seq, device=DEV, dtype=torch.int32).view(n, blocks_per_seq) + 1
        sl = torch.full((n,), ctx + 1, device=DEV, dtype=torch.int32)
        pos = torch.full((n,), ctx, device=DEV, dtype=torch.int64)
        slots = table[:, ctx // bs].long() * bs + ctx % bs
        return AttentionMetadata(torch.arange(n + 1, device=DEV, dtype=torch.int32), sl, table, slots, pos,
                                 torch.arange(n, device=DEV), 1, ctx + 1)

    t0 = time.time()
    runner = DecodeGraphRunner(forward, max_num_seqs=max_seqs, max_blocks_per_seq=blocks_per_seq,
                               max_seqlen_k=ctx + 1, device=DEV)
    with torch.inference_mode():
        runner.capture()
        rep.data["graphs_capture_s"] = time.time() - t0
        for n in batches:
            ids = torch.randint(0, cfg.vocab_size, (n,), device=DEV)
            meta = meta_for(n)
            eager = forward(ids, meta)
            graph = runner.run(ids, meta).clone()
            size = runner.padded_size(n)
            # the same padded shapes eagerly: must match the replay; the unpadded eager forward differs only by
            # GEMM algorithm choices for another M, so it gets a looser bound
            same_shape = forward(*runner.static_inputs(size))[:n]
            err_same = rel_err(graph, same_shape)
            err = rel_err(graph, eager)
            eager_ms = bench_ms(lambda: forward(ids, meta), rep=30)
            graph_ms = bench_ms(lambda: runner.run(ids, meta), rep=30)
            row = {"B": n, "padded_to": size, "rel_err_vs_same_shape_eager": err_same, "rel_err_vs_eager": err,
                   "eager_ms": eager_ms, "graph_ms": graph_ms, "graph_tok_s": n / graph_ms * 1e3,
                   "ok": err_same < 1e-3 and err < 5 * TOL}
            rep.data["graphs"].append(row)
            rep.log(f"graphs B={n:<3} (padded {row['padded_to']:<3}) rel_err {err_same:.1e} / {err:.1e} "
                    f"eager {eager_ms:7.2f} ms graph {graph_ms:7.2f} ms  -> {row['graph_tok_s']:8.0f} tok/s (forward only, ctx {ctx})")
    rep.log(f"graphs captured {len(runner.sizes)} sizes in {rep.data['graphs_capture_s']:.1f} s")
    del runner, kv, model
    if CUDA:
        torch.cuda.empty_cache()
    rep.save()


def section_e2e(rep: Report, smoke: bool, deadline: float) -> None:
    """Decode tokens/s through ``ember.engine.engine.Engine`` at B = 1, 32, 128 (random 8B-shaped weights).

    The checkpoint directory holds the demo tokenizer and an 8B-shaped config.json; the engine's ``load_model`` is
    swapped for one that builds random weights on the device, which skips writing and reading 16 GB of safetensors.
    """
    try:
        from ember.engine import demo
        from ember.engine import engine as engine_mod
        from ember.engine.params import SamplingParams
    except ImportError as e:
        rep.data["e2e_skipped"] = f"no engine: {e}"
        rep.log("e2e skipped:", rep.data["e2e_skipped"])
        return
    import tempfile

    if not CUDA:
        os.environ["EMBER_ATTENTION"] = "triton"  # exercise the Triton path under the interpreter too
    batches, prompt_len, max_tokens = ((1, 2), 20, 3) if smoke else ((1, 32, 128), 128, 64)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(demo.build(Path(tmp) / "model"))
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        tok_vocab = cfg["vocab_size"]
        cfg.update(QWEN3_TINY if smoke else QWEN3_8B)
        cfg["vocab_size"] = max(cfg["vocab_size"], tok_vocab)
        cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", max_position_embeddings=40960,
                   tie_word_embeddings=False, torch_dtype=str(DTYPE).removeprefix("torch."))
        cfg_path.write_text(json.dumps(cfg))
        real_load = engine_mod.load_model
        engine_mod.load_model = lambda model_dir, mc, max_position, device, dtype: _random_model(mc, max_position)
        try:
            t0 = time.time()
            eng = engine_mod.Engine.from_pretrained(
                path, max_num_seqs=max(batches), max_num_batched_tokens=8192, max_model_len=1024,
                kv_cache_memory=(20 << 30) if CUDA else (64 << 20), dtype=DTYPE, device=DEV)
            rep.data["e2e_load_s"] = time.time() - t0
        finally:
            engine_mod.load_model = real_load
        g = torch.Generator().manual_seed(0)
        for b in batches:
            if time.time() > deadline:
                rep.data["errors"].append(f"e2e B={b}: skipped, out of time")
                break
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for _ in range(b):
                eng.add_request(torch.randint(0, min(tok_vocab, cfg["vocab_size"]), (prompt_len,), generator=g).tolist(),
                                params)
            decode_tokens = 0
            decode_s = 0.0
            steps = 0
            started: set[str] = set()
            while eng.has_unfinished():
                all_decoding = len(started) == b  # every prompt is in: this step is decode only
                t = time.perf_counter()
                outs = eng.step()
                dt = time.perf_counter() - t
                steps += 1
                started.update(o.request_id for o in outs if o.new_token_ids)
                if all_decoding:
                    decode_tokens += sum(len(o.new_token_ids) for o in outs)
                    decode_s += dt
            row = {"B": b, "prompt_len": prompt_len, "max_tokens": max_tokens, "steps": steps,
                   "decode_tokens": decode_tokens, "decode_s": decode_s,
                   "tok_s": decode_tokens / decode_s if decode_s else float("nan")}
            rep.data["e2e"].append(row)
            rep.log(f"e2e B={b:<4} {row['tok_s']:9.1f} decode tok/s ({decode_tokens} tokens in {decode_s:.2f} s)")
            rep.save()
        del eng


def section_moe(rep: Report, smoke: bool) -> None:
    """The NVFP4 / fused-MoE section (`benchmarks/gpu_check_moe.py`) on the same report."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_check_moe

    gpu_check_moe.run(rep, smoke)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path.cwd())
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on a CPU under the Triton interpreter")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip later sections past this many seconds")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip")
    args = ap.parse_args()
    rep = Report(args.out)
    skip = set(filter(None, args.skip.split(",")))
    sections = [("env", section_env), ("correctness", section_correctness), ("decode", section_decode),
                ("prefill", section_prefill), ("ops", section_ops), ("sweep", section_decode_sweep),
                ("graphs", section_graphs), ("moe", section_moe),
                ("e2e", lambda r, s: section_e2e(r, s, START + args.budget_s))]
    for name, fn in sections:
        if name in skip:
            continue
        if time.time() - START > args.budget_s:
            rep.data["errors"].append(f"{name}: skipped, over the {args.budget_s:.0f} s budget")
            rep.log(f"section {name} skipped (budget)")
            continue
        rep.log(f"== {name} ({time.time() - START:.0f} s)")
        try:
            fn(rep, args.smoke)
        except Exception:
            rep.data["errors"].append(f"{name}: {traceback.format_exc()}")
            rep.log(f"section {name} FAILED:\n{traceback.format_exc()}")
        rep.save()
        if CUDA:
            torch.cuda.empty_cache()
    forbidden = sorted({m.split(".")[0] for m in sys.modules} & {"llguidance", "fastapi", "uvicorn"})
    if forbidden:  # the GPU image lacks them: an import here would break the check there
        rep.data["errors"].append(f"imported {forbidden}, which the GPU image does not have")
    print_table(rep)
    if rep.data.get("moe"):
        import gpu_check_moe

        gpu_check_moe.print_table(rep)
    rep.save()
    failed = [c["name"] for c in rep.data["checks"] if not c["ok"]] + \
        [f"graphs B={g['B']}" for g in rep.data["graphs"] if not g["ok"]]
    return 1 if failed or rep.data["errors"] else 0


def print_table(rep: Report) -> None:
    d = rep.data
    lines = ["", "=" * 78, f"Ember gpu_check on {d.get('env', {}).get('device')}  ({d.get('elapsed_s', 0)} s)",
             f"copy {d.get('copy_gbps', float('nan')):.0f} GB/s   matmul {d.get('matmul_tflops', float('nan')):.1f} TFLOP/s",
             f"checks: {sum(c['ok'] for c in d['checks'])}/{len(d['checks'])} ok; worst rel_err "
             f"{max((c['rel_err'] for c in d['checks']), default=float('nan')):.1e}"]
    lines += [f"  FAIL {c['name']}: {c['rel_err']:.2e}" for c in d["checks"] if not c["ok"]]
    lines.append(f"{'decode B':>9} {'ctx':>6} {'path':>8} {'us':>9} {'GB/s':>7} {'%copy':>6} {'sdpa GB/s':>10}")
    for r in d["decode"]:
        lines.append(f"{r['B']:>9} {r['ctx']:>6} {r['path']:>8} {r['ms'] * 1e3:>9.1f} {r['gbps']:>7.0f} "
                     f"{100 * r['frac_copy']:>6.0f} {r.get('sdpa_gbps', float('nan')):>10.0f}")
    for r in d["prefill"]:
        label = "sdpa" if r.get("sdpa") else f"bm={r['block_m']} tile={r['tile']}"
        lines.append(f"prefill {r['seq']} {label:<18} {r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s")
    for r in d["ops"]:
        lines.append(f"op {r['name']:<20} {r['gbps']:7.0f} GB/s  ({r['torch_ms'] / r['ms']:.1f}x torch)")
    for r in d["graphs"]:
        lines.append(f"graph decode B={r['B']:<4} {r['graph_ms']:7.2f} ms/step (eager {r['eager_ms']:.2f})")
    for r in d["e2e"]:
        lines.append(f"e2e decode B={r['B']:<4} {r['tok_s']:9.0f} tok/s")
    if d.get("e2e_skipped"):
        lines.append(f"e2e skipped: {d['e2e_skipped']}")
    lines += [f"ERROR {e.splitlines()[0] if e else e}" for e in d["errors"]]
    lines.append("=" * 78)
    for line in lines:
        rep.log(line)


if __name__ == "__main__":
    sys.exit(main())
