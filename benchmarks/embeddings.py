"""Pooling benchmark: N concurrent clients posting `/v1/embeddings` (or `/classify`) batches to a live server;
prints a table.

    python benchmarks/embeddings.py                                 # `ember serve` (demo model) in a subprocess
    python benchmarks/embeddings.py --concurrency 1,16 --batch 32 --words 64
    python benchmarks/embeddings.py --url http://host:8000 --model NAME
    python benchmarks/embeddings.py --route /classify --model-dir PATH/TO/...ForSequenceClassification

Per concurrency level: request latency p50/p99, inputs/s and prompt tokens/s (all embedded inputs or tokens / wall
time), and, when this script starts the server, the server process's CPU time per input (the front end: JSON,
tokenizing, pooling the vectors out; the engine process is not included). Every input is distinct (a counter leads
it), so the prefix cache does not serve one input from another.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import _cpu_cell, _cpu_seconds, _pct, _start_server, _stop_server, add_server_flags  # noqa: E402


async def _level(url: str, model: str, concurrency: int, requests: int, batch: int, words: int,
                 route: str = "/v1/embeddings") -> dict:
    import httpx

    sentence = " ".join(["the weather in paris is mild today and"] * max(1, words // 8))
    latencies: list[float] = []
    tokens = 0
    counter = iter(range(10**9))

    async def worker(client: httpx.AsyncClient, n: int) -> None:
        nonlocal tokens
        for _ in range(n):
            inputs = [f"{next(counter)} {sentence}" for _ in range(batch)]
            t0 = time.perf_counter()
            r = await client.post(url + route, json={"model": model, "input": inputs})
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            tokens += r.json()["usage"]["prompt_tokens"]

    per = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(worker(client, n) for n in per))
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": requests, "inputs": requests * batch,
            "p50_ms": 1e3 * _pct(latencies, 50), "p99_ms": 1e3 * _pct(latencies, 99),
            "mean_ms": 1e3 * statistics.mean(latencies), "inputs_s": requests * batch / wall,
            "tokens_s": tokens / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    add_server_flags(ap)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default: 4 x concurrency)")
    ap.add_argument("--batch", type=int, default=16, help="inputs per request")
    ap.add_argument("--words", type=int, default=32, help="words per input")
    ap.add_argument("--route", default="/v1/embeddings", choices=("/v1/embeddings", "/classify"),
                    help="the pooling route to post to (/classify needs a classification checkpoint)")
    args = ap.parse_args(argv)
    import httpx

    proc, url = (None, args.url) if args.url else _start_server(args)
    rows = []
    try:
        model = args.model or httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(_level(url, model, 1, 1, 2, 8, args.route))  # warm-up
        for c in (int(x) for x in args.concurrency.split(",")):
            cpu0 = _cpu_seconds(proc.pid) if proc is not None else None
            row = asyncio.run(_level(url, model, c, args.requests or 4 * c, args.batch, args.words, args.route))
            if cpu0 is not None:
                row["cpu_us_per_input"] = 1e6 * (_cpu_seconds(proc.pid) - cpu0) / row["inputs"]
            rows.append(row)
    finally:
        _stop_server(proc)
    print(f"model {model}  route {args.route}  batch {args.batch}  words/input {args.words}")
    head = ("clients", "latency p50 ms", "latency p99 ms", "inputs/s", "prompt tok/s", "front-end CPU us/input")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['concurrency']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['inputs_s']:.0f} | "
              f"{r['tokens_s']:.0f} | {_cpu_cell(r.get('cpu_us_per_input'))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
