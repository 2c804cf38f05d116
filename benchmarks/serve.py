"""Serving benchmark: N concurrent streaming clients against a live server; prints a table.

    python benchmarks/serve.py                                  # starts the demo model in-process
    python benchmarks/serve.py --model-dir DIR --concurrency 1,8,32 --requests 64 --max-tokens 128
    python benchmarks/serve.py --url http://host:8000 --model NAME   # an already running `ember serve`

Per concurrency level: TTFT p50/p99 (request sent -> first generated token's chunk), inter-token latency p50/p99
(gap between consecutive token-carrying chunks of one stream), output tokens/s (all generated tokens / wall time),
requests/s. Tokens are counted from `return_token_ids`, so withheld text still counts. `ignore_eos` fixes lengths.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def _one(client, url: str, model: str, prompt: str, max_tokens: int, seed: int) -> tuple[float, list[float], int]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "seed": seed, "return_token_ids": True}
    t0 = time.perf_counter()
    ttft, last, gaps, ntok = None, None, [], 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
            if not n:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
            ntok += n
    return (ttft if ttft is not None else float("nan")), gaps, ntok


async def _level(url: str, model: str, concurrency: int, requests: int, prompt: str, max_tokens: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        queue = list(range(requests))
        results = []

        async def worker():
            while queue:
                i = queue.pop()
                results.append(await _one(client, url, model, prompt, max_tokens, i))

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server; default: start one in-process")
    ap.add_argument("--model", default=None, help="model name to send (default: what /v1/models lists)")
    ap.add_argument("--model-dir", type=Path, default=None, help="checkpoint to serve in-process (default: demo)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)

    server = runtime = None
    url = args.url
    if url is None:
        from ember.server.app import BackgroundServer, create_app, load_runtime
        from ember.server.config import ServeConfig

        config = ServeConfig(model_dir=args.model_dir, max_num_seqs=args.max_num_seqs)
        runtime = load_runtime(config)
        server = BackgroundServer(create_app(runtime, config)).start()
        url = server.url
    import httpx

    model = args.model or httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    prompt = " ".join(["the weather in paris is mild today and"] * max(1, args.prompt_words // 8))
    asyncio.run(_level(url, model, 1, 2, prompt, 4))  # warm-up
    rows = [asyncio.run(_level(url, model, int(c), args.requests, prompt, args.max_tokens))
            for c in args.concurrency.split(",")]
    if server is not None:
        server.stop()
    print(f"model {model}  max_tokens {args.max_tokens}  requests/level {args.requests}")
    head = ("clients", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "out tok/s", "req/s")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['concurrency']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} | "
              f"{r['itl_p99_ms']:.2f} | {r['output_tok_s']:.0f} | {r['req_s']:.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
