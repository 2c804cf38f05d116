"""Many clients at once, some hanging up midway: completed streams are well-formed and every KV block comes back."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

HI = [{"role": "user", "content": "Tell me about the weather."}]


async def _chat(client: httpx.AsyncClient, model: str, i: int, cancel: bool) -> dict | None:
    body = {"model": model, "messages": HI, "max_tokens": 3000 if cancel else 24, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "ignore_eos": cancel}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if cancel and len(lines) == 3:
                    return None  # hang up mid-stream
    return {"kind": "chat", "lines": lines}


async def _messages(client: httpx.AsyncClient, model: str, i: int, cancel: bool) -> dict | None:
    body = {"model": model, "messages": HI, "max_tokens": 3000 if cancel else 24, "stream": True}
    async with client.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if cancel and len(events) == 4:
                    return None
    return {"kind": "messages", "events": events}


def _check_chat(lines: list[str]) -> None:
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    ids = [t for ch in chunks for c in ch["choices"] for t in c.get("token_ids", [])]
    finish = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert finish in (["stop"], ["length"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)
    assert len({ch["id"] for ch in chunks}) == 1


def _check_messages(events: list[dict]) -> None:
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
    assert types.count("content_block_start") == types.count("content_block_stop")
    assert events[-2]["usage"]["output_tokens"] <= 24


def _finished(server, prefix: str = 'ember_request_finished_total{reason="') -> dict[str, float]:
    """`ember_request_finished_total` by reason (or another counter by the label value after ``prefix``)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {ln[len(prefix):].split('"')[0]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(prefix)}


def _vllm_finished(server) -> dict[str, float]:
    """vLLM's `vllm:request_success_total` by finished_reason."""
    return _finished(server, 'vllm:request_success_total{finished_reason="')


def _cancelled(server) -> float:
    return _finished(server).get("cancelled", 0.0)


def _ended_by_eos(r: dict) -> bool:
    if r["kind"] == "chat":
        return any(c["finish_reason"] == "stop" for x in r["lines"][:-1] for c in json.loads(x)["choices"])
    return r["events"][-2]["delta"]["stop_reason"] == "end_turn"


def test_64_streams_with_16_cancelled_free_every_block(demo_server):
    """Cancelled requests ask for 3000 tokens: only an abort on disconnect frees their blocks within seconds."""
    before, vllm_before = _finished(demo_server), _vllm_finished(demo_server)
    start = demo_server.stats()
    assert start.num_running == 0 and start.num_waiting == 0

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=demo_server.url, timeout=120, limits=limits) as client:
            jobs = []
            for i in range(64):
                fn = _chat if i % 2 == 0 else _messages
                jobs.append(fn(client, demo_server.model, i, cancel=(i % 4 in (1, 2) and i < 32)))
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    done = [r for r in results if r is not None]
    assert len(done) == 48
    for r in done:
        _check_chat(r["lines"]) if r["kind"] == "chat" else _check_messages(r["events"])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        s = demo_server.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == start.num_free_blocks:
            break
        time.sleep(0.05)
    s = demo_server.stats()
    assert (s.num_running, s.num_waiting) == (0, 0)
    assert s.num_free_blocks == start.num_free_blocks == s.num_total_blocks
    after = _finished(demo_server)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    # Every hang-up is a cancellation, except where the model ended the reply (EOS) before the hang-up reached the
    # server: only the Anthropic requests can (no `ignore_eos` there), and only they count under "eos" beyond the
    # completed replies that ended so.
    eos_before_hang_up = delta.get("eos", 0.0) - sum(_ended_by_eos(r) for r in done)
    assert delta.get("cancelled", 0.0) + eos_before_hang_up == 16 and delta.get("cancelled", 0.0) >= 8
    vllm = {k: d for k, v in _vllm_finished(demo_server).items() if (d := v - vllm_before.get(k, 0.0))}
    assert vllm == {k: n for k, n in (("stop", delta.get("eos", 0.0)), ("length", delta.get("length", 0.0)),
                                      ("abort", delta.get("cancelled", 0.0))) if n}  # the same, as vLLM counts


def test_non_streaming_client_that_hangs_up_frees_its_blocks(demo_server):
    cancelled_before = _cancelled(demo_server)
    start = demo_server.stats().num_free_blocks
    try:
        httpx.post(demo_server.url + "/v1/chat/completions", timeout=0.5, json={
            "model": demo_server.model, "messages": HI, "max_tokens": 3000, "ignore_eos": True})
    except httpx.TimeoutException:
        pass
    deadline = time.monotonic() + 5
    while demo_server.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    s = demo_server.stats()
    assert s.num_running == 0 and s.num_free_blocks == start
    assert _cancelled(demo_server) - cancelled_before == 1  # aborted, not run to its 3000 tokens
