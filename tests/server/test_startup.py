"""A user's first hour with `ember serve`, through the real console script in a subprocess: a Hugging Face model id
served from the hub cache offline, start-up mistakes reported in one line (before the weights load where possible),
the start-up report, several API keys, CORS off by default, and the vLLM metric names after a request."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from ember.server.app import free_port
from tests.server.processes import ember_cmd, serving
from tests.server.test_model_source import COMMIT, REPO_ID, hub_cache


def run_ember(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*ember_cmd(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def error_line(r: subprocess.CompletedProcess) -> str:
    """The one line a failed start prints on stderr (log lines before it are allowed, a traceback is not)."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def hub_server(demo_model_dir, tmp_path_factory):
    """`ember serve tiny-org/tiny-demo` with HF_HUB_OFFLINE=1 and HF_HOME on a hand-built hub cache."""
    root = tmp_path_factory.mktemp("hf-home")
    hub_cache(root, demo_model_dir)
    log = root / "serve.log"
    env = {"HF_HOME": str(root), "HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1"}
    args = [REPO_ID, "--max-num-seqs", "4", "--kv-cache-blocks", "64", "--api-key", "first-key", "--api-key",
            "second-key"]
    with serving(args, log, env) as served:
        yield served.url, log


def test_a_hub_id_is_served_from_the_hub_cache_offline(hub_server):
    url, log = hub_server
    headers = {"Authorization": "Bearer second-key"}
    models = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()
    assert models["data"][0]["id"] == REPO_ID  # the served name is the hub id, not the snapshot folder's
    r = httpx.post(url + "/v1/chat/completions", headers={"x-api-key": "first-key"}, timeout=60,
                   json={"model": REPO_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == REPO_ID
    wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer third-key"}, timeout=10)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    text = log.read_text()
    snapshot = f"models--tiny-org--tiny-demo/snapshots/{COMMIT}"
    assert re.search(rf"model '{REPO_ID}' from \S*{snapshot}: Qwen3ForCausalLM, \w+ on \w+\S*, loaded in [\d.]+ s",
                     text), text
    assert "KV cache: 64 blocks of 16 tokens = 1024 tokens; max_model_len 4096" in text
    assert re.search(r"parser profile qwen3 \(tools on\); delimiter token IDs: .*<think>=\d+", text)
    assert f"OpenAI API at {url}/v1" in text


def test_cors_is_off_by_default(hub_server):
    url, _ = hub_server
    pre = httpx.options(url + "/v1/chat/completions", timeout=10, headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


def test_vllm_metric_names_after_a_request(hub_server):
    url, _ = hub_server
    body = {"messages": [{"role": "user", "content": "metrics " * 20}], "max_tokens": 4, "ignore_eos": True}
    for _ in range(2):  # the second one hits the prefix cache
        r = httpx.post(url + "/v1/chat/completions", headers={"x-api-key": "first-key"}, json=body, timeout=60)
        assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    text = httpx.get(url + "/metrics", timeout=10).text
    label = f'{{model_name="{REPO_ID}"}}'

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name + label)} (\S+)$", text, flags=re.M)
        assert m, f"{name}{label} is not exported"
        return float(m.group(1))

    assert value("vllm:num_requests_running") == 0 and value("vllm:num_requests_waiting") == 0
    assert 0 <= value("vllm:kv_cache_usage_perc") <= 1
    assert value("vllm:prompt_tokens_total") >= 2 * 20
    assert value("vllm:generation_tokens_total") >= 8
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert value(hist + "_count") >= 2, hist
    assert value("vllm:inter_token_latency_seconds_count") >= 6
    assert value("vllm:prefix_cache_queries_total") >= 2 * 20
    assert 16 <= value("vllm:prefix_cache_hits_total") <= value("vllm:prefix_cache_queries_total")
    assert "ember_prompt_tokens_total " in text  # Ember's own names stay


def test_a_model_missing_offline_is_one_line(tmp_path):
    r = run_ember("serve", "tiny-org/absent", "--port", str(free_port()),
                  env={"HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2
    line = error_line(r)
    assert "tiny-org/absent is not in the Hugging Face cache" in line and "HF_HUB_OFFLINE=1" in line
    assert "`hf download tiny-org/absent`" in line and "local checkpoint directory" in line


def test_a_port_in_use_is_reported_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = run_ember("serve", "--port", str(port), env={"EMBER_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 2
    line = error_line(r)
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in line
    assert not (tmp_path / "demo").exists()  # nothing was built or loaded
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("args, message", [
    (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: 'lots' is not a size in bytes"),
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: '1.5' is not in (0, 1]"),
    (["--chat-template", "typo.jinja"], "argument --chat-template: typo.jinja: no such file"),
    (["--tool-parser", "hermes2"], "argument --tool-parser: 'hermes2' is unknown; known: none, qwen3"),
    (["./no/such/checkpoint"], "./no/such/checkpoint: no such directory, and not a Hugging Face model id"),
    (["--download-dir", __file__], "argument --download-dir: "),
    (["--kv-cache-memory", "inf"], "argument --kv-cache-memory: 'inf' is not a finite size"),  # was a traceback
    (["--kv-cache-memory", "1e400G"], "argument --kv-cache-memory: '1e400G' is not a finite size"),
    (["--kv-cache-blocks", "99999999999999999999"], "argument --kv-cache-blocks: 99999999999999999999 is out of "
                                                    "range: must be from 1 to 2147483647"),
    (["--max-num-seqs", "99999999999999999999"], "argument --max-num-seqs: 99999999999999999999 is out of range"),
    (["--chat-template", str(Path(__file__).parent)], "/server: is a directory"),
])
def test_bad_arguments_are_one_line_with_exit_code_2(args, message):
    r = run_ember("serve", *args, timeout=60)
    assert r.returncode == 2
    line = error_line(r)
    assert message in line and "parse_" not in line
    assert r.stderr.strip() == line  # nothing else: no usage block, no log


def test_version():
    from importlib import metadata

    r = run_ember("--version", timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"ember {metadata.version('ember')}"


@pytest.mark.parametrize("template, what", [
    ("{{ raise_exception('this template needs a system message') }}", "a one-message conversation"),
    ("{% if tools %}{{ raise_exception('tools are not supported') }}{% endif %}"
     "{% for m in messages %}{{ m.content }}{% endfor %}", "a conversation with a tool"),
])
def test_a_chat_template_that_cannot_render_stops_the_start(demo_model_dir, tmp_path, template, what):
    path = tmp_path / "broken.jinja"
    path.write_text(template)
    r = run_ember("serve", str(demo_model_dir), "--chat-template", str(path), "--kv-cache-blocks", "16",
                  "--port", str(free_port()), "--log-level", "warning", "--in-process")
    assert r.returncode == 2
    line = error_line(r)
    assert f"--chat-template {path} fails to render {what}:" in line
    assert ("needs a system message" if "one-message" in what else "tools are not supported") in line


def test_a_template_file_that_is_not_utf8_is_a_bad_argument(tmp_path):
    path = tmp_path / "latin1.jinja"
    path.write_bytes(b"\xff\xfe {{ messages }}")
    r = run_ember("serve", "--chat-template", str(path), timeout=60)
    assert r.returncode == 2 and f"argument --chat-template: {path}: not UTF-8 text" in error_line(r)


@pytest.mark.parametrize("mode, args, message", [  # the engine's own process (the default), and this one
    ([], ["--max-model-len", "8k"], "--max-model-len: max_model_len 8000 exceeds the model's context of 4096 tokens"),
    (["--in-process"], ["--max-model-len", "8k"], "--max-model-len: max_model_len 8000 exceeds the model's context"),
    (["--in-process"], ["--tensor-parallel-size", "3"], "--tensor-parallel-size: "),
    (["--in-process"], ["--kv-cache-blocks", "2000000000"], "--kv-cache-blocks: a KV cache of "),
])
def test_a_setting_the_model_or_machine_cannot_take_is_a_bad_argument(demo_model_dir, mode, args, message):
    """Found as the engine starts (in its own process or this one), but the flag's fault, not the model's: exit 2
    naming the flag, not "cannot load MODEL" (exit 1)."""
    r = run_ember("serve", str(demo_model_dir), *args, "--port", str(free_port()), "--log-level", "warning", *mode)
    assert r.returncode == 2, r.stderr
    line = error_line(r)
    assert line.startswith(f"ember serve: error: {message}") and "cannot load" not in line, line


def test_a_model_that_cannot_load_is_one_line_unless_debug(tmp_path):
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}')
    r = run_ember("serve", str(bad), "--port", str(free_port()), "--log-level", "warning", "--in-process")
    assert r.returncode == 1
    assert error_line(r).startswith(f"ember serve: error: cannot load {bad}: ")
    debug = run_ember("serve", str(bad), "--port", str(free_port()), "--log-level", "debug", "--in-process")
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_asking_for_a_classifier_with_a_generative_checkpoint_stops_the_start(demo_model_dir):
    r = run_ember("serve", str(demo_model_dir), "--task", "score", "--kv-cache-blocks", "16",
                  "--port", str(free_port()), "--log-level", "warning", "--in-process")
    assert r.returncode == 2
    assert "--task score: Qwen3ForCausalLM is not a classifier" in error_line(r)


def test_another_models_tokenizer_stops_the_start(demo_model_dir, tmp_path):
    """A --tokenizer whose vocabulary is larger than the model's (Qwen3's 151k for a 1280-token model) started and
    then refused every prompt for token IDs the model lacks; it now stops the start naming both sizes."""
    from tests.conftest import write_shared_tokenizer

    qwen3 = write_shared_tokenizer("qwen3", tmp_path / "qwen3")
    r = run_ember("serve", str(demo_model_dir), "--tokenizer", str(qwen3), "--kv-cache-blocks", "16",
                  "--port", str(free_port()), "--log-level", "warning", "--in-process")
    assert r.returncode == 2, r.stderr
    assert f"--tokenizer {qwen3}: its vocabulary has 151643 tokens, more than the model's 1280" in error_line(r)


def _log_times(stderr: str, pattern: str) -> list[float]:
    """The timestamps (seconds since the epoch) of the log lines matching ``pattern``."""
    from datetime import datetime

    stamps = re.findall(rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) {pattern}", stderr, flags=re.M)
    return [datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f").timestamp() for s in stamps]


def test_an_engine_side_failure_is_reported_as_soon_as_the_engine_fails(demo_model_dir, tmp_path):
    """The engine process reads config.json and refuses the architecture; `ember serve` says so in one line and
    exits 1 at once, not after waiting for the failed engine process (it used to hang in zmq's term for 10 s)."""
    import json
    import shutil

    bad = tmp_path / "unknown-arch"
    shutil.copytree(demo_model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    t0 = time.monotonic()
    r = run_ember("serve", str(bad), "--kv-cache-blocks", "16", "--port", str(free_port()), "--log-level", "warning")
    wall = time.monotonic() - t0
    assert r.returncode == 1
    line = error_line(r)
    assert line.startswith(f"ember serve: error: cannot load {bad}: ")
    assert "'NoSuchForCausalLM' is not supported" in line
    assert wall < 60, wall
    debug = run_ember("serve", str(bad), "--kv-cache-blocks", "16", "--port", str(free_port()), "--log-level", "debug")
    assert debug.returncode == 1
    (failed,) = _log_times(debug.stderr, "DEBUG ember.engine.core: engine start-up failed")
    (reported,) = _log_times(debug.stderr, f"ERROR ember.server: loading {re.escape(str(bad))} failed")
    assert reported - failed < 2, debug.stderr


@pytest.mark.parametrize("cache", ["a-file", "/proc/ember"])
def test_an_unusable_cache_dir_for_the_demo_model_is_one_line(tmp_path, cache):
    if cache == "a-file":
        cache = str(tmp_path / "a-file")
        (tmp_path / "a-file").write_text("not a directory")
    r = run_ember("serve", "--port", str(free_port()), env={"EMBER_CACHE_DIR": cache}, timeout=60)
    assert r.returncode == 2
    line = error_line(r)
    assert line.startswith(f"ember serve: error: EMBER_CACHE_DIR={cache}: cannot build the demo model in "
                           f"{cache}/demo ("), line


@contextlib.contextmanager
def _own_session(model_dir, log, *extra: str) -> Iterator[subprocess.Popen]:
    """`ember serve MODEL --port 0` (then ``extra`` flags, which win) in a session of its own (so a test can signal
    its whole process group, as Ctrl-C in a terminal does), its stderr in ``log``; killed afterwards if still
    running. SIGINT starts at its default disposition, as in a terminal's foreground job, even where this suite
    runs as a background job (whose shell ignores SIGINT for it, a disposition its children inherit)."""
    with open(log, "w") as err:
        proc = subprocess.Popen([*ember_cmd(), "serve", str(model_dir), "--kv-cache-blocks", "16", "--port", "0",
                                 *extra],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                preexec_fn=_default_sigint)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.parametrize("stop", ["SIGTERM", "Ctrl-C"])
def test_port_0_logs_the_port_it_got_and_a_signal_stops_the_server_cleanly(demo_model_dir, tmp_path, stop):
    """`--port 0` serves on a free port and says which; SIGTERM to the server (docker stop, Kubernetes) or SIGINT to
    its whole process group (Ctrl-C in a terminal: the engine process gets it too) drains the server and exits 0,
    with no traceback and no teardown noise."""
    log = tmp_path / "serve.log"
    with _own_session(demo_model_dir, log) as proc:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"ready: OpenAI API at http://127\.0\.0\.1:(\d+)/v1", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        port = int(m.group(1))
        assert port != 0
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        if stop == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text and "nanobind: leaked" not in text, text


def test_sigterm_right_after_the_ready_line_drains_and_exits_0(demo_model_dir, tmp_path):
    """Between the ready line and uvicorn taking the signals (building the app, some 0.3 s) a SIGTERM killed the
    process outright (status -15, the engine's socket files left behind); it now starts the usual graceful stop."""
    log = tmp_path / "serve.log"
    with _own_session(demo_model_dir, log) as proc:
        deadline = time.monotonic() + 120
        while "ready: OpenAI API at" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    assert "Traceback" not in log.read_text()


def test_ctrl_c_while_the_model_loads_stops_in_one_line(demo_model_dir, tmp_path):
    """Ctrl-C (SIGINT to the whole process group) while the engine process is starting: one line, exit code 130,
    no traceback, and no engine process left behind. (A run whose server was ready before the Ctrl-C could be sent,
    on a machine busy elsewhere, missed the moment: it is tried again.)"""
    log = tmp_path / "serve.log"
    for _ in range(3):
        with _own_session(demo_model_dir, log) as proc:
            engine = _engine_of(proc, log)
            deadline = time.monotonic() + 120
            while _ignores_sigint(proc.pid):  # the parent's few milliseconds spawning it, when a Ctrl-C is lost
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.01)
            if "ready:" in log.read_text():  # the engine had started already: not the moment this test is about
                continue
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(timeout=60) == 130, log.read_text()
            break
    else:
        pytest.fail("the server was ready before each Ctrl-C: " + log.read_text())
    text = log.read_text()
    assert "Traceback" not in text and text.rstrip().endswith("ember serve: interrupted while starting"), text
    assert _gone(engine, within=10)


def _engine_of(proc: subprocess.Popen, log) -> int:
    """The process ID of ``proc``'s engine process, as soon as it is spawned."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        engine = next((int(k) for k in kids if _is_engine(int(k))), None)
        if engine is not None:
            return engine
        time.sleep(0.02)


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    return not os.path.exists(f"/proc/{pid}") or " Z " in open(f"/proc/{pid}/stat").read()


def test_sigterm_while_the_engine_process_starts_stops_it_too(demo_model_dir, tmp_path):
    """`docker stop` (SIGTERM to the server alone) while its engine process is still importing: one line, exit code
    143, and the engine process does not outlive it (it read its parent's ID after its imports, when the server
    was already gone, and so never noticed)."""
    log = tmp_path / "serve.log"
    with _own_session(demo_model_dir, log) as proc:
        engine = _engine_of(proc, log)
        deadline = time.monotonic() + 120
        while _ignores_sigint(proc.pid):  # the few milliseconds of the spawn itself, where the child would be cut
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, log.read_text()
    assert log.read_text().rstrip().endswith("ember serve: terminated while starting"), log.read_text()
    assert _gone(engine, within=30)


def test_ctrl_c_twice_with_a_stream_in_flight_exits_and_stops_the_engine(demo_model_dir, tmp_path):
    """A second Ctrl-C (uvicorn's "force quit") skips the graceful drain: the server still stops its engine
    process and exits, rather than hanging at exit on it."""
    log = tmp_path / "serve.log"
    with _own_session(demo_model_dir, log, "--kv-cache-blocks", "4096") as proc:  # room for a long stream
        engine = _engine_of(proc, log)
        deadline = time.monotonic() + 120
        while not (m := re.search(r"ready: OpenAI API at http://127\.0\.0\.1:(\d+)/v1", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        body = {"prompt": "hi", "max_tokens": 100000, "ignore_eos": True, "stream": True}
        started = threading.Event()

        def read() -> None:
            with contextlib.suppress(httpx.HTTPError), httpx.stream(
                    "POST", f"http://127.0.0.1:{m.group(1)}/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    started.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(60)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        assert code is not None, log.read_text()
    assert _gone(engine, within=10), log.read_text()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ignores_sigint(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        ignored = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(ignored & 1 << (signal.SIGINT - 1))


def _is_engine(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except OSError:
        return False
