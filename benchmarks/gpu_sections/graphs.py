"""Section 5: `DecodeGraphRunner` on a random Qwen3-8B-shaped model cut to 8 layers (bf16, built on the device).

For each batch size (some padded up to a captured size): the replay equals the eager forward on the same padded
inputs (relative error < 1e-3; any difference is a graph bug: stale metadata, a buffer copied once at capture) and
is close to the unpadded eager forward (other GEMM shapes, so a looser bound); then ms per forward, eager vs graph.
At the e2e check's batch (32) the forward's device time by kernel (`time_by_kernel`): where a decode step goes.
"""
from __future__ import annotations

import time

import torch

from gpu_sections import models
from gpu_sections.common import Ctx, Report, bench_ms, time_by_kernel

LAYERS = 8  # 2 on a CPU run


def run(ctx: Ctx) -> None:
    from ember.engine.attention import AttentionMetadata
    from ember.engine.cuda_graphs import DecodeGraphRunner
    from ember.kernels import attention as backend  # the graph-safe Triton kernels (interpreted on a CPU run)

    rep = ctx.report
    ctx.deadline.check("build the model", 10.0)
    layers = ctx.pick(2, LAYERS, LAYERS)
    cfg, model = models.random_ember_model(ctx, models.qwen3_layers_config(ctx, layers), 4096)
    seq_ctx, bs = ctx.pick((40, 16), (1024, 16), (1024, 16))
    batches = ctx.pick((1, 3), (3, 32), (1, 3, 32, 100))  # 3 and 100 replay padded graphs
    profiled = ctx.pick(3, 32, 32)  # the e2e check's batch: where its decode step's device time goes
    max_seqs = ctx.pick(4, 32, 128)
    blocks_per_seq = (seq_ctx + 1 + bs - 1) // bs
    nb = max_seqs * blocks_per_seq + 1
    g = torch.Generator(device=ctx.device).manual_seed(0)
    kv = [tuple(torch.randn(nb, bs, cfg.num_key_value_heads, cfg.head_dim, device=ctx.device, dtype=ctx.dtype,
                            generator=g) * 0.5 for _ in range(2)) for _ in range(cfg.num_hidden_layers)]

    def forward(ids, meta):
        return model.compute_logits(model(ids, meta, kv, backend)).float()

    def meta_for(n: int) -> AttentionMetadata:
        table = torch.arange(n * blocks_per_seq, device=ctx.device, dtype=torch.int32).view(n, blocks_per_seq) + 1
        slots = table[:, seq_ctx // bs].long() * bs + seq_ctx % bs
        return AttentionMetadata(
            query_start_loc=torch.arange(n + 1, device=ctx.device, dtype=torch.int32),
            seq_lens=torch.full((n,), seq_ctx + 1, device=ctx.device, dtype=torch.int32), block_table=table,
            slot_mapping=slots, positions=torch.full((n,), seq_ctx, device=ctx.device, dtype=torch.int64),
            logits_indices=torch.arange(n, device=ctx.device), max_seqlen_q=1, max_seqlen_k=seq_ctx + 1)

    ctx.deadline.check("capture", 5.0)
    t0 = time.monotonic()
    runner = DecodeGraphRunner(forward, max_num_seqs=max_seqs, max_blocks_per_seq=blocks_per_seq,
                               max_seqlen_k=seq_ctx + 1, device=ctx.device)
    with torch.inference_mode():
        runner.capture()
        rep.data["capture_s"] = time.monotonic() - t0
        rep.data["sizes"] = runner.sizes
        rep.log(f"  captured sizes {runner.sizes} in {rep.data['capture_s']:.1f} s")
        all_equal = True
        for n in batches:
            with ctx.case(f"graph replay B={n}", need_s=2.0):
                ids = torch.randint(0, cfg.vocab_size, (n,), device=ctx.device)
                meta = meta_for(n)
                eager = forward(ids, meta)
                graph = runner.run(ids, meta).clone()
                size = runner.padded_size(n)
                same_shape = forward(*runner.static_inputs(size))[:n]
                ok_same = rep.check(f"graph replay B={n} (padded {size}) == eager same shape", graph, same_shape,
                                    1e-3)
                ok_eager = rep.check(f"graph replay B={n} ~ eager unpadded", graph, eager,
                                     5e-2 if ctx.dtype == torch.bfloat16 else 1e-2)
                all_equal &= ok_same and ok_eager
                eager_ms = bench_ms(lambda: forward(ids, meta), rep=30, warmup=5)
                graph_ms = bench_ms(lambda: runner.run(ids, meta), rep=30, warmup=5)
                row = rep.row(B=n, padded_to=size, eager_ms=eager_ms, graph_ms=graph_ms,
                              graph_tok_s=n / graph_ms * 1e3, speedup=eager_ms / graph_ms)
                rep.log(f"  B={n:<3} eager {eager_ms:7.2f} ms graph {graph_ms:7.2f} ms -> {row['graph_tok_s']:8.0f} "
                        f"tok/s (forward only, {layers} layers, ctx {seq_ctx})")
                ctx.cache.setdefault("forward_graph_ms", {})[n] = graph_ms
                if n == profiled:
                    with ctx.diagnostic(f"time by kernel B={n}", need_s=3.0):
                        _log_breakdown(rep, n, graph_ms, time_by_kernel(lambda: forward(ids, meta)))
    engine_equal = ctx.cache.get("graph_equal", [])
    equal = all_equal and all(engine_equal)
    rep.target("graph replay == eager (forward and engine tokens)", float(equal), "== 1", equal,
               engine_runs=len(engine_equal))
    del runner, kv, model


def _log_breakdown(rep: Report, n: int, graph_ms: float, prof: dict) -> None:
    """The forward's time by kernel (eager, profiled), against the graph replay's wall time: what to speed up."""
    rep.data["time_by_kernel"] = {"B": n, "graph_ms": graph_ms, **prof}
    rep.log(f"  B={n} forward by kernel: {prof['total_us'] / 1e3:.2f} ms in kernels per forward "
            f"({prof['total_us'] / 1e3 / graph_ms:.0%} of the graph replay's {graph_ms:.2f} ms)")
    for k in prof["kernels"]:
        rep.log(f"    {k['us']:9.1f} us {k['share']:6.1%} x{k['count']:<5.0f} {k['name']}")
