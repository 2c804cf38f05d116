"""Section 6: what only shows at real sizes.

1. A KV cache of more than 2^31 elements with the sequences' blocks at its END: ``reshape_and_cache`` and paged
   attention (2D and split-KV) against the references. 32-bit offset arithmetic anywhere wraps there.
2. One ``Engine`` on a random Qwen3-8B-shaped checkpoint cut to 8 layers (bf16), its KV cache sized by
   ``gpu_memory_utilization``: KV blocks, KV GiB and the CUDA-graph pool are logged, and the cache must fit the budget.
3. End-to-end greedy decode tokens/s through that engine at B = 32 (and 1, 128 in a full run), 128-token prompts.
4. The same checkpoint, prompts and B = 32 through transformers ``generate`` with a static cache (``torch.compile``d
   on CUDA; eager in a --quick run) in a subprocess bounded by the deadline. Target: Ember >= 1.5x its decode
   tokens/s.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from ember.kernels import attention, reference

from gpu_sections import hf_peer, models
from gpu_sections.common import Ctx, free_cuda, paged_batch

E2E_TARGET = 1.5
LAYERS = 8
GPU_MEMORY_UTILIZATION = 0.9
PEER_RESERVE_S = 100.0  # import, load, compile and two generate calls of the transformers peer


def big_kv_cache(ctx: Ctx) -> None:
    hq, hkv, hd, bs = ctx.pick((8, 2, 32, 16), (32, 8, 128, 16), (32, 8, 128, 16))
    num_blocks = ctx.pick(64, 2**31 // (bs * hkv * hd) + 1024, 2**31 // (bs * hkv * hd) + 1024)
    elements = num_blocks * bs * hkv * hd
    ctx.report.data["big_kv"] = {"num_blocks": num_blocks, "elements_per_cache": elements,
                                 "over_2_31": elements > 2**31}
    specs = ctx.pick([(30, 1), (7, 9)], [(1023, 1), (200, 300), (4095, 1)], [(1023, 1), (200, 300), (4095, 1)])
    q, kc, vc, cu, sl, bt = paged_batch(specs, hq, hkv, hd, device=ctx.device, dtype=ctx.dtype, seed=21,
                                        num_blocks=num_blocks, at_end=True)
    tol = 1e-2 if ctx.dtype == torch.bfloat16 else 2e-3
    first = int(bt[bt > 0].min())
    with ctx.case("big cache: reshape_and_cache at the end"):
        # the new tokens of every sequence, written at their slots (the last blocks of the cache)
        slots = torch.cat([bt[i, (torch.arange(c, c + n, device=ctx.device) // bs)].long() * bs
                           + torch.arange(c, c + n, device=ctx.device) % bs for i, (c, n) in enumerate(specs)])
        key = torch.randn(slots.numel(), hkv, hd, device=ctx.device, dtype=ctx.dtype)
        value = torch.randn_like(key)
        kr, vr = kc[first:].clone(), vc[first:].clone()
        reference.reshape_and_cache(key=key, value=value, k_cache=kr, v_cache=vr, slot_mapping=slots - first * bs)
        attention.reshape_and_cache(key=key, value=value, k_cache=kc, v_cache=vc, slot_mapping=slots)
        bad = int((kc[first:] != kr).sum() + (vc[first:] != vr).sum())
        ctx.report.add_check("big cache: reshape_and_cache at the end", bad == 0, mismatched=bad,
                             max_slot=int(slots.max()))
        del kr, vr
    for name, specs_, kw in (("mixed 2d", specs, {"split_kv": False}),
                             ("decode split-kv", [(c + n - 1, 1) for c, n in specs], {"split_kv": True})):
        with ctx.case(f"big cache: attention {name}"):
            qlens = [n for _, n in specs_]
            cu_ = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=ctx.device)
            sl_ = torch.tensor([c + n for c, n in specs_], dtype=torch.int32, device=ctx.device)
            q_ = torch.randn(sum(qlens), hq, hd, device=ctx.device, dtype=ctx.dtype)
            args = dict(q=q_, k_cache=kc, v_cache=vc, cu_seqlens_q=cu_, seq_lens=sl_, block_table=bt,
                        max_seqlen_q=max(qlens), max_seqlen_k=int(sl_.max()), softmax_scale=hd ** -0.5)
            ref = torch.zeros_like(q_)
            reference.paged_attention(out=ref, **args)
            out = torch.full_like(q_, float("nan"))
            attention.paged_attention(out=out, **args, **kw)
            ctx.report.check(f"big cache: attention {name}", out, ref, tol)
    del q, kc, vc


def _tensors(x) -> list[torch.Tensor]:
    """Every tensor in a nest of lists/tuples (the KV caches, whatever their grouping)."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in (x or []) for t in _tensors(item)]


def _decode_rate(eng, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Decode tokens/s of one batch: steps after every request has its first token, wall time per step."""
    from ember.engine.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rids = [eng.add_request(p, params) for p in hf_peer.prompt_ids(batch, prompt_len)]
    started: set[str] = set()
    tokens, decode_s, steps = 0, 0.0, 0
    first: list[int] = []
    while eng.has_unfinished():
        all_decoding = len(started) == batch
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        steps += 1
        for o in outs:
            if o.error:
                raise RuntimeError(f"request failed: {o.error}")
            if o.new_token_ids:
                started.add(o.request_id)
            if o.request_id == rids[0]:
                first.extend(o.new_token_ids)
        if all_decoding:
            tokens += sum(len(o.new_token_ids) for o in outs)
            decode_s += dt
    return {"B": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "steps": steps, "decode_tokens": tokens,
            "decode_s": decode_s, "tok_s": tokens / decode_s if decode_s else float("nan"), "first_tokens": first}


def engine_e2e(ctx: Ctx) -> dict | None:
    """Items 2 and 3; returns the B=32-row (or the tiny run's batch) for the comparison with transformers."""
    from ember.engine.engine import Engine

    rep = ctx.report
    ctx.deadline.check("build the 8-layer checkpoint", 20.0)
    t0 = time.monotonic()
    path = models.qwen3_8b_shaped(ctx, LAYERS)
    rep.data["checkpoint_s"] = time.monotonic() - t0
    free_cuda()  # the transformers model that wrote it: gpu_memory_utilization must not count it
    ctx.deadline.check("engine start", 15.0)
    max_seqs, max_len = ctx.pick((4, 256), (32, 2048), (128, 4096))
    sizing = dict(gpu_memory_utilization=GPU_MEMORY_UTILIZATION) if ctx.cuda else dict(num_kv_blocks=64)
    t0 = time.monotonic()
    eng = Engine.from_pretrained(path, device=ctx.device, dtype=ctx.dtype, max_num_seqs=max_seqs,
                                 max_num_batched_tokens=max_len, max_model_len=max_len, **sizing)
    try:
        runner = eng.runner
        kv_bytes = sum(t.numel() * t.element_size() for t in _tensors(runner.kv_caches))
        info = {"start_s": time.monotonic() - t0, "num_kv_blocks": runner.num_blocks, "kv_gib": kv_bytes / 2**30,
                "cuda_graphs": eng.cuda_graphs, "graph_pool_mib": getattr(runner, "graph_pool_bytes", 0) / 2**20,
                **sizing}
        if ctx.cuda:
            free, total = torch.cuda.mem_get_info()
            info.update(total_gib=total / 2**30, free_after_gib=free / 2**30,
                        used_fraction=(total - free) / total)
            rep.add_check("engine sized by gpu_memory_utilization fits", (total - free) <= GPU_MEMORY_UTILIZATION
                          * total * 1.02, **info)
        rep.data["engine"] = info
        rep.log(f"  engine: {info['num_kv_blocks']} KV blocks ({info['kv_gib']:.1f} GiB), graph pool "
                f"{info['graph_pool_mib']:.0f} MiB, graphs {info['cuda_graphs']}, started in {info['start_s']:.1f} s")
        rep.save()
        target_b = ctx.pick(2, 32, 32)
        batches = ctx.pick((2,), (32,), (32, 1, 128))
        prompt_len, new_tokens = ctx.pick((20, 4), (128, 32), (128, 256))
        _decode_rate(eng, target_b, prompt_len, 8)  # warm-up, as the peer's first generate: first-use costs
        at_target = None
        for b in batches:
            if b != target_b and ctx.deadline.left() < PEER_RESERVE_S:  # keep the transformers peer's time
                rep.data.setdefault("skipped", []).append(f"e2e B={b}: time kept for the transformers peer")
                continue
            ctx.deadline.check(f"e2e B={b}", 5.0)
            row = rep.row(kind="ember", **_decode_rate(eng, b, prompt_len, new_tokens))
            rep.log(f"  ember e2e B={b:<4} {row['tok_s']:9.1f} decode tok/s ({row['decode_tokens']} tokens in "
                    f"{row['decode_s']:.2f} s)")
            _split_step(ctx, row)
            rep.save()
            if b == target_b:
                at_target = row
        if at_target is not None and ctx.deadline.left() > PEER_RESERVE_S:
            eng.async_scheduling = True  # the same engine, each step launched before the last one is read
            row = rep.row(kind="ember-async", **_decode_rate(eng, target_b, prompt_len, new_tokens))
            eng.async_scheduling = False
            rep.log(f"  ember e2e B={target_b:<4} {row['tok_s']:9.1f} decode tok/s with async scheduling "
                    f"({row['tok_s'] / at_target['tok_s']:.2f}x in order; first tokens equal: "
                    f"{row['first_tokens'] == at_target['first_tokens']})")
            rep.add_check("async scheduling: same greedy tokens", row["first_tokens"] == at_target["first_tokens"])
            _split_step(ctx, row)
            rep.save()
            at_target = {**row, "in_order_tok_s": at_target["tok_s"]}
        return at_target
    finally:
        eng.shutdown()
        del eng
        free_cuda()


def _split_step(ctx: Ctx, row: dict) -> None:
    """A decode step's wall time against the graphs section's replay of the same 8-layer forward at that batch
    (ctx 1k there): the rest is the engine's host work and sampling, which the device waits on."""
    forward = ctx.cache.get("forward_graph_ms", {}).get(row["B"])
    if forward is None or not row["decode_tokens"]:
        return
    row["step_ms"] = row["decode_s"] / (row["decode_tokens"] / row["B"]) * 1e3
    row["forward_graph_ms"] = forward
    row["rest_ms"] = row["step_ms"] - forward
    ctx.report.log(f"    step {row['step_ms']:.2f} ms = forward {forward:.2f} ms (graph replay, section 5) + "
                   f"{row['rest_ms']:.2f} ms host work and sampling")


def transformers_peer(ctx: Ctx, ours: dict) -> None:
    rep = ctx.report
    path = models.qwen3_8b_shaped(ctx, LAYERS)
    ctx.deadline.check("transformers peer", ctx.pick(10.0, 20.0, 40.0))
    if ctx.cuda:
        free, total = torch.cuda.mem_get_info()
        rep.data["free_gib_before_peer"] = free / 2**30
    out = ctx.tmp / "hf_peer_result.json"
    cmd = [sys.executable, str(Path(hf_peer.__file__)), "--model", str(path), "--batch", str(ours["B"]),
           "--prompt-len", str(ours["prompt_len"]), "--new-tokens", str(ours["new_tokens"]), "--out", str(out)]
    if not ctx.cuda or ctx.quick:  # compiling takes about a minute: a --quick run compares with eager
        cmd.append("--no-compile")
    timeout = max(ctx.deadline.left() - 2.0, 1.0)
    rep.log(f"  transformers peer (timeout {timeout:.0f} s): {' '.join(cmd[1:])}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        rep.add_check("transformers peer finished", False, error=f"timed out after {timeout:.0f} s")
        return
    if proc.returncode != 0 or not out.exists():
        rep.add_check("transformers peer finished", False, error=proc.stderr[-4000:])
        return
    peer = json.loads(out.read_text())
    rep.row(kind="transformers", **peer)
    ratio = ours["tok_s"] / peer["tok_s"]
    same = sum(a == b for a, b in zip(ours["first_tokens"], peer["first_tokens"]))
    rep.log(f"  transformers B={peer['batch']} {peer['tok_s']:9.1f} decode tok/s (compile {peer['compile']}, "
            f"warm-up {peer['warmup_s']:.1f} s); first prompt's greedy tokens agree on {same}/"
            f"{len(peer['first_tokens'])}")
    how = " (async scheduling)" if "in_order_tok_s" in ours else ""
    rep.target(f"e2e decode B={ours['B']}{how} / {'compiled ' if peer['compile'] else 'eager '}transformers", ratio,
               f">= {E2E_TARGET}", ratio >= E2E_TARGET, ours_tok_s=ours["tok_s"], peer_tok_s=peer["tok_s"],
               in_order_ratio=ours.get("in_order_tok_s", ours["tok_s"]) / peer["tok_s"])


def run(ctx: Ctx) -> None:
    with ctx.case("big cache", need_s=5.0):
        big_kv_cache(ctx)
    free_cuda()
    ours = None
    with ctx.case("engine e2e"):
        ours = engine_e2e(ctx)
    if ours is not None:
        with ctx.case("transformers peer"):
            transformers_peer(ctx, ours)
