#!/usr/bin/env python
"""Output-pipeline cost per token: replies of 1k, 10k and 100k tokens fed one token at a time.

    python benchmarks/parsers.py [--sizes 1000,10000,100000] [--repeat 3] [--scenarios "glm45 args,kimi_k2 args"]

Scenarios (Qwen3 tokenizer from ../shared/data where present, else the demo model's): a thought (`reasoning`), an
answer (`content`), one Hermes tool call whose JSON arguments hold a long string (`hermes args`), and one Qwen3-Coder
call whose string parameter is that long (`qwen3_coder args`, converted to JSON as it streams). Each row prints the
CPU time (thread time, so other load on the machine does not count) per token in microseconds at each size, best of
``--repeat`` runs of the whole `OutputPipeline` (bytes, UTF-8, machine, events), and the ratio of the largest size to
the smallest: about 1.0 means linear time (design I5). `deepseek_v3 args`, `glm45 args` and `kimi_k2 args` are one
call of each family whose string argument is that long (DeepSeek V3.1's bare JSON, GLM's `<arg_value>` converted to a
JSON string as it streams, Kimi's JSON); their markers are added to the tokenizer as single special tokens.
`llama3_json args` (a bare `{"name": .., "parameters": {..}}` at the reply's start), `mistral args` (`[TOOL_CALLS]NAME
[ARGS]{..}`) and `pythonic args` (`[write_file(content="...")]`, Python literals converted to JSON as they stream) are
the same for those syntaxes, and `minimax_m2 args` a MiniMax-M2 `<parameter name="content">` value (as Qwen3-Coder's).
Four shapes held whole until they end: `whitespace after thought` (newlines after `</think>`, held in case a call
follows), `qwen3_coder object` and `glm45 object` (an object parameter value, converted at its end) and `hermes long
name` (a tool name that never ends, bounded at 512 characters then Malformed); `hermes name last` writes the
arguments first and the name at the end, so every token waits for it.
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
OBJECT_TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"meta": {"type": "object"}}}}}]


SECTION_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                   "<｜tool▁calls▁end｜>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                   "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                   "<|tool_call_end|>", "<|tool_calls_section_end|>")
"""DeepSeek's, GLM's and Kimi K2's tool-call markers: single tokens in their own vocabularies, added here."""
FLAT_MARKERS = ("<|python_tag|>", "<|eot_id|>", "[TOOL_CALLS]", "[ARGS]", "</s>", "<|python_start|>", "<|python_end|>",
                "<minimax:tool_call>", "</minimax:tool_call>", "[e~[")
"""Llama 3's, Mistral's, Llama 4's and MiniMax-M2's markers (single tokens in their vocabularies), added here."""


def load_tokenizer():
    from tokenizers import Tokenizer

    p = REPO.parent / "shared" / "data" / "tokenizers" / "qwen3" / "tokenizer.json.gz"
    if p.exists():
        return Tokenizer.from_str(gzip.decompress(p.read_bytes()).decode()), "qwen3"
    from ember.engine.demo import build_tokenizer

    return build_tokenizer(), "demo"


def scenarios(tok, setup: ParserSetup, n: int) -> dict[str, tuple[InitialState, list[int], dict]]:
    """Token sequences of exactly ``n`` tokens (a repeated, really tokenized paragraph)."""
    opener = tok.encode("<tool_call>", add_special_tokens=False).ids     # one token (an added token)

    def body(prefix: str, text: str, lead: list[int], suffix: str = "") -> list[int]:
        head = lead + tok.encode(prefix, add_special_tokens=False).ids
        unit = tok.encode(text, add_special_tokens=False).ids
        tail = tok.encode(suffix, add_special_tokens=False).ids
        ids = head + unit * (n // len(unit) + 1)
        return ids[:n - len(tail)] + tail

    escaped = json.dumps(PARAGRAPH, ensure_ascii=False)[1:-1]
    return {
        "reasoning": (InitialState.REASONING, body("", PARAGRAPH, []), {}),
        "content": (InitialState.CONTENT, body("", PARAGRAPH, []), {}),
        "hermes args": (InitialState.CONTENT, body('\n{"name": "write_file", "arguments": {"content": "', escaped,
                                                  opener), {"tools": TOOLS}),
        "qwen3_coder args": (InitialState.CONTENT, body("\n<function=write_file>\n<parameter=content>\n", PARAGRAPH,
                                                       opener), {"tools": TOOLS}),
        "deepseek_v3 args": (InitialState.CONTENT, body("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>write_file<｜tool▁sep｜>"
                                                       '{"content": "', escaped, []), {"tools": TOOLS}),
        "glm45 args": (InitialState.CONTENT, body("<tool_call>write_file\n<arg_key>content</arg_key>\n<arg_value>",
                                                 PARAGRAPH, []), {"tools": TOOLS}),
        "kimi_k2 args": (InitialState.CONTENT, body("<|tool_calls_section_begin|><|tool_call_begin|>"
                                                   "functions.write_file:0<|tool_call_argument_begin|>"
                                                   '{"content": "', escaped, []),
                         {"tools": TOOLS}),
        "llama3_json args": (InitialState.CONTENT, body('{"name": "write_file", "parameters": {"content": "', escaped,
                                                       []), {"tools": TOOLS}),
        "mistral args": (InitialState.CONTENT, body('[TOOL_CALLS]write_file[ARGS]{"content": "', escaped, []),
                         {"tools": TOOLS}),
        "pythonic args": (InitialState.CONTENT, body('[write_file(content="', escaped, []), {"tools": TOOLS}),
        "minimax_m2 args": (InitialState.CONTENT, body('<minimax:tool_call>\n<invoke name="write_file">\n'
                                                      '<parameter name="content">', PARAGRAPH, []), {"tools": TOOLS}),
        "whitespace after thought": (InitialState.REASONING, body("x</think>", "\n", []), {}),
        "qwen3_coder object": (InitialState.CONTENT, body('\n<function=write_file>\n<parameter=meta>\n{"k": [',
                                                         " 12345,", opener), {"tools": OBJECT_TOOLS}),
        "glm45 object": (InitialState.CONTENT, body('<tool_call>write_file\n<arg_key>meta</arg_key>\n'
                                                   '<arg_value>{"k": [', " 12345,", []), {"tools": OBJECT_TOOLS}),
        "hermes long name": (InitialState.CONTENT, body('\n{"name": "', "ab", opener), {"tools": TOOLS}),
        "hermes name last": (InitialState.CONTENT, body('\n{"arguments": {"content": "', " ab", opener,
                                                        '"}, "name": "write_file"}'), {"tools": TOOLS}),
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
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scenarios", default="", help="comma-separated scenario names (default: all)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    tok, name = load_tokenizer()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SECTION_MARKERS + FLAT_MARKERS])
    profiles = {"reasoning": "qwen3", "content": "qwen3", "hermes args": "qwen3", "qwen3_coder args": "qwen3_coder",
                "deepseek_v3 args": "deepseek_v3", "glm45 args": "glm45", "kimi_k2 args": "kimi_k2",
                "llama3_json args": "llama3_json", "mistral args": "mistral", "pythonic args": "pythonic",
                "minimax_m2 args": "minimax_m2", "whitespace after thought": "qwen3",
                "qwen3_coder object": "qwen3_coder", "glm45 object": "glm45", "hermes long name": "qwen3",
                "hermes name last": "qwen3"}
    if args.scenarios:
        wanted = [s.strip() for s in args.scenarios.split(",")]
        unknown = [s for s in wanted if s not in profiles]
        if unknown:
            ap.error(f"unknown scenarios {unknown}; known: {', '.join(profiles)}")
        profiles = {s: profiles[s] for s in wanted}
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
