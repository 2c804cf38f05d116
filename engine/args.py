"""Engine settings: `EngineArgs`, the single source of their defaults, and the CLI flags generated from them.

Every setting is one dataclass field whose ``metadata`` says how it appears on the command line: ``help`` (required
for a flag to exist), optionally ``flag`` (a non-default flag name), ``choices``, ``type`` (a parse function),
``min`` / ``max`` (inclusive bounds of a number, which must then also be finite), ``requires`` (the boolean field a
switch needs), ``negatable`` (``--x/--no-x`` for a boolean), ``group`` (flags of one group are mutually exclusive),
``metavar``, ``aliases`` (other option strings, such as vLLM's ``-tp``) and ``positional`` (its ``type`` applied by
`from_namespace`, after parsing, so that an unknown flag before it is reported as unknown rather than taken for it).
`add_flags` turns any such dataclass into argparse arguments with the default shown in the help; `from_namespace`
builds the dataclass back from the parsed arguments.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable, TypeVar


class SettingValueError(argparse.ArgumentTypeError, ValueError):
    """A setting's value is malformed; argparse shows the message as is (not `invalid parse_x value`)."""


def parse_fraction(text: str) -> float:
    """`"0.9"` -> 0.9; SettingValueError outside (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise SettingValueError(f"{text!r} is not a number in (0, 1], e.g. 0.9") from None
    if not 0.0 < value <= 1.0:
        raise SettingValueError(f"{text!r} is not in (0, 1], e.g. 0.9")
    return value


def parse_memory(text: str) -> int:
    """`"512M"`, `"2G"`, `"1.5GiB"` or a plain byte count -> bytes; SettingValueError otherwise. A lone lower-case
    suffix is a power of 1000 (`"8g"`: 8e9 bytes), as vLLM reads ``--kv-cache-memory-bytes``."""
    stripped = text.strip()
    s = stripped.upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if stripped[-1:] in "kmgt" and stripped[-1:]:
        scale = {k: 1000 ** (i + 1) for i, k in enumerate("KMGT")}
    try:
        value = float(s[:-1]) * scale[s[-1]] if s and s[-1] in scale else float(s)
    except ValueError:
        raise SettingValueError(f"{text!r} is not a size in bytes, e.g. 512M, 2G or 1.5GiB") from None
    if not math.isfinite(value):
        raise SettingValueError(f"{text!r} is not a finite size, e.g. 512M, 2G or 1.5GiB")
    if value <= 0:
        raise SettingValueError(f"{text!r} is not a positive size, e.g. 512M, 2G or 1.5GiB")
    return int(value)


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")
_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_human_int(text: str) -> int:
    """vLLM's human-readable integer: ``2048``, ``32k`` (k, m, g, t: powers of 1000, a fraction allowed where the
    product is whole, ``25.6k``) or ``32K`` (K, M, G, T: powers of 1024); SettingValueError otherwise."""
    value = text.strip()
    match = _HUMAN_INT.fullmatch(value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise SettingValueError(f"{text!r} is not a whole number, e.g. 32768, 32k or 32K") from None
    number, suffix = match.groups()
    if "." in number and suffix.isupper():
        raise SettingValueError(f"{text!r}: a fraction needs a decimal suffix (k, m, g, t), e.g. "
                                f"{number}{suffix.lower()}")
    product = Decimal(number) * _SUFFIX[suffix]
    if product != product.to_integral_value():
        raise SettingValueError(f"{text!r} is not a whole number of tokens")
    return int(product)


FIT_MAX_MODEL_LEN = -1
"""``max_model_len`` auto, as vLLM's -1: the model's length, cut to the tokens the KV cache holds once it is sized."""


def parse_max_model_len(text: str) -> int:
    """`--max-model-len`: a positive `parse_human_int`, or `FIT_MAX_MODEL_LEN` for ``auto`` or ``-1``, as vLLM's
    ``human_readable_int_or_auto``; SettingValueError otherwise."""
    if text.strip().lower() in ("auto", "-1"):
        return FIT_MAX_MODEL_LEN
    value = parse_human_int(text)
    if value < 1:
        raise SettingValueError(f"{text} is out of range: must be at least 1, or auto (-1) for the model's length")
    return value


def checked_by(parse: Callable[[str], Any]) -> Callable[[str], str]:
    """A flag's type function that keeps the text as given once ``parse`` accepts it (its ValueError is the flag's
    error message)."""
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as e:
            raise SettingValueError(str(e)) from None
        return text
    return check


_DEVICE = re.compile(r"cpu|cuda(?::(\d+))?")


def parse_device(text: str) -> str:
    """`--device`: ``cpu``, ``cuda`` or ``cuda:N``, a CUDA device only where torch sees it; SettingValueError
    otherwise."""
    match = _DEVICE.fullmatch(text)
    if match is None:
        raise SettingValueError(f"{text!r} is not a device: cpu, cuda or cuda:N")
    if text.startswith("cuda"):
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise SettingValueError(f"{text}: no CUDA device is available here (torch {torch.__version__}); "
                                    f"use --device cpu")
        if match[1] is not None and int(match[1]) >= count:
            raise SettingValueError(f"{text}: torch sees {count} CUDA device{'s' if count > 1 else ''} here (cuda:0 "
                                    f"to cuda:{count - 1})")
    return text


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""A Hugging Face model id, ``ORG/NAME``."""


def split_hub_id(value: str) -> tuple[str, str | None] | None:
    """``(ORG/NAME, REVISION or None)`` of a Hugging Face model id written ``ORG/NAME[@REVISION]``; None when
    ``value`` is not one."""
    repo_id, at, suffix = value.partition("@")
    if not HUB_ID.fullmatch(repo_id) or (at and not suffix):
        return None
    return repo_id, suffix or None


def parse_tokenizer(text: str) -> str:
    """`--tokenizer`: an existing folder or a Hugging Face id (``ORG/NAME[@REVISION]``), as `ember serve` reads
    MODEL; SettingValueError otherwise."""
    path = Path(text).expanduser()
    if path.is_file():
        raise SettingValueError(f"{text} is a file, not the tokenizer's folder")
    if not path.is_dir() and split_hub_id(text) is None:
        raise SettingValueError(f"{text}: no such directory, and not a Hugging Face model id (ORG/NAME[@REVISION])")
    return text


def parse_json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object; ValueError saying what is wrong otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


def lora_module_parent(text: str) -> tuple[str, str] | None:
    """(name, base model name) of a `--lora-modules` entry in vLLM's JSON form that gives ``base_model_name`` (the
    ``parent`` `/v1/models` lists for it); None otherwise."""
    if not text.lstrip().startswith("{"):
        return None
    spec = parse_json_object(text)
    parent = spec.get("base_model_name")
    return (spec["name"], parent) if isinstance(parent, str) and parent else None


def parse_lora_module(text: str) -> tuple[str, str]:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ...}`` -> (name, path); ValueError otherwise."""
    if text.lstrip().startswith("{"):
        try:
            spec = parse_json_object(text)
        except ValueError as e:
            raise ValueError(f"{text!r}: {e}") from None
        name, path = spec.get("name"), spec.get("path")
    else:
        name, _, path = text.partition("=")
    if not name or not path or not isinstance(name, str) or not isinstance(path, str):
        raise ValueError(f"{text!r} is not NAME=PATH (or {{\"name\": NAME, \"path\": PATH}})")
    return name, path


def _opt(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class EngineArgs:
    """How the engine core runs (names follow vLLM's flags). Defaults here are the only engine defaults."""

    max_model_len: int | None = _opt(None, "context length (prompt + output) in tokens, e.g. 32768, 32k (k, m, g, t: "
                                           "powers of 1000) or 32K (K, M, G, T: powers of 1024); 'auto' or -1 (as "
                                           "vLLM's): the model's length cut to the tokens the KV cache holds (the "
                                           "longest sequence it can take), logged; default: the model's "
                                           "max_position_embeddings",
                                     type=parse_max_model_len, metavar="TOKENS")
    max_num_seqs: int = _opt(64, "sequences decoded together in one step", min=1)
    max_num_batched_tokens: int = _opt(2048, "tokens (prefill chunks + decodes) scheduled in one step, e.g. 8192, "
                                             "8k or 8K (as --max-model-len)", min=1, type=parse_human_int,
                                       metavar="TOKENS")
    block_size: int = _opt(16, "tokens per KV-cache block", min=1)
    enable_chunked_prefill: bool = _opt(True, "split long prompts into chunks that share steps with decodes",
                                        negatable=True)
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of a prompt prefix seen before", negatable=True)
    state_snapshots: int | None = _opt(None, "hybrid models (Qwen3-Next, Qwen3.5): recurrent states saved at prompt "
                                             "boundaries and inside replies for prefix caching; default: "
                                             "max_num_seqs; 0 turns their prefix caching off", metavar="N", min=0)
    kv_cache_dtype: str = _opt("auto", "KV-cache element type: 'auto' (the model dtype) or 'fp8' (e4m3; vLLM's "
                                       "'fp8_e4m3' too)", choices=("auto", "fp8", "fp8_e4m3"))
    quantization: str | None = _opt(None, "'fp8' quantizes an unquantized checkpoint as it loads (every decoder "
                                          "projection and expert in e4m3 with a scale per output channel, W8A16); "
                                          "on a quantized checkpoint the name must be its own quantization, as in "
                                          "vLLM (fp8, modelopt, modelopt_fp4, compressed-tensors, mxfp4)",
                                    choices=("fp8", "modelopt", "modelopt_fp4", "compressed-tensors", "mxfp4"),
                                    aliases=("-q",))
    tokenizer: str | None = _opt(None, "the tokenizer's folder (or Hugging Face id, fetched like the model's), when "
                                       "it is not the model's; its chat template is then the default", metavar="PATH",
                                 type=parse_tokenizer)
    hf_overrides: str | None = _opt(None, "JSON object of config.json fields to change before the model loads, as "
                                          "vLLM applies them, e.g. '{\"rope_scaling\": {\"rope_type\": \"yarn\", "
                                          "\"factor\": 4.0, \"original_max_position_embeddings\": 32768}}' or a "
                                          "causal LM served as a classifier ('classifier_from_token')",
                                    type=checked_by(parse_json_object), metavar="JSON")
    lora_modules: tuple[str, ...] = _opt((), "LoRA adapters to serve, each NAME=PATH (a PEFT folder) or vLLM's JSON "
                                             "{\"name\": ..., \"path\": ...}; a request selects one by its "
                                             "'model'", action="extend", nargs="+", type=checked_by(parse_lora_module),
                                         metavar="NAME=PATH")
    enable_lora: bool = _opt(False, "prepare the model for LoRA adapters loaded at runtime (vLLM's switch; the "
                                    "adapters of --lora-modules are served with or without it)")
    max_loras: int = _opt(1, "LoRA adapter slots on the device (at least one per --lora-modules adapter); every "
                             "batch may mix all of them", metavar="N", min=1)
    max_lora_rank: int = _opt(16, "the largest LoRA rank accepted", metavar="R", min=1)
    kv_cache_blocks: int | None = _opt(None, "KV-cache size in blocks of --block-size tokens (default: sized from "
                                             "memory)", group="kv-cache-size", min=1)
    kv_cache_memory: int | None = _opt(None, "KV-cache size in bytes, e.g. 2G (K, M, G, T: powers of 1024; a lone "
                                             "k, m, g, t: of 1000, as vLLM's)", type=parse_memory,
                                       group="kv-cache-size", aliases=("--kv-cache-memory-bytes",))
    gpu_memory_utilization: float = _opt(0.9, "share of GPU memory for weights, activations and the KV cache "
                                              "(sizes the cache on CUDA)", type=parse_fraction, metavar="FRACTION")
    tensor_parallel_size: int = _opt(1, "split every layer across N processes (N GPUs on CUDA)", metavar="N",
                                     min=1, aliases=("-tp",))
    enforce_eager: bool = _opt(False, "decode without CUDA graphs (on CUDA they are captured for decode batches)")
    async_scheduling: bool = _opt(False, "overlap the host's work for the next step (scheduling, inputs, outputs "
                                         "and stop checks) with the device's current step: the next step is "
                                         "launched before this one's tokens are read (vLLM's flag; steps with "
                                         "speculation, pooling or scored prompts run in order; grammar and "
                                         "bad-words steps overlap too)")
    dtype: str | None = _opt(None, "weight/activation dtype: float32, float16 or bfloat16 (also vLLM's float and "
                                   "half); default: auto, bfloat16 on CUDA and float32 on CPU",
                             choices=("auto", "float32", "float", "float16", "half", "bfloat16"))
    device: str | None = _opt(None, "torch device for rank 0 (cuda, cuda:1, cpu); default: cuda when available",
                              type=parse_device)
    attention_backend: str | None = _opt(None, "attention implementation; default: triton on CUDA, torch on CPU",
                                         choices=("triton", "torch", "reference"))
    moe_backend: str | None = _opt(None, "MoE / NVFP4 kernels; default: triton on CUDA, the torch reference on "
                                         "CPU", choices=("triton", "reference"))
    row_ops_backend: str | None = _opt(None, "RMSNorm (plain and zero-centred), rotary and SiLU- / GELU-tanh-and-mul "
                                             "kernels; default: triton on CUDA, torch on CPU",
                                       choices=("triton", "torch"))
    max_logprobs: int = _opt(20, "the most alternatives per token a request's logprobs, top_logprobs or "
                                 "prompt_logprobs may ask for; -1: the whole vocabulary", metavar="N", min=-1)
    seed: int | None = _opt(None, "seed torch's generator as the engine starts, so unseeded sampling repeats from "
                                  "run to run for the same requests in the same order (vLLM's --seed); a request's "
                                  "own seed is unaffected", metavar="N", min=-2**63, max=2**63 - 1)
    scheduling_policy: str = _opt("fcfs", "'fcfs' serves requests in arrival order; 'priority' orders them by "
                                          "their request's priority (lower first), then arrival, and preempts the "
                                          "lowest first when the KV cache runs out", choices=("fcfs", "priority"))
    speculative_config: str | None = _opt(None, "JSON object of vLLM's speculative decoding settings; Ember "
                                                "speculates by n-gram prompt lookup (greedy, sampled and "
                                                "constrained requests alike): "
                                                "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                                                "\"prompt_lookup_max\": 3}'",
                                          type=checked_by(lambda text: _speculative(text)), metavar="JSON")
    cpu_threads: int | None = _opt(None, "torch CPU threads of the engine process and of each tensor-parallel "
                                         "worker (per rank, as in vLLM); default: every core but one (left to the "
                                         "HTTP front end), divided among the tensor-parallel ranks", min=1)

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments of `Engine.from_pretrained` (everything but the backends, see `apply_environment`)."""
        return {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_model_len": self.max_model_len, "block_size": self.block_size,
                "num_kv_blocks": self.kv_cache_blocks, "kv_cache_memory": self.kv_cache_memory,
                "enable_prefix_caching": self.enable_prefix_caching, "state_snapshots": self.state_snapshots,
                "enable_chunked_prefill": self.enable_chunked_prefill, "device": self.device,
                "dtype": None if self.dtype == "auto" else self.dtype,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "tensor_parallel_size": self.tensor_parallel_size, "enforce_eager": self.enforce_eager,
                "async_scheduling": self.async_scheduling,
                "kv_cache_dtype": self.kv_cache_dtype, "quantization": self.quantization,
                "hf_overrides": parse_json_object(self.hf_overrides) if self.hf_overrides else None,
                "lora_modules": tuple(parse_lora_module(m) for m in self.lora_modules), "max_loras": self.max_loras,
                "max_lora_rank": self.max_lora_rank, "enable_lora": self.enable_lora, "seed": self.seed,
                "tokenizer": self.tokenizer, "max_logprobs": self.max_logprobs,
                "scheduling_policy": self.scheduling_policy,
                "speculative_config": parse_json_object(self.speculative_config) if self.speculative_config else None}

    def apply_environment(self) -> None:
        """Select the kernel backends for this process (the engine modules read them where they build layers)."""
        for name, value in (("EMBER_ATTENTION", self.attention_backend), ("EMBER_MOE", self.moe_backend),
                            ("EMBER_ROW_OPS", self.row_ops_backend)):
            if value is not None:
                os.environ[name] = value

    def apply_threads(self) -> None:
        """Size torch's CPU thread pool for an engine process that shares the machine with the front end (on a
        2-core host, two spinning OpenMP threads beside a busy front end make each step many times slower):
        ``cpu_threads``, else every core but one divided among the tensor-parallel ranks, at least one each
        (the workers take the driver's count)."""
        import torch

        ranks = max(1, self.tensor_parallel_size)
        torch.set_num_threads(self.cpu_threads or max(1, ((os.cpu_count() or 2) - 1) // ranks))


def _speculative(text: str) -> dict[str, Any]:
    """`--speculative-config`: the JSON object, checked as the engine reads it."""
    from ember.engine.speculative import parse_speculative_config

    value = parse_json_object(text)
    parse_speculative_config(value)
    return value


def engine_args_of(config: Any) -> EngineArgs:
    """The `EngineArgs` part of any dataclass that has (some of) its fields, e.g. a `ServeConfig`."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: getattr(config, k) for k in names if hasattr(config, k)})


# ------------------------------------------------------------------------------------------------ flag generation

T = TypeVar("T")


COUNT_MAX = 2**31 - 1
"""The most a count flag (sequences, tokens, blocks, slots...) takes where its field sets no ``max``: each sizes
tables and tensors, which a larger value overflows in torch's own words."""


def _flag_type(f: dataclasses.Field) -> Any:
    t = f.metadata.get("type")
    if t is None:
        ann = str(f.type)
        t = Path if "Path" in ann else float if "float" in ann else int if "int" in ann else str
    high = f.metadata.get("max", COUNT_MAX if t in (int, parse_human_int) else None)
    if "min" in f.metadata or high is not None:
        return _bounded(t, f.metadata.get("min"), high)
    return t


def _bounded(parse: Callable[[str], Any], low: float | None, high: float | None) -> Callable[[str], Any]:
    """``parse`` that also refuses a value outside [low, high] (either may be None) or not finite."""
    def check(text: str) -> Any:
        value = parse(text)
        if isinstance(value, float) and not math.isfinite(value):
            raise SettingValueError(f"{text!r} is not a finite number")
        if (low is not None and value < low) or (high is not None and value > high):
            want = f"from {low} to {high}" if low is not None and high is not None else \
                f"at least {low}" if low is not None else f"at most {high}"
            raise SettingValueError(f"{text} is out of range: must be {want}")
        return value
    check.__name__ = getattr(parse, "__name__", "value")  # argparse's "invalid int value: 'x'" stays as it was
    return check


def _flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _is_bool(f: dataclasses.Field) -> bool:
    return str(f.type).replace(" ", "") in ("bool", "bool|None")


def _show(default: Any) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None or default == ():
        return "none"
    return str(default)


class _Accumulate(argparse.Action):
    """A list flag: the values of each use, in order (one per use, or several with ``nargs``). Its first use in a
    parse replaces the default, which a ``--config`` file may have set: the command line wins over the file, as in
    vLLM (where a key rotated on the command line retires the file's)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest, None)
        kept = [] if current is None or current is parser.get_default(self.dest) else list(current)
        setattr(namespace, self.dest, kept + (list(values) if isinstance(values, list) else [values]))


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argparse argument per field of dataclass ``cls`` that has ``help`` metadata, default shown in the help."""
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        helptext = meta["help"] if "default:" in meta["help"] else f"{meta['help']} (default: {_show(default)})"
        if meta.get("positional"):
            parser.add_argument(f.name, nargs="?", default=default, metavar=meta.get("metavar", f.name.upper()),
                                help=helptext)
            continue
        target: Any = parser
        if "group" in meta:
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_mutually_exclusive_group()
            target = groups[meta["group"]]
        flag = _flag_name(f)
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": helptext}
        if _is_bool(f):
            kw["action"] = argparse.BooleanOptionalAction if meta.get("negatable") else "store_true"
        elif meta.get("action") in ("append", "extend"):
            kw.update(action=_Accumulate, default=None, type=_flag_type(f))
            if "nargs" in meta:
                kw["nargs"] = meta["nargs"]
            if "metavar" in meta:
                kw["metavar"] = meta["metavar"]
        else:
            kw["type"] = _flag_type(f)
            if "nargs" in meta:
                kw["nargs"] = meta["nargs"]
            if "choices" in meta:
                kw["choices"] = list(meta["choices"])
            if "metavar" in meta:
                kw["metavar"] = meta["metavar"]
        aliases = meta.get("aliases", ())
        if aliases:
            kw["help"] = f"{helptext}; also {', '.join(aliases)}"
        target.add_argument(flag, **kw)
        for alias in aliases:  # an action of its own, so that an error names the spelling given
            target.add_argument(alias, **{**kw, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS})


def from_namespace(cls: type[T], args: argparse.Namespace) -> T:
    """``cls`` built from the parsed arguments (fields without a flag keep their defaults; repeated flags become
    tuples, a positional argument is parsed by its ``type``); SettingValueError, its message argparse's
    ``argument --x: ...``, for a positional argument its ``type`` refuses or a switch given without the one it
    ``requires``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for f in fields.values():
        if not hasattr(args, f.name):
            continue
        v = getattr(args, f.name)
        if f.metadata.get("action") in ("append", "extend"):
            v = tuple(v) if v is not None else f.default
        elif f.metadata.get("positional") and isinstance(v, str):
            try:
                v = _flag_type(f)(v)
            except (SettingValueError, ValueError) as e:
                raise SettingValueError(f"argument {f.metadata.get('metavar', f.name.upper())}: {e}") from None
        values[f.name] = v
    for name, v in values.items():
        needed = fields[name].metadata.get("requires")
        if v and needed is not None and not values.get(needed):
            raise SettingValueError(f"argument {_flag_name(fields[name])}: needs {_flag_name(fields[needed])}")
    return cls(**values)
