"""The `ember` console script: `serve`, `convert-llama2c`, `quantize-nvfp4`."""
from __future__ import annotations

import argparse
import atexit
import os
import sys
import typing
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

from ember.engine.args import SettingValueError, add_flags, checked_by, from_namespace

from .config import ServeConfig, parse_api_key
from .vllm_argv import add_negations, config_argv, config_file, flag_names, fold_dotted, with_config_dotted


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the flag and what is wrong), exit code 2."""

    source = ""  # where the arguments being parsed come from, when not the command line

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{self.source} (see {self.prog} --help)\n")


def _serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`ember serve`'s flags, generated from `ServeConfig`'s fields (its own and the inherited `EngineArgs`)."""
    p = sub.add_parser("serve", help="serve a model over the OpenAI and Anthropic HTTP APIs",
                       description="Serve MODEL: a Hugging Face model id (ORG/NAME[@REVISION], downloaded into the "
                                   "Hugging Face cache) or a checkpoint directory; without it, the built-in demo "
                                   "model (built once into ~/.cache/ember/demo, or $EMBER_CACHE_DIR/demo).")
    add_flags(p, ServeConfig)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)  # the older spelling of --no-enable-prefix-caching
    p.add_argument("--config", metavar="YAML", help="a YAML file mapping flag names to values, as vLLM's "
                   "(true: the switch is given; a list: the flag's values); flags on the command line win")
    _vllm_spellings(p)
    add_negations(p)
    return p


def _vllm_spellings(p: argparse.ArgumentParser) -> None:
    """vLLM's spellings of a `vllm serve` command line, so one carries over (docs/deployment.md lists them):
    ``--model`` and ``--tool-call-parser`` set MODEL and ``--tool-parser``; ``--enable-auto-tool-choice`` and
    ``--trust-remote-code`` are accepted and change nothing (Ember parses tool calls whenever the model family has a
    syntax, and runs no code from a checkpoint: an architecture it does not implement is refused by name), as are
    the flags of ``_NO_EFFECT_SWITCHES`` / ``_NO_EFFECT_VALUES`` (each says why) and ``_SERVED_CHOICES`` with a value
    Ember serves; ``--disable-frontend-multiprocessing`` is ``--in-process``; so are
    ``--runner generate|pooling``, ``--convert embed`` and ``--task generate|embed`` (one server generates and
    embeds). ``--convert classify`` and ``--task classify|score`` ask for a classifier, which Ember serves from a
    ``...ForSequenceClassification`` checkpoint (checked once it is loaded); a reward head is refused by name."""
    from .config import parse_model_arg, parse_profile_name

    p.add_argument("--model", dest="model_flag", type=checked_by(parse_model_arg), help=argparse.SUPPRESS)
    p.add_argument("--tool-call-parser", dest="tool_parser", type=parse_profile_name, help=argparse.SUPPRESS)
    for flag in ("--enable-auto-tool-choice", "--trust-remote-code", *_NO_EFFECT_SWITCHES):
        for spelling in (flag, *_SHORT_SPELLINGS.get(flag, ())):
            p.add_argument(spelling, dest=flag[2:].replace("-", "_"), action="store_true", help=argparse.SUPPRESS)
    for flag, kind in _NO_EFFECT_VALUES.items():
        p.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    for flag, served in _SERVED_CHOICES.items():
        for spelling in (flag, *_SHORT_SPELLINGS.get(flag, ())):
            p.add_argument(spelling, dest=flag[2:].replace("-", "_"), type=_one_of(served),
                           help=argparse.SUPPRESS)
    p.add_argument("--disable-frontend-multiprocessing", dest="in_process", action="store_true",
                   help=argparse.SUPPRESS)  # vLLM's spelling of --in-process
    for flag, served in (("--runner", ("auto", "generate", "pooling")),
                         ("--convert", ("auto", "none", "embed", "classify")),
                         ("--task", ("auto", "generate", "embed", "embedding", "classify", "score"))):
        p.add_argument(flag, dest=flag[2:] + "_flag", type=_served_kind(served), help=argparse.SUPPRESS)


_SHORT_SPELLINGS = {  # vLLM's short spellings of the flags below (-tp and -q are `EngineArgs` aliases)
    "--pipeline-parallel-size": ("-pp",),
    "--data-parallel-size": ("-dp",),
    "--enable-expert-parallel": ("-ep",),
}


_NO_EFFECT_SWITCHES = (
    "--disable-log-requests",  # requests are logged only with --enable-log-requests
    "--disable-log-stats",  # nor periodic engine stats (GET /metrics serves them)
    "--disable-custom-all-reduce",  # tensor parallelism reduces with NCCL's all-reduce only
    "--enable-prompt-tokens-details",  # usage always carries prompt_tokens_details.cached_tokens
    "--enable-expert-parallel",  # MoE experts are split across the tensor-parallel ranks; the outputs are the same
)
_NO_EFFECT_VALUES = {
    "--swap-space": float,  # a preempted sequence is recomputed, never swapped to CPU memory
    "--max-seq-len-to-capture": int,  # decode graphs are captured per batch size and serve any context
    "--max-cpu-loras": int,  # every LoRA adapter stays on the device
    "--limit-mm-per-prompt": str,  # text only: a request with images is refused, whatever the limit
    "--compilation-config": str,  # nothing is torch.compile'd; decode CUDA graphs are captured unless --enforce-eager
    "-O": str,  # vLLM's compilation level (-O3): as --compilation-config
    "--max-parallel-loading-workers": int,  # the safetensors files are read one after another
    "--long-prefill-token-threshold": int,  # a long prefill is chunked to the step's token budget
    "--max-num-partial-prefills": int,  # at most one prefill is partial in a step
    "--guided-decoding-backend": str,  # structured output always runs on llguidance
}
_SERVED_CHOICES = {  # vLLM flags whose other values Ember does not serve
    "--pipeline-parallel-size": ("1",),
    "--data-parallel-size": ("1",),
    "--cpu-offload-gb": ("0",),
    "--load-format": ("auto", "safetensors"),
    "--tokenizer-mode": ("auto", "hf"),
    "--distributed-executor-backend": ("mp", "uni"),
}


def _one_of(served: tuple[str, ...]):
    def parse(text: str) -> str:
        if text not in served:
            raise SettingValueError(f"{text}: Ember serves only {' or '.join(served)}")
        return text
    return parse


def _served_kind(served: tuple[str, ...]):
    """The parse function of a vLLM runner/task flag: what Ember serves passes; a head it has not is refused."""
    def parse(text: str) -> str:
        if text not in served:
            raise SettingValueError(f"{text}: Ember serves {', '.join(served)} (generation, embeddings and "
                                    f"classifiers)")
        return text
    return parse


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The `ServeConfig` of parsed `ember serve` arguments; SettingValueError (``argument --x: ...``) for a MODEL
    that is neither a directory nor a Hugging Face id, and for flags that contradict each other."""
    config = from_namespace(ServeConfig, args)
    if not config.api_key and os.environ.get("VLLM_API_KEY"):  # vLLM's: the flag wins over the environment
        try:
            config.api_key = (parse_api_key(os.environ["VLLM_API_KEY"]),)
        except SettingValueError as e:
            raise SettingValueError(f"VLLM_API_KEY: {e}") from None
    if isinstance(config.served_model_name, list):  # --served-model-name NAME [NAME ...]
        config.served_model_name, *aliases = config.served_model_name
        config.served_model_aliases = tuple(dict.fromkeys(a for a in aliases if a != config.served_model_name))
    flag = getattr(args, "model_flag", None)  # vLLM's --model MODEL, as given
    if flag is not None:
        if config.model_dir is not None and config.model_dir != Path(flag):
            raise SettingValueError(f"argument --model: MODEL given twice ({config.model_dir} and --model {flag})")
        config.model_dir = Path(flag)
    given = args.model_dir if isinstance(args.model_dir, str) else flag
    if config.served_model_name is None and given is not None:
        config.served_model_aliases = _model_alias(given)
    for name in ("convert", "task"):
        value = getattr(args, f"{name}_flag", None)
        if value in ("classify", "score"):
            config.classifier_flag = f"--{name} {value}"
    _check_lora_names(config)
    _check_cors(config)
    return config


def _check_cors(config: ServeConfig) -> None:
    """SettingValueError naming a CORS flag given without --allowed-origins: Ember's CORS is off without it (vLLM's
    default allows every origin), so the flag would change nothing."""
    if config.allowed_origins:
        return
    for flag, value in (("--allow-credentials", config.allow_credentials),
                        ("--allowed-methods", config.allowed_methods), ("--allowed-headers", config.allowed_headers)):
        if value:
            raise SettingValueError(f"argument {flag}: CORS is off without --allowed-origins (vLLM's default, every "
                                    f"origin, is --allowed-origins '*')")


def _model_alias(given: str) -> tuple[str, ...]:
    """MODEL as given (vLLM's default served name, ``/models/qwen3`` for ``vllm serve /models/qwen3``) as a name
    of the served model besides Ember's own (`served_name`: the directory's name), where the two differ."""
    from .model_source import served_name

    return (given,) if given != served_name(given, Path(given).expanduser()) else ()


def _check_lora_names(config: ServeConfig) -> None:
    """SettingValueError naming --lora-modules when an adapter would take a name of the served model (its
    --served-model-name names, else the names it is served under by default), as the runtime load route refuses."""
    from ember.engine.args import parse_lora_module

    from .model_source import served_name

    if config.served_model_name:
        served = config.served_model_name
    elif config.model_dir is not None:
        served = served_name(config.model_dir, config.model_dir)
    else:
        served = "demo"  # the built-in demo model's directory
    names = (served, *config.served_model_aliases)
    for module in config.lora_modules:
        name = parse_lora_module(module)[0]
        if name in names:
            raise SettingValueError(f"argument --lora-modules: {name!r} is a name of the served model; give the "
                                    f"adapter another name")


def serve(config: ServeConfig) -> int:
    """Bind the port, load the model, serve until stopped (start-up failures: one line, exit code)."""
    from .startup import serve as run

    return run(config)


def version() -> str:
    try:
        return metadata.version("ember")
    except metadata.PackageNotFoundError:
        return "unknown"


def _refuse_unknown(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    if extras:
        flags = [x.partition("=")[0] for x in extras if x.startswith("-") and x != "-"]
        parser.error(f"unknown flag{'s' * (len(flags) > 1)} {', '.join(flags)}" if flags else
                     f"unrecognized arguments: {' '.join(extras)}")


def _applyconfig_file(path: str, argv: list[str], parser: argparse.ArgumentParser) -> tuple[Any, dict[str, Any]]:
    """Parse the flags of ``--config`` ``path`` (``argv``, `config_argv`) and make their values ``parser``'s
    defaults, so that the command line wins. Returns the model it names (its ``model`` key), which serves only where
    the command line names none, and the defaults it replaced (by dest)."""
    try:
        parser.source = f" (in --config {path})"
        values, extras = parser.parse_known_args(fold_dotted(flag_names(argv, parser), parser))
        _refuse_unknown(parser, extras)
    finally:
        parser.source = ""
    model = vars(values).pop("model_flag", None)
    changed = {k: v for k, v in vars(values).items() if v != parser.get_default(k)}
    replaced = {k: parser.get_default(k) for k in changed}
    parser.set_defaults(**changed)
    return model, replaced


def _command_line_wins_in_groups(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str],
                                 from_config: dict[str, Any]) -> None:
    """A flag given on the command line displaces the ``--config`` value of a flag it excludes (``--kv-cache-memory``
    over the file's ``kv-cache-blocks``), as the command line wins over the file for the flag itself."""
    given = {a.dest for a in parser._actions for s in a.option_strings
             if any(x == s or x.startswith(s + "=") for x in argv)}
    for group in parser._mutually_exclusive_groups:
        members = {a.dest for a in group._group_actions}
        if members & given:
            for dest in (members - given) & from_config.keys():
                setattr(args, dest, from_config[dest])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(prog="ember", description="Ember: an OpenAI- and Anthropic-compatible server")
    parser.add_argument("--version", action="version", version=f"ember {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = _serve_parser(sub)
    sub.add_parser("convert-llama2c", help="convert a llama2.c checkpoint to a Hugging Face directory",
                   add_help=False)
    sub.add_parser("quantize-nvfp4", help="write an NVFP4 (ModelOpt format) copy of a checkpoint", add_help=False)
    if argv and argv[0] == "convert-llama2c":
        from ember.engine import convert_llama2c

        return int(convert_llama2c.main(argv[1:]) or 0)
    if argv and argv[0] == "quantize-nvfp4":
        from ember.engine import quantize

        return int(quantize.main(argv[1:]) or 0)
    config_model, from_config = None, {}
    if argv and argv[0] == "serve":
        path, rest = config_file(argv[1:], serve_parser)
        cli = flag_names(rest, serve_parser)
        if path is not None:
            from_file = config_argv(path, serve_parser)
            cli = with_config_dotted(cli, flag_names(from_file, serve_parser))
        argv = ["serve", *fold_dotted(cli, serve_parser)]
        if path is not None:
            config_model, from_config = _applyconfig_file(path, from_file, serve_parser)
    args, extras = parser.parse_known_args(argv)
    _refuse_unknown(serve_parser, extras)
    _command_line_wins_in_groups(args, serve_parser, argv[1:], from_config)
    if config_model is not None and args.model_dir is None and args.model_flag is None:
        args.model_flag = config_model
    try:
        config = serve_config(args)
    except SettingValueError as e:
        serve_parser.error(str(e))
    return serve(config)


def run() -> None:
    """The `ember` command: `main`, then the exit handlers (logging's flush, multiprocessing's joins) and an exit that
    skips the interpreter's teardown of the modules, seconds of garbage collection over torch's and transformers'
    objects after the server has already stopped, which `docker stop`'s grace would otherwise pay for."""
    try:
        code: Any = main()
    except SystemExit as e:  # argparse's errors, --help, --version
        code = e.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    run()
