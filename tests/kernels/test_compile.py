"""The attention kernels compile for Hopper (sm_90) with the real Triton compiler, which the interpreter does not."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("compile_check.py")
ROOT = SCRIPT.parent.parent.parent


def nvidia_toolchain_or_skip() -> None:
    """Skip (not fail) where the Triton install has no CUDA backend or lacks ``ptxas`` / ``cuobjdump``."""
    pytest.importorskip("triton.backends.nvidia")
    from triton import knobs

    for tool in ("ptxas", "cuobjdump"):
        try:
            path = getattr(knobs.nvidia, tool).path
        except Exception as e:  # noqa: BLE001 - a missing tool raises in knobs
            pytest.skip(f"no {tool} in this Triton install ({type(e).__name__})")
        if not path or not os.path.exists(path):
            pytest.skip(f"no {tool} in this Triton install")


def test_attention_core_compiles_for_sm90_as_the_jit_specializes_it_without_spills():
    """The bf16 core (decode 2D and split-KV, default prefill, KV write), specialized like the JIT: compiles, no hot
    kernel spills, and the prefill tile is large enough for Hopper's wgmma (BLOCK_M=16 gives mma.sync)."""
    nvidia_toolchain_or_skip()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(SCRIPT), "90", "--quick"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " 0 failed, 0 hot with spills" in proc.stdout and "attention._unified_attention_3d" in proc.stdout
    assert "regs=None" not in proc.stdout, "cuobjdump gave no resource usage"
    prefill = [line for line in proc.stdout.splitlines() if "_unified_attention_2d" in line and "BLOCK_M=64" in line]
    assert prefill and all("mma=wgmma" in line for line in prefill), proc.stdout[-4000:]
