"""The attention kernels compile for Hopper (sm_90) with the real Triton compiler, which the interpreter does not."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("compile_check.py")


def test_attention_core_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "90", "--quick"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 failed" in proc.stdout and "attention._unified_attention_3d" in proc.stdout
