#!/usr/bin/env python
"""Output-pipeline cost per token: replies of 1k, 10k and 100k tokens fed one token at a time.

    python benchmarks/parsers.py [--sizes 1000,10000,100000] [--repeat 3]

Scenarios (Qwen3 tokenizer from ../shared/data where present, else the demo model's): a thought (`reasoning`), an
answer (`content`), one Hermes tool call whose JSON arguments hold a long string (`hermes args`), and one Qwen3-Coder
call whose string parameter is that long (`qwen3_coder args`, converted to JSON as it streams). Each row prints the
CPU time (thread time, so other load on the machine does not count) per token in microseconds at each size, best of
``--repeat`` runs of the whole `OutputPipeline` (bytes, UTF-8, machine, events), and the ratio of the largest size to
the smallest: about 1.0 means linear time (design I5).
"""
from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import platform
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ember.parsers.initial import InitialState  # noqa: E402
from ember.parsers.pipeline import ParserSetup  # noqa: E402

PARAGRAPH = ("The user wants a summary of the report. First, the revenue grew by 12% in the third quarter, mostly from "
             "the new subscription tier; costs rose by 4%. Second, churn fell to 2.1% — still above the target of "
             "1.5%. I should mention the risks: supplier delays in 東京 and a currency effect (€/$). Let me check "
             "the numbers again before answering, step by step.\n\n")
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}]


def load_tokenizer():
    from tokenizers import Tokenizer

    p = REPO.parent / "shared" / "data" / "tokenizers" / "qwen3" / "tokenizer.json.gz"
    if p.exists():
        return Tokenizer.from_str(gzip.decompress(p.read_bytes()).decode()), "qwen3"
    from ember.engine.demo import build_tokenizer

    return build_tokenizer(), "demo"


def scenarios(tok, setup: ParserSetup, n: int) -> dict[str, tuple[InitialState, list[int], dict]]:
    """Token sequences of exactly ``n`` tokens (a repeated, really tokenized paragraph)."""
    d = setup.delimiter_ids

    def body(prefix: str, text: str, lead: list[int]) -> list[int]:
        head = lead + tok.encode(prefix, add_special_tokens=False).ids
        unit = tok.encode(text, add_special_tokens=False).ids
        ids = head + unit * (n // len(unit) + 1)
        return ids[:n]

    escaped = json.dumps(PARAGRAPH, ensure_ascii=False)[1:-1]
    return {
        "reasoning": (InitialState.REASONING, body("", PARAGRAPH, []), {}),
        "content": (InitialState.CONTENT, body("", PARAGRAPH, []), {}),
        "hermes args": (InitialState.CONTENT, body('\n{"name": "write_file", "arguments": {"content": "', escaped,
                                                  [d["<tool_call>"]]), {"tools": TOOLS}),
        "qwen3_coder args": (InitialState.CONTENT, body("\n<function=write_file>\n<parameter=content>\n", PARAGRAPH,
                                                       [d["<tool_call>"]]), {"tools": TOOLS}),
    }


def time_feed(setup: ParserSetup, initial: InitialState, ids: list[int], options: dict) -> float:
    """Seconds to feed ``ids`` one token per call (events collected, as a streaming server would)."""
    p = setup.pipeline(initial=initial, call_id=lambda i: f"call_{i}", **options)
    feed = p.feed
    sink = []
    t0 = time.thread_time()
    for tid in ids:
        sink += feed((tid,)).events
    elapsed = time.thread_time() - t0
    p.finish("length")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    tok, name = load_tokenizer()
    profiles = {"reasoning": "qwen3", "content": "qwen3", "hermes args": "qwen3", "qwen3_coder args": "qwen3_coder"}
    setups = {p: ParserSetup.from_tokenizer(tok, p) for p in set(profiles.values())}
    table: dict[str, list[float]] = {}
    for n in sizes:
        for scen, prof in profiles.items():
            initial, ids, options = scenarios(tok, setups[prof], n)[scen]
            best = min(time_feed(setups[prof], initial, ids, options) for _ in range(args.repeat))
            table.setdefault(scen, []).append(best / n * 1e6)
    print(f"# parsers benchmark: tokenizer {name}, python {platform.python_version()}, {platform.machine()}, "
          f"one token per feed, best of {args.repeat}")
    print()
    print("| scenario | " + " | ".join(f"{n:,} tok (us/tok)" for n in sizes) + f" | {sizes[-1]:,}/{sizes[0]:,} |")
    print("| --- | " + " | ".join("---:" for _ in sizes) + " | ---: |")
    for scen, row in table.items():
        print(f"| {scen} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {row[-1] / row[0]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
