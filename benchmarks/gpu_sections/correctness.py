"""Section 1: every kernel against its torch reference on random inputs, by relative error (bf16 on a GPU, fp16 under
the interpreter): paged attention (prefill, mixed chunked prefill + cached prefix + decode, decode 2D and split-KV
incl. empty segments, GQA 4/8, FP8 KV, sliding window + sinks, soft-cap, chunked), ``reshape_and_cache`` (bf16, FP8;
padding slots untouched), RMSNorm, fused add+RMSNorm, Qwen3-Next's gated RMSNorm, rotary, the fused q/k-norm + RoPE +
KV write (with its decode time against the unfused chain's), SiLU-and-mul, Qwen3-Next's gated-delta decode (state in
place) and conv decode step, the fused MoE (bf16, NVFP4 W4A16, W4A4 where the device has it, MXFP4 with biases and
gpt-oss's clamped GLU), the MoE router and the dense NVFP4 linear. Outputs start as NaN, so an unwritten element
fails. Each check is isolated: one that raises is recorded with its traceback and the next one runs."""
from __future__ import annotations

import torch

from ember.kernels import activation, attention, norm, reference, reference_ops, rotary
from ember.kernels.qk_norm_rope_cache import qk_norm_rope_cache

from gpu_sections import moe_timing
from gpu_sections.common import Ctx, bench_ms, graph_ms, paged_batch


def _tol(ctx: Ctx) -> float:
    return 1e-2 if ctx.dtype == torch.bfloat16 else 2e-3


def _attention_case(ctx: Ctx, name: str, specs, hq: int, hkv: int, hd: int, *, cache_dtype=None, scales=(None, None),
                    seed: int = 0, window: int | None = None, sinks: bool = False, softcap: float | None = None,
                    chunk: int | None = None, **kernel_kw) -> None:
    with ctx.case(name):
        q, kc, vc, cu, sl, bt = paged_batch(specs, hq, hkv, hd, device=ctx.device, dtype=ctx.dtype,
                                            cache_dtype=cache_dtype, seed=seed)
        args = dict(cu_seqlens_q=cu, seq_lens=sl, block_table=bt, max_seqlen_q=max(x for _, x in specs),
                    max_seqlen_k=int(sl.max()), softmax_scale=hd ** -0.5, k_scale=scales[0], v_scale=scales[1])
        if window is not None:
            args["sliding_window"] = window
        if sinks:  # gpt-oss: one learned logit per query head joins each softmax
            args["sinks"] = torch.randn(hq, generator=torch.Generator().manual_seed(seed)).to(ctx.device, ctx.dtype)
        if chunk is not None:  # Llama 4: each query sees only its own chunk of positions
            args["chunk"] = chunk
        if softcap is not None:  # Gemma 2: scores of order 10 against the cap, so the tanh shapes every row
            args["softcap"] = softcap
            q.mul_(8)
        ref = torch.zeros_like(q)
        reference.paged_attention(q=q, k_cache=kc, v_cache=vc, out=ref, **args)
        out = torch.full_like(q, float("nan"))
        attention.paged_attention(q=q, k_cache=kc, v_cache=vc, out=out, **args, **kernel_kw)
        ctx.report.check(name, out, ref, _tol(ctx))


def attention_checks(ctx: Ctx) -> None:
    hd = ctx.pick(32, 128, 128)
    g4, g8 = ((8, 2), (8, 1)) if ctx.tiny else ((32, 8), (32, 4))
    decode = ctx.pick([(3, 1), (37, 1), (20, 1)], [(3, 1), (1000, 1), (4100, 1), (77, 1)],
                      [(3, 1), (1000, 1), (4100, 1), (77, 1), (16383, 1)])
    mixed = ctx.pick([(21, 13), (37, 1), (0, 0), (0, 17), (5, 1)], [(500, 300), (2000, 1), (0, 0), (0, 777), (45, 1)],
                     [(500, 300), (2000, 1), (0, 0), (0, 777), (45, 1), (4096, 64)])
    prefill = ctx.pick([(0, 23), (0, 9)], [(0, 2048), (0, 333)], [(0, 2048), (0, 333)])
    cases = [("prefill gqa4", prefill, g4, {}),
             ("prefill gqa4 block_m=16", prefill, g4, {"block_m": 16}),  # the default is 64 on a GPU
             ("mixed chunked+prefix+decode gqa4", mixed, g4, {}),
             ("mixed gqa8", mixed, g8, {}),
             ("decode gqa4 2d", decode, g4, {"split_kv": False}),
             ("decode gqa4 split-kv", decode, g4, {"split_kv": True}),
             ("decode gqa8 split-kv", decode, g8, {"split_kv": True}),
             ("decode gqa8 2d", decode, g8, {"split_kv": False}),
             # one long and many 1-token sequences: most split-KV segments are empty (max -inf, sum 0)
             ("decode split-kv empty segments", [(1, 1)] * 5 + [(decode[-1][0], 1)], g4,
              {"split_kv": True, "num_segments": 16})]
    if ctx.quick:  # one case per kernel specialization the engine uses most
        cases = [c for c in cases if c[0] in ("mixed chunked+prefix+decode gqa4", "decode gqa4 split-kv",
                                              "decode gqa8 2d", "decode split-kv empty segments")]
    for i, (name, specs, (hq, hkv), kw) in enumerate(cases):
        _attention_case(ctx, f"attention {name} hd{hd}", specs, hq, hkv, hd, seed=i, **kw)
    window = ctx.pick(16, 256, 256)
    _attention_case(ctx, f"attention mixed window={window}+sinks hd{hd}", mixed, *g4, hd, seed=13, window=window,
                    sinks=True, split_kv=False)
    _attention_case(ctx, f"attention decode split-kv window={window}+sinks hd{hd}", decode, *g8, hd, seed=14,
                    window=window, sinks=True, split_kv=True)
    _attention_case(ctx, f"attention mixed window={window}+softcap hd{hd}", mixed, *g4, hd, seed=15, window=window,
                    softcap=4.0, split_kv=False)
    _attention_case(ctx, f"attention decode split-kv softcap hd{hd}", decode, *g8, hd, seed=16, softcap=4.0,
                    split_kv=True)
    chunk = ctx.pick(16, 1024, 1024)
    _attention_case(ctx, f"attention mixed chunk={chunk} hd{hd}", mixed, *g4, hd, seed=17, chunk=chunk, split_kv=False)
    _attention_case(ctx, f"attention decode split-kv chunk={chunk} hd{hd}", decode, *g8, hd, seed=18, chunk=chunk,
                    split_kv=True)
    fp8 = torch.float8_e4m3fn
    _attention_case(ctx, f"attention fp8-kv mixed hd{hd}", mixed, *g4, hd, cache_dtype=fp8, scales=(0.05, 0.3),
                    seed=11, split_kv=False)
    _attention_case(ctx, f"attention fp8-kv decode split-kv hd{hd}", decode, *g4, hd, cache_dtype=fp8,
                    scales=(0.05, 0.3), seed=12, split_kv=True)


def kv_write_checks(ctx: Ctx) -> None:
    hd = ctx.pick(32, 128, 128)
    t, hkv = ctx.pick((9, 2), (4096, 8), (4096, 8))
    for cache_dtype, scale in ((ctx.dtype, None), (torch.float8_e4m3fn, 0.04)):
        name = f"reshape_and_cache {str(cache_dtype).removeprefix('torch.')}"
        with ctx.case(name):
            g = torch.Generator().manual_seed(3)
            key = torch.randn(t, hkv, hd, generator=g).to(ctx.device, ctx.dtype)
            value = torch.randn(t, hkv, hd, generator=g).to(ctx.device, ctx.dtype)
            if scale is not None and not ctx.cuda:
                # the interpreter's fp32->fp8 cast misrounds near binade edges: feed it values exact in e4m3
                key = (key.float() / scale).to(cache_dtype).float().mul(scale).to(ctx.dtype)
                value = (value.float() / scale).to(cache_dtype).float().mul(scale).to(ctx.dtype)
            nb = (2 * t) // 16 + 1
            slots = torch.randperm(nb * 16, generator=g)[:t].to(ctx.device)
            slots[::3] = -1  # padding rows write nothing
            kc = torch.randn(nb, 16, hkv, hd, generator=g).to(ctx.device, ctx.dtype).to(cache_dtype)
            vc = torch.randn(nb, 16, hkv, hd, generator=g).to(ctx.device, ctx.dtype).to(cache_dtype)
            kr, vr = kc.clone(), vc.clone()
            reference.reshape_and_cache(key=key, value=value, k_cache=kr, v_cache=vr, slot_mapping=slots,
                                        k_scale=scale, v_scale=scale)
            attention.reshape_and_cache(key=key, value=value, k_cache=kc, v_cache=vc, slot_mapping=slots,
                                        k_scale=scale, v_scale=scale)
            bad = int((kc.view(torch.uint8) != kr.view(torch.uint8)).sum() + (vc.view(torch.uint8) != vr.view(
                torch.uint8)).sum())
            ctx.report.add_check(name, bad == 0, mismatched_bytes=bad, tokens=t)


def row_kernel_checks(ctx: Ctx) -> None:
    tol = _tol(ctx)
    t, h, inter = ctx.pick((7, 96, 200), (4096, 4096, 12288), (4096, 4096, 12288))
    hd, hq, hkv = ctx.pick((32, 8, 2), (128, 32, 8), (128, 32, 8))
    g = torch.Generator(device=ctx.device).manual_seed(5)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=ctx.device).to(ctx.dtype)

    x, r, w = rnd(t, h), rnd(t, h), rnd(h)
    with ctx.case("rms_norm"):
        ctx.report.check("rms_norm", norm.rms_norm(x, w, 1e-6), reference_ops.rms_norm(x, w, 1e-6), tol)
    with ctx.case("fused_add_rms_norm"):
        out, res = norm.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
        ref_out, ref_res = reference_ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
        ctx.report.check("fused_add_rms_norm (out)", out, ref_out, tol)
        ctx.report.check("fused_add_rms_norm (residual)", res, ref_res, tol)
    with ctx.case("offset_rms_norm"):  # zero-centred (Gemma, Qwen3-Next): the weight applies as 1 + w
        ctx.report.check("offset_rms_norm", norm.rms_norm(x, w, 1e-6, offset=True),
                         reference_ops.rms_norm(x, w, 1e-6, offset=True), tol)
    with ctx.case("fused_add_offset_rms_norm"):
        out, res = norm.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6, offset=True)
        ref_out, ref_res = reference_ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6, offset=True)
        ctx.report.check("fused_add_offset_rms_norm (out)", out, ref_out, tol)
        ctx.report.check("fused_add_offset_rms_norm (residual)", res, ref_res, tol)
    with ctx.case("gated_rms_norm"):  # Qwen3-Next's: the delta rule's float32 output, gated by silu(z)
        core, z = rnd(t, hd).float() * 3, rnd(t, hd)
        ctx.report.check("gated_rms_norm", norm.gated_rms_norm(core, z, w[:hd], 1e-6),
                         reference_ops.gated_rms_norm(core, z, w[:hd], 1e-6), tol)
    with ctx.case("rotary_neox"):
        cache = reference_ops.rotary_cos_sin_cache(hd, 40960, 1e6, device=ctx.device)
        pos = torch.randint(0, 40960, (t,), generator=g, device=ctx.device)
        qkv = rnd(t, hq + 2 * hkv, hd)  # q and k as strided views of a fused qkv output, as the model passes them
        q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
        got_q, got_k = rotary.rotary_neox(pos, q, k, cache)
        ref_q, ref_k = reference_ops.rotary_neox(pos, q, k, cache)
        ctx.report.check("rotary_neox q", got_q, ref_q, tol)
        ctx.report.check("rotary_neox k", got_k, ref_k, tol)
    prologue_checks(ctx, t, hq, hkv, hd, rnd, tol)
    with ctx.case("silu_and_mul"):
        xx = rnd(t, 2 * inter)
        ctx.report.check("silu_and_mul", activation.silu_and_mul(xx), reference_ops.silu_and_mul(xx), tol)
    with ctx.case("gelu_tanh_and_mul"):
        xx = rnd(t, 2 * inter) * 3  # well into the tanh's saturation both ways
        ctx.report.check("gelu_tanh_and_mul", activation.gelu_tanh_and_mul(xx), reference_ops.gelu_tanh_and_mul(xx),
                         tol)


def prologue_checks(ctx: Ctx, t: int, hq: int, hkv: int, hd: int, rnd, tol: float) -> None:
    """`qk_norm_rope_cache` against the reference chain (per-head norms, rotary, cache write) into a 16-bit cache,
    and against the unfused Triton kernels into an FP8 one; then, at a B=32 decode step's shape, its graph-replayed
    time against the seven launches it replaced (two norms and their copies, rotary, a copy of v, the KV write; a
    diagnostic)."""
    g = torch.Generator().manual_seed(8)
    nb = (2 * t) // 16 + 1
    slots = torch.randperm(nb * 16, generator=g)[:t].to(ctx.device)
    slots[::3] = -1
    pos = torch.randint(0, 40960, (t,), generator=g).to(ctx.device)
    cs = reference_ops.rotary_cos_sin_cache(hd, 40960, 1e6, ctx.dtype, device=ctx.device)
    wq, wk = rnd(hd) * 0.3 + 1, rnd(hd) * 0.3 + 1
    q, k, v = rnd(t, hq + 2 * hkv, hd).split([hq, hkv, hkv], dim=1)  # strided views of one qkv output
    with ctx.case("qk_norm_rope_cache"):
        kc, vc = rnd(nb, 16, hkv, hd), rnd(nb, 16, hkv, hd)
        kr, vr = kc.clone(), vc.clone()
        got = qk_norm_rope_cache(pos, q, k, v, cs, kc, vc, slots, wq, wk, 1e-6)
        want = reference_ops.qk_norm_rope_cache(pos, q, k, v, cs, kr, vr, slots, wq, wk, 1e-6)
        ctx.report.check("qk_norm_rope_cache q", got, want, tol)
        ctx.report.check("qk_norm_rope_cache k cache", kc, kr, tol)
        ctx.report.check_equal("qk_norm_rope_cache v cache", bool(torch.equal(vc, vr)), True)
    with ctx.case("qk_norm_rope_cache fp8"):
        fp8 = torch.float8_e4m3fn
        kc, vc = rnd(nb, 16, hkv, hd).to(fp8), rnd(nb, 16, hkv, hd).to(fp8)
        kr, vr = kc.clone(), vc.clone()
        qk_norm_rope_cache(pos, q, k, v, cs, kc, vc, slots, wq, wk, 1e-6, 0.05, 0.3)
        _, kn = rotary.rotary_neox(pos, norm.rms_norm(q, wq, 1e-6), norm.rms_norm(k, wk, 1e-6), cs)
        attention.reshape_and_cache(kn, v, kr, vr, slots, 0.05, 0.3)
        k_diff = (kc.view(torch.uint8) != kr.view(torch.uint8)).float().mean().item()
        ctx.report.add_check("qk_norm_rope_cache fp8 == unfused kernels", k_diff < 0.01 and bool(torch.equal(
            vc.view(torch.uint8), vr.view(torch.uint8))), key_bytes_differing=k_diff)
    if not ctx.cuda:
        return
    with ctx.diagnostic("qk_norm_rope_cache decode time"):
        b = 32
        qd, kd, vd = q[:b], k[:b], v[:b]
        kc, vc = rnd(nb, 16, hkv, hd), rnd(nb, 16, hkv, hd)

        def unfused():
            qn = norm.rms_norm(qd.reshape(-1, hd), wq, 1e-6).view(b, hq, hd)
            kn = norm.rms_norm(kd.reshape(-1, hd), wk, 1e-6).view(b, hkv, hd)
            qr, kr_ = rotary.rotary_neox(pos[:b], qn, kn, cs)
            attention.reshape_and_cache(kr_, vd.contiguous(), kc, vc, slots[:b])
            return qr

        fused_us = graph_ms(lambda: qk_norm_rope_cache(pos[:b], qd, kd, vd, cs, kc, vc, slots[:b], wq, wk)) * 1e3
        unfused_us = graph_ms(unfused) * 1e3
        ctx.report.row(kind="prologue", B=b, fused_us=fused_us, unfused_us=unfused_us)
        ctx.report.log(f"  q/k norm + rope + KV write at B={b}: fused {fused_us:.1f} us, unfused (7 launches) "
                       f"{unfused_us:.1f} us")


def gated_delta_checks(ctx: Ctx) -> None:
    """Qwen3-Next's in-place decode kernel against the torch step, on its real per-layer shapes (tiny on a CPU):
    outputs and the updated slots; with a GPU, both timed (the torch path gathers and scatters the slots), and the
    chunked torch prefill's cost per token; the prefill's block walk in the Triton scan against the torch loop (tf32
    dots, so a looser tolerance)."""
    from ember.kernels import gated_delta_rule
    from ember.kernels.gated_delta_decode import gated_delta_decode

    b, hk, hv, dk, dv = ctx.pick((4, 2, 4, 32, 16), (64, 16, 32, 128, 128), (64, 16, 32, 128, 128))
    g = torch.Generator(device=ctx.device).manual_seed(9)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=ctx.device)

    with ctx.case("gated_delta_decode"):
        q, k, v = rnd(b, hk, dk).to(ctx.dtype), rnd(b, hk, dk).to(ctx.dtype), rnd(b, hv, dv).to(ctx.dtype)
        decay, beta = -rnd(b, hv).abs(), torch.sigmoid(rnd(b, hv))
        state = rnd(b + 8, hv, dk, dv)
        slots = torch.randperm(b + 8, generator=g, device=ctx.device)[:b]
        keep = (torch.arange(b, device=ctx.device) % 5 != 0).float()  # every fifth row starts a sequence
        ref_o, ref_s = gated_delta_rule.decode_step(q, k, v, decay + keep.log()[:, None], beta, state[slots])
        work = state.clone()
        out = gated_delta_decode(q, k, v, decay, beta, keep, work, slots)
        ctx.report.check("gated_delta_decode out", out, ref_o, 2e-3)
        ctx.report.check("gated_delta_decode state", work[slots], ref_s, 2e-3)
    with ctx.case("causal_conv_decode"):  # the conv's decode step (one launch) against the model's torch step
        from types import SimpleNamespace

        from ember.engine.attention import RecurrentMetadata
        from ember.engine.models.qwen3_next import GatedDeltaNet

        channels = 2 * hk * dk + hv * dv
        mixed = rnd(b + 3, channels).to(ctx.dtype)
        weight = (rnd(channels, 1, 4) * 0.5).to(ctx.dtype)
        windows = rnd(b + 8, channels, 3).to(ctx.dtype)
        rec = RecurrentMetadata(torch.arange(b, device=ctx.device) + 3, slots, keep, [])
        outs, kept = [], []
        for kernel in (False, True):
            w = windows.clone()
            layer = SimpleNamespace(conv1d=SimpleNamespace(weight=weight), conv_state=w, channels=channels, kernel=4)
            outs.append(GatedDeltaNet._conv(layer, mixed, rec, triton=kernel)[3:])
            kept.append(w)
        ctx.report.check("causal_conv_decode out", outs[1], outs[0], _tol(ctx))
        ctx.report.check_equal("causal_conv_decode windows", bool(torch.equal(kept[1], kept[0])), True)
    with ctx.case("gdn projections split"):  # the grouped in_proj outputs rearranged in one launch: copies, exact
        from types import SimpleNamespace

        from ember.engine.models.qwen3_next import GatedDeltaNet
        from ember.kernels import activation

        r = hv // hk
        qkvz, ba = rnd(b, hk * (2 * dk + 2 * r * dv)).to(ctx.dtype), rnd(b, hk * 2 * r).to(ctx.dtype)
        layer = SimpleNamespace(hk=hk, hv=hv, dk=dk, dv=dv, in_proj_qkvz=lambda x: qkvz, in_proj_ba=lambda x: ba)
        parts = [GatedDeltaNet._project(layer, qkvz, triton=kernel) for kernel in (False, True)]
        ctx.report.check_equal("gdn projections split", all(torch.equal(x, y) for x, y in zip(*parts)), True)
        qg = rnd(b, 2 * hk, 2 * dk).to(ctx.dtype)  # Qwen3-Next's attention: each head's query, then its gate
        att = rnd(b, 2 * hk * dk).to(ctx.dtype)
        ctx.report.check("sigmoid_gate_mul", activation.sigmoid_gate_mul(att, qg[..., dk:]),
                         att * torch.sigmoid(qg[..., dk:].reshape(b, -1)), _tol(ctx))
    with ctx.case("gated_delta_scan"):  # the chunked prefill's block walk in Triton (tf32 dots) vs the torch loop
        t = ctx.pick(40, 1000, 1000)
        pq, pk, pv = rnd(2, t, hk, dk).to(ctx.dtype), rnd(2, t, hk, dk).to(ctx.dtype), rnd(2, t, hv, dv).to(ctx.dtype)
        pg, pb = -rnd(2, t, hv).abs() * 0.1, torch.sigmoid(rnd(2, t, hv))
        ref_o, ref_s = gated_delta_rule.chunked(pq, pk, pv, pg, pb, state[:2], 32)
        got_o, got_s = gated_delta_rule.chunked(pq, pk, pv, pg, pb, state[:2], 32, scan_kernel=True)
        ctx.report.check("gated_delta_scan out", got_o, ref_o, 1e-2)
        ctx.report.check("gated_delta_scan state", got_s, ref_s, 1e-2)
    if not ctx.cuda:
        return
    with ctx.case("gated_delta timings"):
        def torch_path():
            o, work[slots] = gated_delta_rule.decode_step(q, k, v, decay, beta, work[slots])

        t = 4096  # one prefill through the chunked torch form, for its cost per token
        pq, pk, pv = rnd(t, hk, dk).to(ctx.dtype), rnd(t, hk, dk).to(ctx.dtype), rnd(t, hv, dv).to(ctx.dtype)
        pg, pb = -rnd(t, hv).abs(), torch.sigmoid(rnd(t, hv))
        prefill_ms = bench_ms(lambda: gated_delta_rule.chunked(pq, pk, pv, pg, pb, state[0]), rep=20, warmup=3)
        scan_ms = bench_ms(lambda: gated_delta_rule.chunked(pq, pk, pv, pg, pb, state[0], scan_kernel=True),
                           rep=20, warmup=3)
        parts = [(x[:512 * 8].reshape(8, 512, *x.shape[1:])) for x in (pq, pk, pv, pg, pb)]  # 8 prompts of 512
        one_by_one_ms = bench_ms(lambda: [gated_delta_rule.chunked(*(x[i] for x in parts), state[i])
                                          for i in range(8)], rep=20, warmup=3)
        batched_ms = bench_ms(lambda: gated_delta_rule.chunked(*parts, state[:8]), rep=20, warmup=3)
        row = ctx.report.row(what="gated_delta", batch=b, state_mb=b * hv * dk * dv * 4 / 2**20,
                             decode_kernel_ms=bench_ms(lambda: gated_delta_decode(q, k, v, decay, beta, keep, work,
                                                                                  slots)),
                             decode_torch_ms=bench_ms(torch_path), prefill_4k_us_per_token=prefill_ms * 1e3 / t,
                             prefill_8x512_one_by_one_ms=one_by_one_ms, prefill_8x512_batched_ms=batched_ms,
                             prefill_4k_scan_kernel_us_per_token=scan_ms * 1e3 / t)
        ctx.report.log(f"  gated delta B={b}: decode kernel {row['decode_kernel_ms']:.3f} ms, torch step "
                       f"{row['decode_torch_ms']:.3f} ms ({row['state_mb']:.0f} MB of state); chunked prefill "
                       f"{row['prefill_4k_us_per_token']:.2f} us/token at 4k ({scan_ms * 1e3 / t:.2f} with the "
                       f"Triton block scan); 8 prefills of 512 one by one "
                       f"{one_by_one_ms:.2f} ms, batched {batched_ms:.2f} ms")


def run(ctx: Ctx) -> None:
    attention_checks(ctx)
    kv_write_checks(ctx)
    row_kernel_checks(ctx)
    gated_delta_checks(ctx)
    moe_timing.correctness_checks(ctx)
