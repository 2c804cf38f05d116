"""The MoE part of the GPU check runs end to end (tiny shapes, interpreter on CPU) and its checks pass."""
from __future__ import annotations

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check_moe.py"


class _Report:
    def __init__(self) -> None:
        self.data: dict = {}
        self.lines: list[str] = []

    def log(self, *parts) -> None:
        self.lines.append(" ".join(str(p) for p in parts))

    def save(self) -> None:
        pass


def test_smoke_run_fills_the_report():
    spec = importlib.util.spec_from_file_location("gpu_check_moe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rep = _Report()
    mod.run(rep, smoke=True)
    mod.print_table(rep)
    assert [r["M"] for r in rep.data["moe"]] == [1, 16]
    assert all(r["experts_touched"] >= 1 and r["nvfp4_ms"] > 0 for r in rep.data["moe"])
    assert rep.data["checks"] and all(c["ok"] for c in rep.data["checks"])
    assert any("x floor" in line for line in rep.lines)
