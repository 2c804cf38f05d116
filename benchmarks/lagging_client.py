"""What a client that stops reading costs the server's event loop: `OutputStream.put` coalescing N single-token
outputs (with and without logprobs) while nobody reads, per token, by quarter of the run (linear coalescing keeps each
quarter flat as N grows); then the one step of N tokens the client gets when it reads again, through the chat and
completion encoders (linear: the time per event stays flat). Prints two tables.

    python benchmarks/lagging_client.py [--sizes 2000 8000 32000]
"""
from __future__ import annotations

import argparse
import asyncio
import time

from ember.engine.client import OutputStream
from ember.engine.params import RequestOutput, TokenLogprob
from ember.parsers.events import ContentDelta
from ember.server.choice import ChoiceStep, TokenInfo
from ember.server.openai_encoder import ChatChoiceEncoder, ChunkMeta, CompletionChoiceEncoder


def put_quarters_us(n: int, logprobs: bool) -> list[float]:
    """us per `put` in each quarter of ``n`` puts into a stream nobody reads."""
    outs = [RequestOutput("r", [i], logprobs=[TokenLogprob(i, -1.0, [(i, -1.0)])] if logprobs else None)
            for i in range(n)]

    async def run() -> list[float]:
        stream = OutputStream(asyncio.get_running_loop())
        quarters = []
        for q in range(4):
            part = outs[q * n // 4:(q + 1) * n // 4]
            t = time.perf_counter()
            for out in part:
                stream.put(out)
            quarters.append((time.perf_counter() - t) / len(part) * 1e6)
        merged = await stream.get()
        assert len(merged.new_token_ids) == n
        return quarters

    return asyncio.run(run())


def coalesced_step_us(n: int) -> tuple[float, float]:
    """us per event to encode one step of ``n`` single-word content events: (chat SSE, completion chunks)."""
    step = ChoiceStep(0, [TokenInfo(5, channel="content") for _ in range(n)], [ContentDelta("word ") for _ in range(n)])
    meta = ChunkMeta(id="x", created=1, model="m")
    out = []
    for encode in (ChatChoiceEncoder(meta, 0, lambda t: b"word ").step_sse,
                   CompletionChoiceEncoder(meta, 0, lambda t: b"word ").step):
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            encode(step)
            best = min(best, time.perf_counter() - t)
        out.append(best / n * 1e6)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000, 8000, 32000])
    args = ap.parse_args()
    print("| N | logprobs | us per put, quarters 1 / 2 / 3 / 4 |")
    print("| ---: | --- | --- |")
    for n in args.sizes:
        for lp in (False, True):
            q = put_quarters_us(n, lp)
            print(f"| {n} | {'yes' if lp else 'no'} | {' / '.join(f'{x:.2f}' for x in q)} |")
    print()
    print("| N events in one step | chat step_sse, us per event | completion step, us per event |")
    print("| ---: | ---: | ---: |")
    for n in args.sizes:
        chat, completion = coalesced_step_us(n)
        print(f"| {n} | {chat:.3f} | {completion:.3f} |")


if __name__ == "__main__":
    main()
