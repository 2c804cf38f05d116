#!/usr/bin/env python
"""Static cost of the W4A16 (NVFP4) and W8A16 (block FP8) MoE GEMMs' main loop, per K step, from their SASS: no
GPU needed.

    python benchmarks/moe_sass.py [--arch 90] [--sizes 1,16,64,256,4096] [--weights nvfp4,fp8]

At decode sizes these GEMMs are bound by dequantization (NVFP4 reads 3.6x fewer bytes than bf16 but took 1.7x
longer on an H200), so the instructions one thread issues per K step of the main loop, per weight element it decodes,
are the number to push down between device runs. For each batch size M the script records the launches
`fused_moe` makes with the GPU's default tiles (`moe.default_config(..., nvfp4=True)`, and `block_fp8_config` of it
for FP8 with 128x128 blocks), compiles them for
``sm_<arch>`` as the JIT specializes them (`tests/kernels/compile_check.py`), disassembles the cubin with the
`cuobjdump` in Triton's wheel, takes the loop body (the longest backward branch) and prints a table: registers, loop
instructions, weight elements per thread per K step, their ratio, tensor-core instructions and the commonest
opcodes. Integer sizes do not change the code the JIT builds (only divisibility by 16 does), so small expert stacks
stand in for real ones. Run it without ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402

from ember.kernels import fp8_block, moe, nvfp4  # noqa: E402
from ember.kernels import moe_reference as ref  # noqa: E402
from ember.kernels.nvfp4 import NVFP4Tensor  # noqa: E402
from tests.kernels.compile_check import _Recorder, _specialize, resource_usage  # noqa: E402

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_MMA = ("HMMA", "HGMMA", "UTCHMMA", "UTCQMMA", "UTCMMA")


def sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True,
                              check=True, timeout=120).stdout


def main_loop(text: str) -> list[str]:
    """Opcodes of the longest loop: the instructions from a backward branch's target to the branch."""
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in _INSTR.finditer(text)]
    best: list[str] = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    return best


def stacks(g: torch.Generator, e: int, h: int, i: int, weights: str) -> tuple[Any, Any]:
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    if weights == "fp8":
        return fp8_block.quantize(w13, (128, 128)), fp8_block.quantize(w2, (128, 128))

    def stack(w: torch.Tensor, parts: int) -> NVFP4Tensor:
        q = [nvfp4.quantize(x) for x in w]
        s2 = torch.stack([x.weight_scale_2 for x in q])
        return NVFP4Tensor(torch.stack([x.weight for x in q]), torch.stack([x.weight_scale for x in q]),
                           s2.unsqueeze(1).expand(-1, parts).contiguous() if parts == 2 else s2)

    return stack(w13, 2), stack(w2, 1)


def run(arch: int, sizes: list[int], kinds: list[str]) -> None:
    g = torch.Generator().manual_seed(0)
    e, h, i, top_k = 8, 256, 128, 2
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kernel = moe._moe_gemm_kernel
    print(f"MoE GEMM main loop, sm_{arch}, triton {triton.__version__}, torch {torch.__version__}\n")
    print("| weights | M | GEMM | tile (MxNxK, warps, stages) | registers | loop instructions "
          "| weight elements / thread | instructions / element | MMA | commonest |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    try:
        for kind in kinds:
            w13, w2 = stacks(g, e, h, i, kind)
            for m in sizes:
                launches: list = []
                moe._moe_gemm_kernel = _Recorder("moe._moe_gemm_kernel", kernel, launches)
                cfg = moe.default_config(m, 128, 8, torch.device("cuda"), nvfp4=True)
                if kind == "fp8":
                    cfg = moe.block_fp8_config(cfg)
                x = torch.randn(m, h, generator=g).to(torch.bfloat16)
                tw, ti = ref.topk_routing(torch.randn(m, e, generator=g), top_k, True)
                try:
                    moe.fused_moe(x, w13, w2, tw, ti, config=cfg)
                except Exception:  # the recorder launched nothing, so the combine after the GEMMs may fail
                    pass
                for (_, _, args, kwargs, _), gemm in zip(launches, ("w13 (gate+up)", "w2 (down)")):
                    signature, constexprs, attrs, options = _specialize(kernel, args, dict(kwargs), backend)
                    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                              options=options.__dict__)
                    regs, _ = resource_usage(compiled.asm["cubin"])
                    loop = main_loop(sass(compiled.asm["cubin"]))
                    fused = 2 if kwargs["FUSE_SILU"] else 1
                    per_thread = cfg.block_n * cfg.block_k * fused // (32 * options.num_warps)
                    mma = sum(op.startswith(_MMA) for op in loop)
                    common = ", ".join(f"{op} {n}" for op, n in collections.Counter(
                        op.split(".")[0] for op in loop).most_common(5))
                    print(f"| {kind} | {m} | {gemm} | {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{options.num_warps} "
                          f"s{options.num_stages} | {regs} | {len(loop)} | {per_thread} "
                          f"| {len(loop) / per_thread:.1f} | {mma} | {common} |")
    finally:
        moe._moe_gemm_kernel = kernel


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability times 10 (90: Hopper)")
    ap.add_argument("--sizes", default="1,16,64,256,4096", help="batch sizes M (tokens)")
    ap.add_argument("--weights", default="nvfp4,fp8", help="which expert formats: nvfp4, fp8 (128x128 blocks)")
    a = ap.parse_args()
    run(a.arch, [int(s) for s in a.sizes.split(",")], a.weights.split(","))
