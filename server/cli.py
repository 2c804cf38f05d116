"""The `ember` console script: `serve`, `convert-llama2c`, `quantize-nvfp4`."""
from __future__ import annotations

import argparse
import sys
import typing
from importlib import metadata
from typing import Sequence

from ember.engine.args import add_flags, from_namespace

from .config import ServeConfig


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the flag and what is wrong), exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    """`ember serve`'s flags, generated from `ServeConfig`'s fields (its own and the inherited `EngineArgs`)."""
    p = sub.add_parser("serve", help="serve a model over the OpenAI and Anthropic HTTP APIs",
                       description="Serve MODEL: a Hugging Face model id (ORG/NAME[@REVISION], downloaded into the "
                                   "Hugging Face cache) or a checkpoint directory; without it, the built-in demo "
                                   "model (built once into ~/.cache/ember/demo, or $EMBER_CACHE_DIR/demo).")
    add_flags(p, ServeConfig)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)  # the older spelling of --no-enable-prefix-caching


def serve_config(args: argparse.Namespace) -> ServeConfig:
    return from_namespace(ServeConfig, args)


def serve(config: ServeConfig) -> int:
    """Bind the port, load the model, serve until stopped (start-up failures: one line, exit code)."""
    from .startup import serve as run

    return run(config)


def version() -> str:
    try:
        return metadata.version("ember")
    except metadata.PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(prog="ember", description="Ember: an OpenAI- and Anthropic-compatible server")
    parser.add_argument("--version", action="version", version=f"ember {version()}")
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
