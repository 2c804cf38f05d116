"""The `ember` console script: `serve`, `convert-llama2c`, `quantize-nvfp4`."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from .config import ServeConfig, parse_fraction, parse_memory


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI and Anthropic HTTP APIs",
                       description="Serve MODEL_DIR (a Hugging Face checkpoint directory); without it, the built-in "
                                   "demo model (built once into ~/.cache/ember/demo, or $EMBER_CACHE_DIR/demo).")
    p.add_argument("model_dir", nargs="?", type=Path, default=None, metavar="MODEL_DIR")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer or x-api-key)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the dir name)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output) in tokens")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split every layer across N processes (N GPUs on CUDA)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-blocks", type=int, default=None, help="KV-cache size in blocks")
    kv.add_argument("--kv-cache-memory", type=parse_memory, default=None, help="KV-cache size in bytes (e.g. 2G)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    p.add_argument("--gpu-memory-utilization", type=parse_fraction, default=0.9, metavar="FRACTION",
                   help="share of GPU memory for weights, activations and the KV cache (sizes the cache on CUDA)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="decode without CUDA graphs (on CUDA they are captured for decode batches by default)")
    p.add_argument("--reasoning-parser", default=None, help="parser profile for reasoning, or 'none'")
    p.add_argument("--tool-parser", default=None, help="parser profile for tool calls, or 'none'")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (or its text)")
    p.add_argument("--max-waiting", type=int, default=1024, help="answer 503 while this many requests wait")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def serve_config(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        model_dir=args.model_dir, host=args.host, port=args.port, api_key=args.api_key,
        served_model_name=args.served_model_name, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        kv_cache_blocks=args.kv_cache_blocks, kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=not args.no_prefix_caching, reasoning_parser=args.reasoning_parser,
        tool_parser=args.tool_parser, chat_template=args.chat_template, max_waiting=args.max_waiting,
        log_level=args.log_level, tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)


def _check_parsers(config: ServeConfig) -> None:
    from ember.parsers.profiles import PROFILE_NAMES

    for flag, value in (("--reasoning-parser", config.reasoning_parser), ("--tool-parser", config.tool_parser)):
        if value is not None and value != "none" and value not in PROFILE_NAMES:
            raise SystemExit(f"ember serve: {flag} {value!r} is unknown; known: none, {', '.join(PROFILE_NAMES)}")


def serve(config: ServeConfig) -> int:
    import uvicorn

    from .app import create_app, load_runtime

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_parsers(config)
    if config.model_dir is not None and not config.model_dir.is_dir():
        raise SystemExit(f"ember serve: {config.model_dir} is not a directory")
    runtime = load_runtime(config)
    app = create_app(runtime, config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ember", description="Ember: an OpenAI- and Anthropic-compatible server")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    sub.add_parser("convert-llama2c", help="convert a llama2.c checkpoint to a Hugging Face directory",
                   add_help=False)
    sub.add_parser("quantize-nvfp4", help="write an NVFP4 (ModelOpt format) copy of a checkpoint", add_help=False)
    if argv and argv[0] == "convert-llama2c":
        from ember.engine import convert_llama2c

        return int(convert_llama2c.main(argv[1:]) or 0)
    if argv and argv[0] == "quantize-nvfp4":
        from ember.engine import quantize

        return int(quantize.main(argv[1:]) or 0)
    args = parser.parse_args(argv)
    return serve(serve_config(args))


if __name__ == "__main__":
    sys.exit(main())
