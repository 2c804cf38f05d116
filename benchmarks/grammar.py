#!/usr/bin/env python
"""Grammar mask cost per request-step: llguidance masks for a whole batch, filled by Ember's `bitmask_filler`.

    python benchmarks/grammar.py [--tokenizer DIR] [--steps 60] [--batches 1,32,128] [--threads N]

``DIR`` holds ``tokenizer.json`` + ``tokenizer_config.json``; the default is the real Qwen3 tokenizer from
``../shared/data/tokenizers/qwen3`` (151,669 tokens), unpacked into a temporary folder. For each batch size and phase
it builds one request constraint per row (Qwen3 profile, JSON-schema answer, the same grammar source, so one compiled
grammar shared through the cache), advances each row to a different point of a real token trace, then times
``filler(constraints, bitmask)`` per step while every row consumes its next trace token. Phases:

* ``reasoning``: inside the thought (initial state REASONING), the trace is a recorded Qwen3 reasoning text;
* ``json``: inside the JSON answer after ``</think>``, the trace is a JSON document valid for the schema.

Prints a table: wall time of the batch fill (median, p99) and the per-request-step share (wall / batch), plus the
first mask right after the close delimiter and the one-off grammar compile time.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string", "enum": ["France", "Japan", "United States", "Brazil"]},
        "population": {"type": "integer", "minimum": 0},
        "coordinates": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"], "additionalProperties": False},
        "landmarks": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "year": {"type": "integer"}}, "required": ["name"],
            "additionalProperties": False}},
        "summary": {"type": "string"},
    },
    "required": ["city", "country", "population", "coordinates", "landmarks", "summary"],
    "additionalProperties": False,
}
DOC = {
    "city": "Paris", "country": "France", "population": 2102650,
    "coordinates": {"lat": 48.8566, "lon": 2.3522},
    "landmarks": [{"name": "Eiffel Tower", "year": 1889}, {"name": "Louvre Museum", "year": 1793},
                  {"name": "Notre-Dame de Paris", "year": 1345}, {"name": "Arc de Triomphe", "year": 1836}],
    "summary": "Paris is the capital and most populous city of France, on the Seine, known for its art, fashion, "
               "gastronomy and culture; its metropolitan area is one of the largest in Europe.",
}
REASONING = ("Okay, the user is asking for the current time in New York. Let me check the tools available. There's a "
             "function called get_current_time_nyc, and it doesn't require any parameters. So I just need to call "
             "that function. The location is New York, and since there's no unit specified, I can leave that out. "
             "So the tool call should be straightforward. I'll make sure to format it correctly in JSON inside the "
             "tool_call tags. Wait, maybe the user also wants the weather; I should not guess. ") * 3


def qwen3_dir() -> Path:
    src = REPO.parent / "shared" / "data" / "tokenizers" / "qwen3"
    if not (src / "tokenizer.json.gz").exists():
        sys.exit(f"{src} is absent: pass --tokenizer DIR")
    out = Path(tempfile.mkdtemp(prefix="ember-qwen3-tok-"))  # removed by main()
    (out / "tokenizer_config.json").write_bytes((src / "tokenizer_config.json").read_bytes())
    (out / "tokenizer.json").write_bytes(gzip.decompress((src / "tokenizer.json.gz").read_bytes()))
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--threads", type=int, default=None, help="LLExecutor threads (default: llguidance's)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from ember.grammar import GrammarBackend, compile_request
    from ember.parsers.initial import InitialState
    from ember.parsers.pipeline import ParserSetup

    tok_dir = args.tokenizer or qwen3_dir()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    if args.tokenizer is None:
        shutil.rmtree(tok_dir, ignore_errors=True)
    t0 = time.perf_counter()
    eos = [i for i in (tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"))
           if isinstance(i, int)]
    backend = GrammarBackend.from_tokenizer(tok, eos_ids=eos, threads=args.threads)
    t_tok = time.perf_counter() - t0
    setup = ParserSetup.from_tokenizer(tok, "qwen3")
    close = setup.delimiter_ids["</think>"]
    plan = compile_request(setup.profile, InitialState.REASONING, setup.delimiter_ids, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    t0 = time.perf_counter()
    backend.validate(plan.grammar)
    t_compile = time.perf_counter() - t0

    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    reasoning_ids = enc(REASONING)
    json_ids = enc(json.dumps(DOC, ensure_ascii=False))
    words = (backend.vocab_size + 31) // 32
    filler = backend.bitmask_filler()

    def own_plan(r: int):
        """A grammar of its own for row ``r`` (one more enum value), so no row reuses another's mask cache."""
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"]["country"]["enum"].append(f"Country {r}")
        return compile_request(setup.profile, InitialState.REASONING, setup.delimiter_ids, response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})

    # The first mask after the close delimiter (lexer states for the JSON built lazily).
    first = []
    for r in range(5):
        c = backend.constraint(own_plan(1000 + r))
        for t in reasoning_ids[:20] + [close]:
            c.accept_token(t)
        bm = torch.zeros(1, words, dtype=torch.int32)
        t0 = time.perf_counter()
        filler([c], bm)
        first.append(time.perf_counter() - t0)

    rows = []
    for phase in ("reasoning", "json"):
        for grammars, b in [(g, int(x)) for g in ("shared", "own") for x in args.batches.split(",")]:
            cs, traces = [], []
            for r in range(b):
                c = backend.constraint(plan if grammars == "shared" else own_plan(r))
                if phase == "reasoning":
                    off = (r * 7) % (len(reasoning_ids) - args.steps - 1)
                    prefix, trace = reasoning_ids[:off], reasoning_ids[off:off + args.steps]
                else:
                    off = (r * 3) % max(1, len(json_ids) - args.steps - 1)
                    prefix = reasoning_ids[:10] + [close] + json_ids[:off]
                    trace = json_ids[off:off + args.steps]
                for t in prefix:
                    assert c.accept_token(t), c.error_message()
                cs.append(c)
                traces.append(trace)
            bm = torch.zeros(b, words, dtype=torch.int32)
            steps = min(len(t) for t in traces)
            times = []
            for s in range(steps):
                t0 = time.perf_counter()
                filler(cs, bm)
                times.append(time.perf_counter() - t0)
                for c, trace in zip(cs, traces):
                    assert c.accept_token(trace[s]), c.error_message()
            med, p99 = statistics.median(times), pct(times, 0.99)
            rows.append((f"{phase}/{grammars}", b, steps, med * 1e3, p99 * 1e3, med / b * 1e6, p99 / b * 1e6))

    print(f"tokenizer {tok_dir} ({backend.vocab_size} tokens), {os.cpu_count()} CPUs, "
          f"llguidance tokenizer built in {t_tok:.2f} s, grammar compiled in {t_compile * 1e3:.1f} ms, "
          f"first mask after </think> (fresh grammar) median {statistics.median(first) * 1e3:.2f} ms")
    print(f"{'phase/grammar':<16} {'batch':>5} {'steps':>5} {'batch ms med':>12} {'batch ms p99':>12} "
          f"{'us/req med':>10} {'us/req p99':>10}")
    for phase, b, steps, med, p99, rmed, rp99 in rows:
        print(f"{phase:<16} {b:>5} {steps:>5} {med:>12.3f} {p99:>12.3f} {rmed:>10.1f} {rp99:>10.1f}")


if __name__ == "__main__":
    main()
