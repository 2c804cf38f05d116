"""The engine core in its own process: the default client, per-step messages coalesced for a lagging consumer, one
EOS rule everywhere, and a killed engine process giving errors (500 / SSE error event, /health 503, exit status 1),
never hangs."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from ember.engine.core_client import ProcessEngineClient
from ember.engine.params import SamplingParams
from tests.engine.test_async_engine import refused_duplicate
from tests.server.processes import serving


def test_the_served_engine_runs_in_its_own_process(demo_server):
    engine = demo_server.runtime.engine
    assert isinstance(engine, ProcessEngineClient)
    assert engine.process.is_alive() and engine.process.pid != os.getpid()
    info = engine.model_info
    assert info.kv_capacity_tokens == info.num_kv_blocks * info.block_size == 512 * 16
    assert demo_server.stats().num_total_blocks == info.num_kv_blocks


def test_a_refused_duplicate_request_id_leaves_the_running_request_alone(demo_server):
    """The engine process's client refuses a second request under a running request's ID; the first one runs on to
    its end (its stream was once replaced by the refused one's, which hung it)."""
    refusal, reason, tokens = asyncio.run(refused_duplicate(demo_server.runtime.engine, "dup-process"))
    assert "already in the engine" in refusal
    assert (reason, tokens) == ("length", 60)


def test_a_lagging_consumer_gets_its_tokens_coalesced(demo_server):
    """The engine steps on while this consumer sleeps: its tokens wait merged in one pending output (one item per
    stream, not one per token), and every token arrives once, in order."""
    engine = demo_server.runtime.engine
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    async def run(lag: bool) -> tuple[list[int], list[int]]:
        tokens, sizes = [], []
        async for out in engine.generate([5, 6, 7, 8], params):
            sizes.append(len(out.new_token_ids))
            tokens += out.new_token_ids
            if lag and len(sizes) == 1:
                await asyncio.sleep(1.5)
        return tokens, sizes

    eager, _ = asyncio.run(run(False))
    lagged, sizes = asyncio.run(run(True))
    assert lagged == eager and len(eager) == 48
    assert sizes[1] > 1 and len(sizes) < 48  # the steps taken during the lag arrived as one item


def test_eos_ids_agree_between_engine_grammar_and_parser(qwen3_server):
    """The real Qwen3 tokenizer with generation_config's [<|im_end|>, <|endoftext|>]: one set everywhere."""
    from ember.engine.eos import end_of_turn_ids

    rt = qwen3_server.runtime
    tok = rt.tokenizer
    expected = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    assert set(rt.model_info.eos_token_ids) == expected  # what the engine process stops on
    assert set(end_of_turn_ids(tok, rt.model_info.model_dir)) == expected
    assert set(rt.grammar.backend.eos_ids) == expected  # the grammar backend's EOS set
    assert expected <= set(rt.parser.drop_ids)  # the output pipeline never surfaces them


def _engine_pid(server_pid: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = []
        for task in os.listdir(f"/proc/{server_pid}/task"):
            with open(f"/proc/{server_pid}/task/{task}/children") as f:
                kids += [int(x) for x in f.read().split()]
        for pid in kids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return pid
        time.sleep(0.1)
    raise AssertionError("no engine process found")


def test_killing_the_engine_process_fails_requests_and_stops_the_server(demo_model_dir, tmp_path):
    args = [str(demo_model_dir), "--max-num-seqs", "4", "--kv-cache-blocks", "256", "--log-level", "warning"]
    with serving(args, tmp_path / "serve.log") as served:
        url, proc, log_tail = served.url, served.proc, served.log_tail
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000, "ignore_eos": True}
        results: dict[str, object] = {}

        def blocking() -> None:
            results["plain"] = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)

        t = threading.Thread(target=blocking)
        t.start()
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            first = next(x for x in lines if x.startswith("data: "))
            assert "chat.completion.chunk" in first
            both = time.monotonic() + 60  # the other request is generating too before the kill (a slow thread)
            while httpx.get(url + "/health", timeout=5).json()["num_running"] < 2:
                assert time.monotonic() < both, "the non-streaming request never started\n" + log_tail()
                time.sleep(0.05)
            os.kill(_engine_pid(proc.pid), signal.SIGKILL)
            killed = time.monotonic()
            rest = [x for x in lines if x.startswith("data: ")]
        assert time.monotonic() - killed < 10, log_tail()
        errors = [json.loads(x[6:]) for x in rest if x != "data: [DONE]" and "error" in json.loads(x[6:])]
        assert errors and "engine process died" in errors[0]["error"]["message"], log_tail()
        t.join(30)
        assert "plain" in results, "the non-streaming request got no response\n" + log_tail()
        plain = results["plain"]
        assert plain.status_code == 500 and "engine process died" in plain.json()["error"]["message"]
        try:
            health = httpx.get(url + "/health", timeout=5)
            assert health.status_code == 503
        except httpx.TransportError:
            pass  # already gone
        assert proc.wait(timeout=30) == 1, log_tail()  # as documented: not 0 (a clean stop), nor 143 (SIGTERM)


def test_stopping_a_client_whose_engine_died_unnoticed_returns(demo_model_dir, monkeypatch):
    """The engine process is gone but nothing has noticed yet (its receiver is held back here): shutting the client
    down must not wait forever to hand a dead process its "shutdown" command."""
    monkeypatch.setattr(ProcessEngineClient, "_receive", lambda self: None)
    client = ProcessEngineClient(demo_model_dir)
    client.process.kill()
    client.process.join(10)
    done = threading.Event()
    stopper = threading.Thread(target=lambda: (client.shutdown(timeout=5), done.set()), daemon=True)
    stopper.start()
    assert done.wait(20), "shutdown() is stuck sending to the dead engine process"


def test_a_dead_tensor_parallel_worker_is_named_in_the_engines_death_reason(demo_model_dir):
    """A tensor-parallel worker killed under a running engine: the engine process reports why it stops before it
    exits, and the front end's death reason (what /health and later requests answer) names the worker, not only
    the engine process's own exit code. By the time the request in flight fails, the client is already dead to new
    requests (/health answered 200 between the two, while the engine process tore down)."""
    from ember.engine.args import EngineArgs
    from ember.engine.client import EngineDeadError

    client = ProcessEngineClient(demo_model_dir, EngineArgs(tensor_parallel_size=2, cpu_threads=1,
                                                            kv_cache_blocks=64))
    worker_died = "tensor-parallel worker ember-tp-worker-1 died unexpectedly (exit code -9); the engine stops"

    async def in_flight() -> tuple[str | None, bool]:
        params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
        async for out in client.generate([1, 2, 3], params):
            if out.finished:
                return out.error, client.is_alive()
            if out.new_token_ids and not killed:
                killed.append(True)
                pid = client.process.pid
                (worker,) = open(f"/proc/{pid}/task/{pid}/children").read().split()
                os.kill(int(worker), signal.SIGKILL)
        return None, client.is_alive()

    async def after() -> None:
        async for _ in client.generate([1, 2, 3], SamplingParams(max_tokens=1)):
            pass

    killed: list[bool] = []
    try:
        error, alive = asyncio.run(in_flight())
        assert error == worker_died and not alive
        try:
            asyncio.run(after())
            raise AssertionError("a request after the engine reported its failure was accepted")
        except EngineDeadError:
            pass
        client.process.join(30)
        deadline = time.monotonic() + 10
        while not (client.death_reason or "").startswith("the engine process died") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.death_reason == f"the engine process died (exit code 1): {worker_died}"
    finally:
        client.shutdown()


def test_sigterm_cuts_the_streams_still_running_at_the_shutdown_deadline(demo_model_dir, tmp_path):
    """On SIGTERM the server drains for --shutdown-timeout: a client still reading a long stream then learns why it
    ended (the error event, then [DONE], before its connection closes); a client that holds its stream open without
    reading cannot keep the server alive; the server exits 0 within the timeout."""
    args = [str(demo_model_dir), "--max-num-seqs", "20", "--kv-cache-blocks", "4096", "--log-level", "warning",
            "--shutdown-timeout", "2"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "stream": True}
    with serving(args, tmp_path / "serve.log") as served:
        url = served.url + "/v1/chat/completions"
        # 16 choices of 3000 tokens: more than the socket buffers hold, and more than the time allowed
        with httpx.stream("POST", url, json={**chat, "max_tokens": 3000, "n": 16}, timeout=60) as held:
            assert next(x for x in held.iter_lines() if x.startswith("data: "))  # then read no more
            with httpx.stream("POST", url, json={**chat, "max_tokens": 100000}, timeout=60) as reading:
                lines = reading.iter_lines()
                assert next(x for x in lines if x.startswith("data: "))
                served.proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                rest = [x for x in lines if x.startswith("data: ")]
            assert 0.5 < time.monotonic() - sent < 6, served.log_tail()  # the 2 s drain, with room for a busy CI
            assert rest[-1] == "data: [DONE]", rest[-3:]
            error = json.loads(rest[-2][6:])
            assert "shutting down" in error["error"]["message"], error
            assert all("error" not in json.loads(x[6:]) for x in rest[:-2])
            try:
                code = served.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0 and time.monotonic() - sent < 10, served.log_tail()


def test_an_abort_ends_the_stream_at_once_even_while_the_engine_stalls(demo_model_dir):
    """The shutdown deadline aborts what still runs so each client gets its error before the connections close: the
    stream ends at the abort, not when the engine process answers (a long or stalled step held every client past
    the deadline, which then cut them with no error)."""
    from ember.engine.args import EngineArgs

    client = ProcessEngineClient(demo_model_dir, EngineArgs(kv_cache_blocks=64))

    async def stalled() -> tuple[str | None, float]:
        params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
        aborted_at = 0.0
        async for out in client.generate([1, 2, 3], params, request_id="r1"):
            if out.finished:
                return out.finish_reason, time.monotonic() - aborted_at
            if out.new_token_ids and not stopped:
                os.kill(client.process.pid, signal.SIGSTOP)
                stopped.append(True)
                aborted_at = time.monotonic()
                client.abort("r1")
        return None, 0.0

    stopped: list[bool] = []
    try:
        reason, waited = asyncio.run(asyncio.wait_for(stalled(), 20))
        assert reason == "abort" and waited < 2, (reason, waited)
    finally:
        if stopped:
            os.kill(client.process.pid, signal.SIGCONT)
        client.shutdown()


def test_an_engine_whose_front_end_was_killed_exits_and_removes_the_socket_files(demo_model_dir, tmp_path):
    """`kill -9` of the server process: its engine process notices, stops, and removes the two IPC socket files the
    front end would have removed (they were left in /tmp, one pair per such death)."""
    script = tmp_path / "front.py"
    script.write_text(
        "import os, signal, sys\n"
        "from ember.engine.args import EngineArgs\n"
        "from ember.engine.core_client import ProcessEngineClient\n"
        "if __name__ == '__main__':\n"
        f"    c = ProcessEngineClient({str(demo_model_dir)!r}, EngineArgs(kv_cache_blocks=16))\n"
        "    print(c.process.pid, *c._addrs, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    pid, *addrs = r.stdout.split()
    paths = [a.removeprefix("ipc://") for a in addrs]
    assert r.returncode == -signal.SIGKILL and len(paths) == 2, r.stderr

    def running() -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running()
    assert not any(os.path.exists(p) for p in paths), paths
