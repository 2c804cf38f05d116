"""`ember serve --tensor-parallel-size 2` on the CPU (gloo): the served greedy reply equals the single-process one."""
from __future__ import annotations

import httpx

from ember.server import cli
from ember.server.app import BackgroundServer, create_app, load_runtime


def served_reply(model_dir, tp: int, monkeypatch) -> dict:
    """Parse the flags with the real CLI, serve on a loopback port, and ask for one greedy reply."""
    seen = []
    with monkeypatch.context() as m:
        m.setattr(cli, "serve", lambda config: seen.append(config) or 0)
        cli.main(["serve", str(model_dir), "--max-num-seqs", "4", "--tensor-parallel-size", str(tp)])
    (config,) = seen
    assert config.tensor_parallel_size == tp
    runtime = load_runtime(config)
    server = BackgroundServer(create_app(runtime, config)).start()
    try:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model,
                "messages": [{"role": "user", "content": "Tell me about paged attention."}],
                "temperature": 0, "max_tokens": 12, "return_token_ids": True}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    finally:
        server.stop()
        shutdown = getattr(runtime.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()


def test_two_ranks_serve_the_same_greedy_reply(demo_model_dir, monkeypatch):
    one = served_reply(demo_model_dir, 1, monkeypatch)
    two = served_reply(demo_model_dir, 2, monkeypatch)
    assert one["choices"][0]["message"] == two["choices"][0]["message"]
    assert one["choices"][0]["token_ids"] == two["choices"][0]["token_ids"]
    assert one["usage"] == two["usage"]
