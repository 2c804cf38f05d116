"""What a client that stops reading costs the server's event loop: `OutputStream.put` coalescing N single-token
outputs (with and without logprobs) while nobody reads, per token, by quarter of the run. Linear coalescing keeps each
quarter's cost flat as N grows. Prints a table.

    python benchmarks/lagging_client.py [--sizes 2000 8000 32000]
"""
from __future__ import annotations

import argparse
import asyncio
import time

from ember.engine.client import OutputStream
from ember.engine.params import RequestOutput, TokenLogprob


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000, 8000, 32000])
    args = ap.parse_args()
    print("| N | logprobs | us per put, quarters 1 / 2 / 3 / 4 |")
    print("| ---: | --- | --- |")
    for n in args.sizes:
        for lp in (False, True):
            q = put_quarters_us(n, lp)
            print(f"| {n} | {'yes' if lp else 'no'} | {' / '.join(f'{x:.2f}' for x in q)} |")


if __name__ == "__main__":
    main()
