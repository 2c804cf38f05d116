"""benchmarks/gpu_check.py on a CPU (Triton interpreter, toy shapes): every section writes its JSON, a failing check
or a raising section never stops the next, a broken device context hands the rest to a fresh process, and the hard
deadline is honoured."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import time

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
NAMES = ["kernels", "parity", "attention", "moe", "graphs", "scale"]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("gpu_check", None)


def _sections(out: pathlib.Path) -> dict[str, dict]:
    return {json.loads(p.read_text())["section"]: json.loads(p.read_text()) for p in sorted(out.glob("[1-9]_*.json"))}


def test_quick_run_with_a_failing_check_and_a_raising_section(gpu_check, tmp_path, monkeypatch, capsys):
    from ember.kernels import reference_ops

    assert [s.name for s in gpu_check.SECTIONS] == NAMES
    # a wrong reference: the silu_and_mul check fails, the other kernel checks still run and pass
    monkeypatch.setattr(reference_ops, "silu_and_mul", lambda x: x[..., : x.shape[-1] // 2])

    parity_run = gpu_check.SECTIONS[1].run

    def boom(ctx):  # the real section, then an exception
        parity_run(ctx)
        raise RuntimeError("injected section failure")

    monkeypatch.setattr(gpu_check.SECTIONS[1], "run", boom)
    # a kernel fault that breaks the CUDA context, simulated after section 5: section 6 runs in a fresh process
    calls = []
    monkeypatch.setattr(gpu_check, "context_broken", lambda: len(calls.append(1) or calls) == 5)
    rc = gpu_check.main(["--out", str(tmp_path), "--quick", "--budget-s", "300"])  # ample: see the next test
    assert rc == 1
    got = _sections(tmp_path)
    assert list(got) == NAMES  # one JSON per section, in order
    kernels = got["kernels"]
    assert kernels["status"] == "fail"
    failed = [c["name"] for c in kernels["checks"] if not c["ok"]]
    assert failed == ["silu_and_mul"]
    assert len(kernels["checks"]) > 15 and any(c["name"].startswith("moe nvfp4") for c in kernels["checks"])
    parity = got["parity"]
    assert parity["status"] == "error" and "injected section failure" in parity["errors"][0]
    assert [c["name"] for c in parity["checks"] if c["ok"]] == [
        "qwen3: device fp32 eager == cpu", "qwen3: cuda graphs == eager",
        "qwen3: fp8 kv cache first tokens == fp32 cache (but near-ties)",
        "qwen3 + lora: the adapter changes the cpu reference's tokens", "qwen3 + lora: device fp32 eager == cpu",
        "qwen3 + lora: cuda graphs == eager",
        "XLMRobertaModel: device fp32 == cpu", "BertForSequenceClassification: device fp32 == cpu",  # --quick
        "qwen3 + ngram: device fp32 speculative == cpu plain", "qwen3 + ngram: drafts kept on the device",
        "qwen3-moe: device fp32 eager == cpu",
        "qwen3-moe: cuda graphs == eager", "qwen3-next: device fp32 eager == cpu", "qwen3-next: cuda graphs == eager",
        "gemma2: device fp32 eager == cpu", "gemma2: cuda graphs == eager",  # --quick: one model per device path
        "llama4: device fp32 eager == cpu", "llama4: cuda graphs == eager"]
    for name in NAMES[2:]:
        assert got[name]["status"] == "ok", (name, got[name].get("errors"), got[name].get("timeout"))
        assert all(c["ok"] for c in got[name]["checks"]), name
    # where the decode step's time goes: the forward at the e2e batch and the NVFP4 MoE at decode sizes, by kernel
    by_kernel = [got["graphs"]["time_by_kernel"]] + [r["nvfp4_by_kernel"] for r in got["moe"]["rows"]
                                                     if r.get("kind") == "moe"]
    assert len(by_kernel) == 3 and not got["graphs"].get("diagnostic_errors"), got["graphs"].get("diagnostic_errors")
    for prof in by_kernel:
        assert prof["total_us"] > 0 and prof["kernels"]
        assert sum(k["us"] for k in prof["kernels"]) <= prof["total_us"] * 1.0001
        assert [k["us"] for k in prof["kernels"]] == sorted((k["us"] for k in prof["kernels"]), reverse=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    # the fresh process imported the engine, the loader and transformers itself: nothing the GPU image lacks
    assert "import_error" not in summary, summary["import_error"]
    assert [s["status"] for s in summary["sections"]] == ["fail", "error", "ok", "ok", "ok", "ok"]
    targets = {t["name"].split(" ")[0] for t in summary["targets"]}
    assert targets == {"decode", "NVFP4", "graph", "e2e"}  # every target's code path ran (values mean nothing here)
    table = capsys.readouterr().out
    assert "FAIL silu_and_mul" in table and "e2e decode B=2 (async scheduling) /" in table
    log = (tmp_path / "gpu_check.log").read_text()
    assert "sections 6.. go on in a fresh process" in log and "== 6_scale" in log and "FAIL silu_and_mul" in log
    assert len(calls) == 5  # the fresh process ran section 6


def test_deadline_is_honoured(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "GRACE_S", 1.0)
    budget = 3.0
    t0 = time.monotonic()
    gpu_check.main(["--out", str(tmp_path), "--quick", "--budget-s", str(budget)])
    elapsed = time.monotonic() - t0
    assert elapsed < budget + 1.0 + 3.0, elapsed  # budget, grace, and the summary
    got = _sections(tmp_path)
    assert list(got) == NAMES
    statuses = [got[n]["status"] for n in NAMES]
    assert "timeout" in statuses and statuses[-1] == "skipped", statuses
    assert all(s in ("ok", "timeout", "skipped") for s in statuses), statuses
    timed_out = [got[n] for n in NAMES if got[n]["status"] == "timeout"]
    assert all("s left" in d["timeout"] or "hard deadline" in d["timeout"] for d in timed_out)


def test_parity_tolerates_only_near_ties(gpu_check):
    from gpu_sections import parity
    from gpu_sections.common import Report

    want = parity.Run([[5, 6, 7], [1, 2, 3]], [[3.0, 0.001, 2.0], [4.0, 4.0, 4.0]], {})
    near_tie = parity.Run([[5, 9, 9], [1, 2, 3]], [], {})  # differs where the reference's top-2 margin is 0.001
    real_bug = parity.Run([[5, 6, 7], [1, 8, 3]], [], {})  # differs where the margin is 4 nats
    rep = Report(pathlib.Path("/tmp"), "unused")
    ctx = type("C", (), {"report": rep})()
    assert parity.check_agree(ctx, "tie", near_tie, want)
    assert not parity.check_agree(ctx, "bug", real_bug, want)
    assert parity.check_agree(ctx, "same", want, want)
    assert [c["exact"] for c in rep.data["checks"]] == [False, False, True]
    assert rep.data["checks"][1]["differences"][0]["position"] == 1


def test_a_stuck_section_is_interrupted_at_the_hard_deadline(gpu_check, tmp_path, monkeypatch):
    """A section that never checks its deadline is stopped by the alarm at budget + grace; the rest are skipped."""
    def stuck(ctx):
        while True:
            time.sleep(0.01)

    monkeypatch.setattr(gpu_check, "GRACE_S", 1.0)
    monkeypatch.setattr(gpu_check.SECTIONS[0], "run", stuck)
    t0 = time.monotonic()
    gpu_check.main(["--out", str(tmp_path), "--quick", "--budget-s", "2"])
    elapsed = time.monotonic() - t0
    assert 2.0 + 1.0 <= elapsed < 2.0 + 1.0 + 3.0, elapsed
    got = _sections(tmp_path)
    assert got["kernels"]["status"] == "timeout" and "hard deadline" in got["kernels"]["timeout"]
    assert [got[n]["status"] for n in NAMES[1:]] == ["skipped"] * 5


def test_the_full_parity_section_runs_the_models_quick_leaves_out(gpu_check, tmp_path):
    """Without --quick the parity section also runs what --quick leaves out (GLM-4.5, Gemma 3, MiniMax-M2, two more
    encoders); ``--models`` runs just those (the quick run above covers the rest)."""
    left_out = ["encoders", "glm4-moe", "gemma3", "minimax-m2"]
    gpu_check.main(["--out", str(tmp_path), "--sections", "parity", "--budget-s", "300",
                    "--models", ",".join(left_out)])
    parity = json.loads((tmp_path / "2_parity.json").read_text())
    assert parity["status"] == "ok", parity.get("errors") or parity.get("timeout")
    names = {c["name"].split(":")[0] for c in parity["checks"] if c["ok"]}
    assert names == {"glm4-moe", "gemma3", "minimax-m2", "BertModel", "XLMRobertaModel",
                     "BertForSequenceClassification", "XLMRobertaForSequenceClassification"}


def test_an_unknown_parity_model_is_refused_by_name(gpu_check, tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--models", "qwen3,gpt-5"])
    assert "gpt-5" in capsys.readouterr().err
