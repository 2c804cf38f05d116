"""Serving benchmark: N concurrent streaming clients against a live server; prints a table.

    python benchmarks/serve.py                                  # `ember serve` (demo model) in a subprocess
    python benchmarks/serve.py --in-process                     # the same with the engine loop in-process
    python benchmarks/serve.py --model-dir DIR --concurrency 1,64,256 --requests 256 --max-tokens 64
    python benchmarks/serve.py --url http://host:8000 --model NAME   # an already running `ember serve`
    python benchmarks/serve.py --endpoint completions           # or responses, messages (Anthropic); default chat

Per concurrency level: TTFT p50/p99 (request sent -> first generated token's chunk), inter-token latency p50/p99
(gap between consecutive token-carrying chunks of one stream), output tokens/s (all generated tokens / wall time),
requests/s. Tokens are counted from `return_token_ids`, so withheld text still counts. `ignore_eos` fixes lengths.
The load always runs in its own client process. When this script starts the server it also reports the server
process's CPU time per streamed token (utime+stime from /proc/<pid>/stat: the front end; the engine process is
not included, except with `--in-process`, where the engine is a thread of it) and the engine's mean step time as
the engine reports it (`/health`'s `step_ms`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


ENDPOINTS = ("chat", "completions", "responses", "messages")


def _request(endpoint: str, model: str, prompt: str, max_tokens: int, seed: int) -> tuple[str, dict]:
    """The path and streaming body of one request to ``endpoint`` (lengths fixed by ``ignore_eos`` where the API
    has it; Anthropic's has not)."""
    if endpoint == "messages":
        return "/v1/messages", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": max_tokens, "stream": True}
    if endpoint == "responses":
        return "/v1/responses", {"model": model, "input": prompt, "max_output_tokens": max_tokens, "stream": True,
                                 "ignore_eos": True, "seed": seed, "store": False}
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "seed": seed,
            "return_token_ids": True}
    if endpoint == "completions":
        return "/v1/completions", {**body, "prompt": prompt}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}


def _tokens_in(endpoint: str, event: dict) -> tuple[bool, int]:
    """Whether an SSE event carries generated output, and how many tokens it counts (Anthropic's and the Responses
    API's events carry no token IDs: their deltas count 0 and the closing event's usage carries the total)."""
    if endpoint == "responses":
        kind = event.get("type", "")
        if kind in ("response.completed", "response.incomplete"):
            return False, int((event["response"].get("usage") or {}).get("output_tokens", 0))
        return kind.endswith(".delta"), 0
    if endpoint == "messages":
        if event.get("type") == "message_delta":
            return False, int(event.get("usage", {}).get("output_tokens", 0))
        return event.get("type") == "content_block_delta", 0
    n = sum(len(c.get("token_ids") or ()) for c in event.get("choices", ()))
    return n > 0, n


async def _one(client, url: str, endpoint: str, model: str, prompt: str, max_tokens: int,
               seed: int) -> tuple[float, list[float], int]:
    path, body = _request(endpoint, model, prompt, max_tokens, seed)
    t0 = time.perf_counter()
    ttft, last, gaps, ntok = None, None, [], 0
    async with client.stream("POST", url + path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            carries, n = _tokens_in(endpoint, json.loads(line[6:]))
            ntok += n
            if not carries:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
    return (ttft if ttft is not None else float("nan")), gaps, ntok


async def _level(url: str, endpoint: str, model: str, concurrency: int, requests: int, prompt: str,
                 max_tokens: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        queue = list(range(requests))
        results = []

        async def worker():
            while queue:
                i = queue.pop()
                results.append(await _one(client, url, endpoint, model, prompt, max_tokens, i))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    itls = [g for r in results for g in r[1]]
    tokens = sum(r[2] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "ttft_p50_ms": 1e3 * _pct(ttfts, 50),
            "ttft_p99_ms": 1e3 * _pct(ttfts, 99), "itl_p50_ms": 1e3 * _pct(itls, 50),
            "itl_p99_ms": 1e3 * _pct(itls, 99), "itl_mean_ms": 1e3 * (statistics.fmean(itls) if itls else 0.0),
            "output_tok_s": tokens / wall, "req_s": len(results) / wall, "wall_s": wall, "tokens": tokens}


def _cpu_seconds(pid: int) -> float:
    """utime + stime of one process (its threads included, its children not)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client(url: str, endpoint: str, model: str, concurrency: int, requests: int, prompt: str, max_tokens: int,
            out) -> None:
    out.put(asyncio.run(_level(url, endpoint, model, concurrency, requests, prompt, max_tokens)))


def _run_level(url: str, endpoint: str, model: str, concurrency: int, requests: int, prompt: str,
               max_tokens: int) -> dict:
    """One level, its load generated by a separate client process."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_client, args=(url, endpoint, model, concurrency, requests, prompt, max_tokens, q))
    p.start()
    row = q.get()
    p.join()
    return row


def _start_server(args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "ember.server.cli", "serve", "--port", str(port), "--max-num-seqs",
           str(args.max_num_seqs), "--log-level", "warning"]
    if args.model_dir is not None:
        cmd.insert(4, str(args.model_dir))
    if args.in_process:
        cmd.append("--in-process")
    cmd += args.serve_args.split()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the server did not come up")
        time.sleep(0.3)


def add_server_flags(ap: argparse.ArgumentParser) -> None:
    """The flags that choose the server a benchmark loads: a running one (``--url``) or one it starts."""
    ap.add_argument("--url", default=None, help="a running server; default: start `ember serve` in a subprocess")
    ap.add_argument("--model", default=None, help="model name to send (default: what /v1/models lists)")
    ap.add_argument("--model-dir", type=Path, default=None, help="checkpoint to serve (default: the demo model)")
    ap.add_argument("--in-process", action="store_true", help="serve with the engine loop in the server process")
    ap.add_argument("--serve-args", default="", help="more `ember serve` flags, e.g. '--sse-keepalive-seconds 0'")
    ap.add_argument("--max-num-seqs", type=int, default=256)


def _stop_server(proc: subprocess.Popen | None) -> None:
    """SIGTERM the server this script started (if any), killing it after 30 s."""
    if proc is None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    add_server_flags(ap)
    ap.add_argument("--endpoint", choices=ENDPOINTS, default="chat",
                    help="the streaming API to load (messages: lengths not fixed, tokens from usage)")
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default: 2 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    import httpx

    proc = None
    url = args.url
    if url is None:
        proc, url = _start_server(args)
    try:
        model = args.model or httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        prompt = " ".join(["the weather in paris is mild today and"] * max(1, args.prompt_words // 8))
        _run_level(url, args.endpoint, model, 1, 2, prompt, 4)  # warm-up
        rows = []
        for c in (int(x) for x in args.concurrency.split(",")):
            h0 = httpx.get(url + "/health", timeout=10).json()
            cpu0 = _cpu_seconds(proc.pid) if proc is not None else None
            row = _run_level(url, args.endpoint, model, c, args.requests or 2 * c, prompt, args.max_tokens)
            if cpu0 is not None:
                row["cpu_us_per_token"] = 1e6 * (_cpu_seconds(proc.pid) - cpu0) / max(1, row["tokens"])
            h1 = httpx.get(url + "/health", timeout=10).json()
            row["step_ms"] = h1.get("step_ms", float("nan"))
            row["steps"] = h1.get("num_steps", 0) - h0.get("num_steps", 0)
            rows.append(row)
    finally:
        _stop_server(proc)
    mode = f"server at {args.url}" if args.url else "in-process engine" if args.in_process else "engine process"
    print(f"model {model}  {mode}  endpoint {args.endpoint}  max_tokens {args.max_tokens}")
    head = ("clients", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "step ms", "out tok/s", "req/s",
            "front-end CPU us/token")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['concurrency']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} | "
              f"{r['itl_p99_ms']:.2f} | {r['step_ms']:.2f} | {r['output_tok_s']:.0f} | {r['req_s']:.2f} | "
              f"{_cpu_cell(r.get('cpu_us_per_token'))} |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def _cpu_cell(us: float | None) -> str:
    """A CPU-time cell: n/a for a server this script did not start (its process is not ours to read)."""
    return "n/a" if us is None else f"{us:.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
