"""Compile Ember's Triton kernels for a CUDA target with the real compiler, no GPU needed (``python compile_check.py 90``).

The interpreter that runs the kernels in tests accepts programs the compiler rejects (loop-carried constexprs, dot
shapes, dtype mixes). This script (``--quick``: only the bf16 attention core) drives each public wrapper with CPU tensors, records the launches instead of
running them, and compiles every recorded (kernel, signature, constexprs) to a cubin for ``sm_<arch>``. It prints
``OK``/``FAIL`` per launch and exits non-zero on any failure. It must run without ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import inspect
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ember.kernels import activation, attention, norm, reference_ops, rotary

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8"}


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **constexprs)`` records instead of launching."""

    def __init__(self, name: str, kernel, launches: list) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, self.kernel, args, kwargs, grid))
        return launch


def _signature(kernel, args, kwargs):
    params = list(inspect.signature(kernel.fn).parameters)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    sig, constexprs = {}, {}
    values = iter(args)
    for i, p in enumerate(params):
        if p in kwargs:
            sig[p] = "constexpr"
            constexprs[(i,)] = kwargs[p]
            continue
        v = next(values)
        if isinstance(v, torch.Tensor):
            sig[p] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p] = "i1"
        elif isinstance(v, int):
            sig[p] = "i32" if -2**31 <= v < 2**31 else "i64"
        else:
            sig[p] = "fp32"
    return sig, constexprs, options


def _drive(launches: list, quick: bool) -> None:
    """Call each wrapper once per configuration the engine and gpu_check use (``quick``: the bf16 hd128 GQA-4 core)."""
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
            cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
            sl = torch.tensor([5, 9, 17], dtype=torch.int32)
            bt = torch.zeros(3, 2, dtype=torch.int32)
            scales = (0.5, 0.5) if cache_dt == torch.float8_e4m3fn else (None, None)
            for split in (False, True):
                attention.paged_attention(q, kc, kc, torch.empty_like(q), cu, sl, bt, 1, 17, 0.1, *scales,
                                          split_kv=split)
            if not quick:
                attention.paged_attention(q, kc, kc, torch.empty_like(q), cu, sl, bt, 3, 17, 0.1, *scales,
                                          block_m=128, tile_size=64)
            attention.reshape_and_cache(q[:, :hkv], q[:, :hkv], kc, kc, torch.tensor([0, -1, 5]), *scales)
    for dt in () if quick else (torch.bfloat16, torch.float16):
        x = torch.randn(4, 4096, generator=g).to(dt)
        norm.rms_norm(x, x[0], 1e-6)
        norm.fused_add_rms_norm(x, x, x[0], 1e-6)
        activation.silu_and_mul(x)
        cache = reference_ops.rotary_cos_sin_cache(64, 32, 1e6)
        qkv = torch.randn(4, 48, 128, generator=g).to(dt)
        rotary.rotary_neox(torch.arange(4), qkv[:, :32], qkv[:, 32:40], cache)


def main(arch: int, quick: bool = False) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_check must run without TRITON_INTERPRET", file=sys.stderr)
        return 2
    launches: list = []
    kernels = {"attention": attention, "norm": norm, "activation": activation, "rotary": rotary}
    saved = []
    for mod in kernels.values():
        for name, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.JITFunction) and name.startswith("_") and not name.startswith("_find") \
                    and name not in ("_attend_tiles", "_rotate_heads"):
                saved.append((mod, name, obj))
                setattr(mod, name, _Recorder(f"{mod.__name__.split('.')[-1]}.{name}", obj, launches))
    try:
        _drive(launches, quick)
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)
    return compile_launches(launches, arch, "kernel")


def compile_launches(launches: list, arch: int, what: str) -> int:
    """Compile each distinct recorded launch for ``sm_{arch}``, print OK/FAIL per launch; 1 if any failed."""
    target = GPUTarget("cuda", arch, 32)
    seen, failures = set(), 0
    for name, kernel, args, kwargs, _ in launches:
        sig, constexprs, options = _signature(kernel, args, dict(kwargs))
        key = (name, tuple(sorted(sig.items())), tuple(sorted(constexprs.items())))
        if key in seen:
            continue
        seen.add(key)
        label = f"{name} {','.join(v for v in sig.values() if v.startswith('*'))} {sorted(kwargs.items())}"
        try:
            triton.compile(ASTSource(kernel, sig, constexprs=constexprs), target=target, options=options)
            print("OK  ", label)
        except Exception as e:  # report every failing configuration, not just the first
            failures += 1
            print("FAIL", label, f"\n     {type(e).__name__}: {str(e)[:2000]}")
    print(f"{len(seen)} {what} configurations for sm_{arch} with triton {triton.__version__}: {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if a != "--quick"]
    sys.exit(main(int(argv[0]) if argv else 90, quick="--quick" in sys.argv))
