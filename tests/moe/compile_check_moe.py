"""Compile the fused-MoE / NVFP4 kernels for a CUDA target with the real Triton compiler, no GPU needed.

``python tests/moe/compile_check_moe.py 90 [--quick]`` (Hopper: the W4A16, block-FP8 W8A16 and dense grouped GEMMs
in bf16/fp16) or
``100`` (Blackwell: also the W4A4 ``dot_scaled`` kernel). Drives the public wrappers with CPU tensors, records each
launch (the recorder of ``tests/kernels/compile_check.py``) and compiles it to a cubin specialized as the JIT would.
Prints ``OK``/``FAIL``/``SPILL`` per launch with registers and stack bytes, then a table, and exits non-zero on any
failure or spill (every MoE GEMM is a hot kernel). Must run without ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

from ember.kernels import fp8_block, moe, moe_align, moe_routing, nvfp4
from ember.kernels import moe_reference as ref
from ember.kernels.nvfp4 import NVFP4Tensor
from tests.kernels.compile_check import _Recorder, compile_launches

_KERNELS = ((moe, "_moe_gemm_kernel"), (moe, "_moe_gemm_w4a4_kernel"), (moe, "_combine_kernel"),
            (moe, "_glu_partials_kernel"),
            (moe_align, "_align_kernel"), (moe_routing, "_softmax_topk_kernel"))


def _drive(w4a4: bool, quick: bool = False) -> None:
    """Every configuration the engine and the MoE sections of ``benchmarks/gpu_check.py`` launch (``quick``: bf16
    at one size, fp32 at the two whose 16-bit tiles would overflow shared memory)."""
    g = torch.Generator().manual_seed(0)
    e, h, i = 8, 256, 128
    cuda = torch.device("cuda")  # the tile tables the GPU would pick
    w13 = torch.randn(e, 2 * i, h, generator=g)
    w2 = torch.randn(e, h, i, generator=g)
    q13 = NVFP4Tensor(*(torch.stack(t) for t in zip(*[(q.weight, q.weight_scale, q.weight_scale_2.expand(2))
                                                      for q in map(nvfp4.quantize, w13)])))
    q2 = NVFP4Tensor(*(torch.stack(t) for t in zip(*[(q.weight, q.weight_scale, q.weight_scale_2)
                                                     for q in map(nvfp4.quantize, w2)])))
    f13, f2 = fp8_block.quantize(w13, (128, 128)), fp8_block.quantize(w2, (128, 128))  # the -FP8 releases' block
    c13, c2 = (fp8_block.quantize(w, (1, fp8_block.CHANNEL)) for w in (w13, w2))  # per-channel (and per-tensor)
    for dt in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16):
        for m in (64,) if quick else (1, 16, 64, 256, 512, 4096):
            x = torch.randn(m, h, generator=g).to(dt)
            tw, ti = ref.topk_routing(torch.randn(m, e, generator=g), 2, True)
            cfg = moe.default_config(m, e, 2, cuda)
            if not quick:
                moe.fused_moe(x, w13.to(dt), w2.to(dt), tw, ti, config=cfg)
            packed_cfg = moe.default_config(m, e, 2, cuda, nvfp4=True)
            moe.fused_moe(x, q13, q2, tw, ti, config=packed_cfg,
                          shared=(x[:, :1], x) if m == 64 else None)  # Qwen3-Next's shared expert, in the combine
            fp8_cfg = moe.block_fp8_config(packed_cfg)
            moe.fused_moe(x, f13, f2, tw, ti, config=fp8_cfg)
            moe.fused_moe(x, c13, c2, tw, ti, config=fp8_cfg)
            if m == 1:  # decode-size MoEs split K (moe_splits): partial stores and the GLU of the partials
                moe.fused_moe(x, q13, q2, tw, ti, config=replace(packed_cfg, split_k=2))
                moe.fused_moe(x, f13, f2, tw, ti, config=replace(fp8_cfg, split_k=2))
            for split in (1, 4) if m <= 16 else (1,):  # decode sizes split K (the GPU's choice needs its SMs)
                lin = replace(moe.linear_config(m, cuda), split_k=split)
                moe.nvfp4_linear(x, nvfp4.quantize(w2[0]), config=lin)
                for block in ((128, 128), (1, fp8_block.CHANNEL)):
                    moe.block_fp8_linear(x, fp8_block.quantize(w2[0], block), config=moe.block_fp8_config(lin))
            if w4a4 and dt == torch.bfloat16:
                moe.fused_moe_nvfp4_w4a4(x, q13, q2, tw, ti, config=moe.w4a4_config(cfg))
                if m in (1, 4096):  # the dense W4A4 GEMM (the probe that turns W4A4 on runs it)
                    moe._w4a4_dense(x, nvfp4.quantize(w2[0]), torch.tensor(1.0))
    for m in (1, 4096):  # the routing sort: the GPU's one-launch kernel (the CPU tensors here take the torch path)
        moe_align.align_triton(torch.randint(0, 128, (m, 8), generator=g), 16, 128)
    for experts, k in ((8, 2), (128, 8), (512, 10)):  # the router: tiny, Qwen3-30B-A3B, Qwen3-Next
        moe_routing.softmax_topk(torch.randn(4, experts, generator=g).to(torch.bfloat16), k, True, True)
    for m in (64, 4096) if quick else (1, 16, 64, 256, 512, 4096):  # fp32 models (gpu_check's parity): 4-byte tiles
        tw, ti = ref.topk_routing(torch.randn(m, e, generator=g), 2, True)
        x = torch.randn(m, h, generator=g)
        moe.fused_moe(x, w13, w2, tw, ti, config=moe.default_config(m, e, 2, cuda, dtype=torch.float32))


def main(arch: int, quick: bool = False) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_check_moe must run without TRITON_INTERPRET", file=sys.stderr)
        return 2
    launches: list = []
    saved = {(module, name): getattr(module, name) for module, name in _KERNELS}
    for (module, name), kernel in saved.items():
        setattr(module, name, _Recorder(f"{module.__name__.rsplit('.', 1)[-1]}.{name}", kernel, launches))
    try:
        _drive(w4a4=arch >= 100, quick=quick)
    finally:
        for (module, name), kernel in saved.items():
            setattr(module, name, kernel)
    return compile_launches(launches, arch, "MoE kernel")


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if a != "--quick"]
    sys.exit(main(int(argv[0]) if argv else 90, quick="--quick" in sys.argv))
