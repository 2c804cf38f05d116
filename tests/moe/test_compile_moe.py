"""The MoE / NVFP4 kernels compile with the real Triton compiler (the interpreter accepts more than it does):
W4A16, fp32 and the dense NVFP4 GEMM for Hopper (sm_90), the W4A4 ``dot_scaled`` kernel for Blackwell (sm_100), each
without spills and within the target's shared memory (fp32 models' MoE once raised OutOfResources on an H200)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.kernels.test_compile import nvidia_toolchain_or_skip

SCRIPT = pathlib.Path(__file__).with_name("compile_check_moe.py")
ROOT = SCRIPT.parent.parent.parent


@pytest.mark.parametrize("arch,kernel", [(90, "_moe_gemm_kernel"), (100, "_moe_gemm_w4a4_kernel")])
def test_moe_kernels_compile(arch, kernel):
    nvidia_toolchain_or_skip()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(arch), "--quick"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " 0 failed, 0 hot with spills" in proc.stdout and f"moe.{kernel}" in proc.stdout
    assert "*fp32,*fp32" in proc.stdout, "no fp32 launch was compiled"
    assert "regs=None" not in proc.stdout, "cuobjdump gave no resource usage"
