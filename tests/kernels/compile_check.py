"""Compile Ember's Triton kernels for a CUDA target with the real compiler, no GPU needed (``compile_check.py 90``).

The interpreter that runs the kernels in tests accepts programs the compiler rejects (loop-carried constexprs, dot
shapes, dtype mixes) and says nothing about registers. This script (``--quick``: only the bf16 attention core) drives
each public wrapper with CPU tensors, records the launches instead of running them, and compiles every recorded launch
to a cubin for ``sm_<arch>`` **specialized as the JIT would** (Triton's own binder for that target: integer arguments
equal to 1 become constants, pointers and integers divisible by 16 carry the divisibility hint), so it checks the IR
that runs (cp.async / wgmma / TMA decisions, register allocation). It prints ``OK``/``FAIL`` per launch with registers
per thread and stack bytes (spills) from ``cuobjdump -res-usage``, then a table, and exits non-zero on any compile
failure or on any stack use in a hot kernel (:data:`HOT`). It must run without ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from ember.kernels import (activation, attention, causal_conv_decode, gated_delta_decode, gated_delta_scan,
                           gdn_projections, norm, qk_norm_rope_cache, reference_ops, rotary)

HOT = ("attention._unified_attention_2d", "attention._unified_attention_3d", "moe._moe_gemm_kernel",
       "moe._moe_gemm_w4a4_kernel", "gated_delta_decode._decode_kernel", "gated_delta_scan._scan_kernel")
"""Kernels on the per-token path (decode/prefill attention, the MoE and dense NVFP4 GEMMs, Qwen3-Next's linear
attention decode and prefill scan): any spill fails."""

class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **constexprs)`` records instead of launching."""

    def __init__(self, name: str, kernel, launches: list) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, self.kernel, args, kwargs, grid))
        return launch


LAUNCHED = ((attention, ("_reshape_and_cache_kernel", "_unified_attention_2d", "_unified_attention_3d",
                         "_reduce_segments")),
            (norm, ("_rms_norm_kernel", "_gated_rms_norm_kernel")),
            (activation, ("_act_and_mul_kernel", "_sigmoid_gate_kernel")),
            (rotary, ("_rotary_kernel",)),
            (qk_norm_rope_cache, ("_qk_norm_rope_cache_kernel",)),
            (gated_delta_decode, ("_decode_kernel",)), (causal_conv_decode, ("_conv_decode_kernel",)),
            (gated_delta_scan, ("_scan_kernel",)), (gdn_projections, ("_split_kernel",)))
"""The kernels the wrappers launch (jit helpers they call, such as ``_attend_tiles``, are compiled inside them)."""


def _three_sequences() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cu_seqlens_q``, ``seq_lens`` and a block table of three sequences of 5, 9 and 17 tokens."""
    return (torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.tensor([5, 9, 17], dtype=torch.int32),
            torch.zeros(3, 2, dtype=torch.int32))


def _drive(launches: list, quick: bool) -> None:
    """Call each wrapper once per configuration the engine and gpu_check use (``quick``: the bf16 hd128 GQA-4 core:
    2D and split-KV decode, prefill, KV write; and the attention of the edge head sizes)."""
    g = torch.Generator().manual_seed(0)
    dtypes = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.bfloat16, torch.float8_e4m3fn),
              (torch.float32, torch.float32))
    shapes = ((32, 8, 128), (32, 4, 128), (8, 8, 64))
    if quick:
        dtypes, shapes = dtypes[:1], shapes[:1]
    for dt, cache_dt in dtypes:
        for hq, hkv, d in shapes:
            kc = torch.zeros(4, 16, hkv, d, dtype=cache_dt)
            q = torch.randn(3, hq, d, generator=g).to(dt)
            cu, sl, bt = _three_sequences()
            scales = (0.5, 0.5) if cache_dt == torch.float8_e4m3fn else (None, None)
            for split in (False, True):
                attention.paged_attention(q, kc, kc, torch.empty_like(q), cu, sl, bt, 1, 17, 0.1, *scales,
                                          split_kv=split)
            # prefill with the defaults (max_seqlen_q > 1)
            attention.paged_attention(q, kc, kc, torch.empty_like(q), cu, sl, bt, 3, 17, 0.1, *scales)
            if not quick and dt != torch.float32:
                attention.paged_attention(q, kc, kc, torch.empty_like(q), cu, sl, bt, 3, 17, 0.1, *scales,
                                          block_m=128, tile_size=32, num_warps=8)
            if not quick and dt == torch.bfloat16 and cache_dt == dt:  # gpt-oss: sliding window and sinks
                sinks = torch.zeros(hq)
                for split in (False, True):
                    attention.paged_attention(q, kc, kc, torch.empty_like(q), cu, sl, bt, 1, 17, 0.1, split_kv=split,
                                              sliding_window=128, sinks=sinks)
                attention.paged_attention(q, kc, kc, torch.empty_like(q), cu, sl, bt, 3, 17, 0.1,
                                          sliding_window=128, sinks=sinks)
            attention.reshape_and_cache(q[:, :hkv], q[:, :hkv], kc, kc, torch.tensor([0, -1, 5]), *scales)
            if dt != torch.float32:  # the attention prologue of every 16-bit model: per-head norms or none, whole or
                # partial rotary (GLM-4.5: half of 128), into the layer's cache
                qkv = torch.randn(3, hq + 2 * hkv, d, generator=g).to(dt)
                w = qkv[0, 0]
                for rot, weights in ((d, (w, w)), (d // 2, (w, w)), (d, (None, None))):
                    cs = reference_ops.rotary_cos_sin_cache(rot, 32, 1e6, dt)
                    qk_norm_rope_cache.qk_norm_rope_cache(torch.arange(3), qkv[:, :hq], qkv[:, hq:hq + hkv],
                                                          qkv[:, hq + hkv:], cs, kc, kc, torch.tensor([0, -1, 5]),
                                                          *weights, 1e-6, *scales)
    for dt in () if quick else (torch.bfloat16, torch.float16):
        x = torch.randn(4, 4096, generator=g).to(dt)
        for offset in (False, True):
            norm.rms_norm(x, x[0], 1e-6, offset=offset)
            norm.fused_add_rms_norm(x, x, x[0], 1e-6, offset=offset)
        norm.gated_rms_norm(x.float().view(-1, 128), x.view(-1, 128), x[0, :128], 1e-6)  # Qwen3-Next's, dv 128
        activation.silu_and_mul(x)
        activation.gelu_tanh_and_mul(x)
        cache = reference_ops.rotary_cos_sin_cache(64, 32, 1e6)
        qkv = torch.randn(4, 48, 128, generator=g).to(dt)
        rotary.rotary_neox(torch.arange(4), qkv[:, :32], qkv[:, 32:40], cache)
        # Qwen3-Next-80B's linear attention per rank at TP 1 and 2: 16/8 key heads, 32/16 value heads, dims 128
        for hk, hv in ((16, 32), (8, 16)):
            channels = (2 * hk + hv) * 128
            mixed, conv_w = torch.zeros(3, channels, dtype=dt), torch.zeros(channels, 4, dtype=dt)
            causal_conv_decode.causal_conv_decode(mixed, mixed.clone(), torch.arange(3), torch.arange(3), torch.ones(3),
                                                  torch.zeros(5, channels, 3, dtype=dt), conv_w)
            q = torch.randn(3, hk, 128, generator=g).to(dt)
            gated_delta_decode.gated_delta_decode(q, q, torch.randn(3, hv, 128).to(dt), torch.zeros(3, hv),
                                                  torch.zeros(3, hv, dtype=dt), torch.ones(3),
                                                  torch.zeros(5, hv, 128, 128), torch.tensor([0, 2, 4]))
            r = hv // hk
            gdn_projections.split_projections(torch.zeros(3, hk * (256 + 256 * r), dtype=dt),
                                              torch.zeros(3, hk * 2 * r, dtype=dt), hk, 128, hv, 128)
        qg = torch.zeros(3, 16, 512, dtype=dt)  # Qwen3-Next-80B's gated attention: 16 heads of 256, query then gate
        activation.sigmoid_gate_mul(torch.zeros(3, 16 * 256, dtype=dt), qg[..., 256:])
    for c in (16, 32):  # the chunked prefill's block walk (fp32 whatever the model dtype), head dims 128
        blocks = (2, 4, 3, c)
        gated_delta_scan.scan(torch.zeros(*blocks, 128), torch.zeros(*blocks, 128), torch.zeros(*blocks, 128),
                              torch.zeros(*blocks, c), torch.zeros(*blocks, 128), torch.ones(2, 4, 3),
                              torch.zeros(2, 4, 128, 128))
    # head sizes at the edges, attention only: DeepSeek's latent attention at TP 8 (one KV head of 576 for 16 query
    # heads; a larger group is split into launches like it) and a tiny test model's 8 (padded to tl.dot's K of 16)
    for hq, hkv, d in ((16, 1, 576), (4, 2, 8)):
        kc = torch.zeros(4, 16, hkv, d, dtype=torch.bfloat16)
        q = torch.randn(3, hq, d, generator=g).to(torch.bfloat16)
        cu, sl, bt = _three_sequences()
        for split in (False, True):
            attention.paged_attention(q, kc, kc, torch.empty_like(q), cu, sl, bt, 1, 17, 0.1, split_kv=split)
        attention.paged_attention(q, kc, kc, torch.empty_like(q), cu, sl, bt, 3, 17, 0.1)


def main(arch: int, quick: bool = False) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_check must run without TRITON_INTERPRET", file=sys.stderr)
        return 2
    launches: list = []
    saved = []
    for mod, names in LAUNCHED:
        for name in names:
            obj = getattr(mod, name)
            saved.append((mod, name, obj))
            setattr(mod, name, _Recorder(f"{mod.__name__.split('.')[-1]}.{name}", obj, launches))
    try:
        _drive(launches, quick)
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)
    return compile_launches(launches, arch, "kernel")


@dataclass
class Compiled:
    """One compiled launch: its label, registers per thread and stack bytes per thread (None: not measured)."""

    name: str
    label: str
    regs: int | None
    stack: int | None
    mma: str


def _mma_kind(ptx: str) -> str:
    """Which tensor-core instruction the kernel's PTX uses (``-`` for none)."""
    for kind, op in (("tcgen05", "tcgen05.mma"), ("wgmma", "wgmma.mma_async"), ("mma.sync", "mma.sync")):
        if op in ptx:
            return kind
    return "-"


def _specialize(kernel, args: tuple, kwargs: dict, backend):
    """(signature, constexprs, attrs, options) exactly as ``JITFunction.run`` derives them for ``backend``."""
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return signature, constexprs, attrs, options


def resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack bytes) per thread of the cubin's kernel, from ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                                 timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else None), (int(stack.group(1)) if stack else None)


def _label(name: str, signature: dict, constexprs: dict, kernel, options) -> str:
    names = [p.name for p in kernel.params]
    ptrs = ",".join(v for v in signature.values() if v.startswith("*"))
    consts = ",".join(f"{names[k[0]]}={v}" for k, v in sorted(constexprs.items()) if names[k[0]].isupper())
    return f"{name} {ptrs} {consts} w{options.num_warps}s{options.num_stages}"


def shared_limit(arch: int) -> int:
    """Bytes of shared memory one block may opt into on ``sm_{arch}`` (CUDA's per-architecture table)."""
    return {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 103: 232448}.get(arch, 101376)


def compile_launches(launches: list, arch: int, what: str) -> int:
    """Compile each distinct recorded launch for ``sm_{arch}`` as the JIT specializes it; print OK/FAIL/SPILL/SMEM
    per launch with registers, stack bytes and shared memory, then a table; 1 if any failed to compile, needs more
    shared memory than ``sm_{arch}`` has (:func:`shared_limit`), or is a :data:`HOT` kernel that uses stack."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    seen: set = set()
    results: list[Compiled] = []
    failures = spills = 0
    for name, kernel, args, kwargs, _ in launches:
        kwargs = dict(kwargs)
        signature, constexprs, attrs, options = _specialize(kernel, args, kwargs, backend)
        label = _label(name, signature, constexprs, kernel, options)
        key = (name, tuple(signature.items()), tuple(sorted(constexprs.items())), str(sorted(attrs.items())),
               options.num_warps, options.num_stages)
        if key in seen:
            continue
        seen.add(key)
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
        except Exception as e:  # report every failing configuration, not just the first
            failures += 1
            print("FAIL", label, f"\n     {type(e).__name__}: {str(e)[:2000]}")
            continue
        regs, stack = resource_usage(compiled.asm["cubin"])
        mma = _mma_kind(compiled.asm.get("ptx", ""))
        shared = int(compiled.metadata.shared)
        results.append(Compiled(name, label, regs, stack, mma))
        spilled = bool(stack) and name in HOT
        spills += spilled
        too_big = shared > shared_limit(arch)  # the launch raises OutOfResources on the device
        failures += too_big
        status = "SMEM" if too_big else "SPILL" if spilled else "OK  "
        print(status, label, f"regs={regs} stack={stack} shared={shared} mma={mma}")
    print("\n| kernel | configurations | registers (min-max) | max stack (spill) bytes | MMA |\n"
          "| --- | ---: | ---: | ---: | --- |")
    for name in sorted({r.name for r in results}):
        rows = [r for r in results if r.name == name]
        regs = [r.regs for r in rows if r.regs is not None]
        stack = [r.stack for r in rows if r.stack is not None]
        reg_range = f"{min(regs)}-{max(regs)}" if regs else "?"
        mma = ", ".join(sorted({r.mma for r in rows}))
        print(f"| {name} | {len(rows)} | {reg_range} | {max(stack) if stack else '?'} | {mma} |")
    print(f"{len(seen)} {what} configurations for sm_{arch} with triton {triton.__version__}: {failures} failed, "
          f"{spills} hot with spills")
    return 1 if failures or spills else 0


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if a != "--quick"]
    sys.exit(main(int(argv[0]) if argv else 90, quick="--quick" in sys.argv))
