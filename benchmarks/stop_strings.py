"""Stop-string matching cost: `StopMatcher.feed` per token-sized piece of text, for a few stop lists (up to 20k stop
strings that start with common letters), and the cost of building a matcher for one very long stop string. Prints
a table.

    python benchmarks/stop_strings.py [--tokens 20000] [--repeat 3]
"""
from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from ember.parsers.stop import StopMatcher

WORDS = "the quick brown fox jumps over a lazy dog and then END? no <ans wer stuff\n".split(" ")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
CASES = {"one: \\n\\n": ["\n\n"], "three: END! </answer> Observation:": ["END!", "</answer>", "Observation:"],
         "one of 64 characters": ["x" * 64],
         "20000 starting with letters": [LETTERS[i % 26] + "QQ" + str(i) for i in range(20_000)]}


def per_feed_us(stops: list[str], pieces: list[str], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        m = StopMatcher(stops)
        t = time.perf_counter()
        for p in pieces:
            m.feed(p)
        best = min(best, time.perf_counter() - t)
    return best / len(pieces) * 1e6


def long_stop(length: int) -> tuple[float, float]:
    """(ms to build a matcher for one stop of ``length`` characters, MB its construction allocated at peak)."""
    tracemalloc.start()
    t = time.perf_counter()
    StopMatcher(["x" * length + "y"])
    ms = (time.perf_counter() - t) * 1e3
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return ms, peak / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    pieces = [rng.choice(WORDS) + " " for _ in range(args.tokens)]
    print(f"| stop strings | us per feed ({args.tokens} word pieces, best of {args.repeat}) |")
    print("| --- | --- |")
    for name, stops in CASES.items():
        print(f"| {name} | {per_feed_us(stops, pieces, args.repeat):.2f} |")
    print()
    print("| one stop string of | build ms | peak MB |")
    print("| --- | --- | --- |")
    for length in (1_000, 60_000):
        ms, mb = long_stop(length)
        print(f"| {length} characters | {ms:.1f} | {mb:.2f} |")


if __name__ == "__main__":
    main()
