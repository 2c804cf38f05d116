"""Tensor parallelism: the process group, the driver/worker protocol, and how weights are split.

Rank 0 (the driver) owns the scheduler, the sampler and the API; ranks 1..N-1 (workers, spawned processes) each hold
a shard of every layer and its share of the KV heads. Every model-runner call on the driver (allocate the KV cache,
profile, run a step) is first broadcast as a `RunnerCommand`, so all ranks run the same forwards and meet at the
same all-reduces. A step travels as the host buffers the driver staged its inputs in (`ModelRunner.stage`), and the
tokens it carries from the step still in flight (asynchronous scheduling) by a device broadcast: no rank reads the
device back to start a step.

Attention heads and MLP (and expert) intermediate channels are split evenly: column-parallel projections (q/k/v,
gate/up) keep rows ``[rank*n/N, (rank+1)*n/N)``, row-parallel ones (o, down) keep those columns and
all-reduce their output (their bias is loaded on rank 0 only, so it is added once); embeddings, norms, routers and
the LM head are replicated. Each rank reads only its slice of every tensor from the safetensors files. Quantized
checkpoints split alike: NVFP4 block scales with their packed weight (whole 16-input blocks), per-tensor scales
replicated; a block-FP8 weight is dequantized by each rank for its slice, by the scale blocks that slice falls in.

Backend: gloo on CPU, NCCL on CUDA (rank ``r`` on ``cuda:r``); commands always travel over a gloo group, which waits
without a deadline while the server is idle. One tensor-parallel engine per process at a time.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ember.engine import fp8_loading, loader
from ember.engine.config import ConfigError, EngineConfig, ModelConfig, SettingError
from ember.engine.model_runner import CarriedTokens, ModelRunner, StagedStep
from ember.engine.scheduler import SchedulerOutput
from ember.kernels import fp8_block

log = logging.getLogger(__name__)

_COLLECTIVE_TIMEOUT = timedelta(minutes=10)
_IDLE_TIMEOUT = timedelta(days=3650)  # workers wait this long for the driver's next command
_COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
_ROW = frozenset({"o_proj", "down_proj"})
_JOINED = "ember/tp/joined"
_LINEAR_ATTENTION_SPLIT = ("linear_num_key_heads", "linear_num_value_heads")
"""Qwen3-Next's linear-attention heads: each rank keeps a contiguous share of the key heads and their value heads."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (``world_size == 1``: no group, every op a no-op)."""

    rank: int = 0
    world_size: int = 1
    control: Any = field(default=None, compare=False, repr=False)  # the gloo group commands travel on

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.enabled:
            dist.all_reduce(x)
        return x

    def broadcast(self, obj: Any) -> Any:
        """The driver's ``obj`` on every rank (workers pass None)."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out


SINGLE = TensorParallel()


@dataclass
class RunnerCommand:
    """One call the driver makes on its model runner, replayed by every worker (tensors travel on the CPU)."""

    method: str
    args: tuple = ()


@dataclass(frozen=True)
class ShardSpec:
    """What a worker needs to build the same runner as the driver (picklable)."""

    model_class: type
    max_position: int
    block_size: int
    dtype: torch.dtype
    device_type: str
    num_threads: int
    kv_cache_dtype: torch.dtype
    quantization: str | None
    model_config: ModelConfig  # the whole model's, as the driver read it (with --hf-overrides applied)
    tokenizer_dir: str  # where the tokenizer is (a classifier made from LM-head rows resolves its tokens there)


# ---- how the model is split ---------------------------------------------------------------------------------------

def check_split(cfg: ModelConfig, world_size: int, source: str = "config.json") -> None:
    """ConfigError naming the config.json field that ``world_size`` does not divide."""
    from ember.engine.models.qwen3_moe import moe_settings

    fields = [("num_attention_heads", cfg.num_attention_heads)]
    if not _is_mla(cfg):  # MLA's one latent KV head is replicated
        fields.append(("num_key_value_heads", cfg.num_key_value_heads))
    # Qwen3-MoE-style experts have moe_intermediate_size; gpt-oss's experts use intermediate_size (checked as dense)
    has_moe_size = "moe_intermediate_size" in cfg.raw
    sparse = moe_settings(cfg)[1] if has_moe_size and ("num_experts" in cfg.raw or "num_local_experts" in cfg.raw) \
        else []
    if not sparse or not all(sparse):  # some layer has the dense MLP
        fields.append(("intermediate_size", cfg.intermediate_size))
    if any(sparse):
        fields.append(("moe_intermediate_size", int(cfg.raw.get("moe_intermediate_size") or 0)))
    for key in _LINEAR_ATTENTION_SPLIT if cfg.linear_attention_layers else ():
        fields.append((key, int(cfg.raw.get(key) or 0)))
    if cfg.raw.get("intermediate_size_mlp"):  # Llama 4's dense layers
        fields.append(("intermediate_size_mlp", int(cfg.raw["intermediate_size_mlp"])))
    if any(sparse) and cfg.raw.get("shared_expert_intermediate_size"):
        fields.append(("shared_expert_intermediate_size", int(cfg.raw["shared_expert_intermediate_size"])))
    for name, n in fields:
        if n % world_size:
            raise SettingError("--tensor-parallel-size", f"{source}: tensor_parallel_size {world_size} does not "
                               f"divide {name} ({n}); choose a tensor_parallel_size that divides it")


def _is_mla(cfg: ModelConfig) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3): every rank caches the whole latent and splits the heads."""
    return bool(cfg.raw.get("kv_lora_rank"))


def shard_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The per-rank view of ``cfg``: heads, KV heads and intermediate sizes divided by N (``cfg`` itself for N=1)."""
    if not tp.enabled:
        return cfg
    n = tp.world_size
    check_split(cfg, n)
    raw = dict(cfg.raw)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                "shared_expert_intermediate_size", "intermediate_size_mlp", *_LINEAR_ATTENTION_SPLIT):
        if isinstance(raw.get(key), int):
            raw[key] = raw[key] // n
    kv_heads = cfg.num_key_value_heads if _is_mla(cfg) else cfg.num_key_value_heads // n
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // n, num_key_value_heads=kv_heads,
                               intermediate_size=cfg.intermediate_size // n, raw=raw)


def _split_rule(name: str) -> tuple[str, int]:
    """How tensor ``name`` is split: ("replicate", -1), ("shard", dim), ("rank0", -1) for a row-parallel bias, or
    ("gate_up", 1) for transformers 5's fused expert stack ``[E, 2I, H]`` (gate and up halves split apart).
    A model's own rule may also return ("segments", dim, sizes): ``dim`` concatenates parts of those sizes, each
    split evenly (the rank's slices of every part, concatenated); or ("either_dim", dim, size, halves) for a fused
    expert stack whose checkpoint may hold it transposed: the dimension of ``size`` (``dim``, else the other of 1
    and 2) is split, as gate and up halves when ``halves`` is 2."""
    parts = name.split(".")
    if len(parts) < 2:
        return "replicate", -1
    module, leaf = parts[-2], parts[-1]
    if module == "experts" and leaf == "gate_up_proj":
        return "gate_up", 1
    if module == "experts" and leaf == "down_proj":
        return "shard", 2
    if leaf not in ("weight", "bias", "weight_scale"):  # NVFP4's block scales split as their packed weight does
        return "replicate", -1
    if module in _COLUMN:
        return "shard", 0
    if module in _ROW:
        return ("rank0", -1) if leaf == "bias" else ("shard", 1)
    return "replicate", -1


def whole_qk_norm_rule(name: str) -> tuple[str, int]:
    """`_split_rule` for a model whose q/k norms span the whole projections (OLMo 2/3, MiniMax-M2): their weights
    split as the projections' rows (each rank its heads' share; `Attention` sums the mean square over the ranks)."""
    module, _, leaf = name.rpartition(".")
    if leaf == "weight" and module.endswith((".self_attn.q_norm", ".self_attn.k_norm")):
        return "shard", 0
    return _split_rule(name)


def _kept_ranges(shape: list[int], name: str, rule: tuple, tp: TensorParallel,
                 source: Path) -> tuple[int, list[tuple[int, int]]] | None:
    """Which part of a tensor of ``shape`` this rank keeps under ``rule``: ``(dim, [(start, stop), ...])``, the
    ranges concatenated in order along ``dim``; None when it keeps the whole tensor."""
    kind, dim, *parts = rule
    if kind in ("replicate", "rank0"):
        return None
    if kind == "either_dim":
        size, halves = parts
        if len(shape) == 3 and shape[dim] != size:
            dim = 3 - dim
        if len(shape) != 3 or shape[dim] != size:
            raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(shape)}; expected {size} along dimension "
                              "1 or 2")
        kind, parts = ("gate_up" if halves == 2 else "shard"), []
    if dim >= len(shape):
        raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(shape)}; cannot split dimension {dim}")
    n, r = tp.world_size, tp.rank
    if kind == "segments":
        sizes = parts[0]
        if sum(sizes) != shape[dim] or any(size % n for size in sizes):
            raise ConfigError(f"{source}: tensor {name!r} dimension {dim} ({shape[dim]}) is not parts {sizes} "
                              f"that tensor_parallel_size {n} divides")
    else:
        full = shape[dim] // 2 if kind == "gate_up" else shape[dim]
        if full % n:
            blocks = "; a rank's slice must hold whole 16-input NVFP4 scale blocks" \
                if name.endswith(".weight_scale") else ""
            raise ConfigError(f"{source}: tensor_parallel_size {n} does not divide dimension {dim} "
                              f"({full}) of tensor {name!r}{blocks}")
        sizes = [full, full] if kind == "gate_up" else [full]
    ranges, start = [], 0
    for size in sizes:
        share = size // n
        ranges.append((start + r * share, start + (r + 1) * share))
        start += size
    return dim, ranges


def _kept_indices(ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in ranges])


def _take(t: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The ``ranges`` of ``t`` along ``dim``, concatenated in order."""
    pieces = [t.narrow(dim, a, b - a) for a, b in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _read_shard(sf: Any, name: str, rule: tuple, tp: TensorParallel, source: Path) -> torch.Tensor:
    """This rank's slice of tensor ``name`` of the open safetensors file ``sf``, reading only that slice."""
    sl = sf.get_slice(name)
    kept = _kept_ranges(list(sl.get_shape()), name, rule, tp, source)
    if kept is None:
        t = sf.get_tensor(name)
        return t if rule[0] == "replicate" or tp.is_driver else torch.zeros_like(t)
    dim, ranges = kept
    lead = (slice(None),) * dim
    pieces = [sl[lead + (slice(a, b),)] for a, b in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def shard_shape(name: str, shape: list[int], rule: tuple, tp: TensorParallel, source: Path) -> list[int]:
    """The shape of this rank's slice of a tensor of ``shape`` (what :func:`iter_shard_weights` yields for it)."""
    kept = _kept_ranges(shape, name, rule, tp, source)
    if kept is None:
        return list(shape)
    dim, ranges = kept
    return [sum(b - a for a, b in ranges) if d == dim else n for d, n in enumerate(shape)]


class ShardedWeights:
    """One rank's weight stream (see :func:`iter_shard_weights`); ``shard_shape(name, shape)`` tells a loader that
    checks tensor shapes from the safetensors headers (NVFP4's plan) what this rank will receive."""

    def __init__(self, model_dir: str | Path, tp: TensorParallel, rule: Callable[[str], tuple],
                 fp8: fp8_loading.FP8Format | None) -> None:
        self.model_dir, self.tp, self.rule, self.fp8 = Path(model_dir), tp, rule, fp8
        self.keep_fp8: Callable[[str], bool] | None = None
        """Set by the loader before the first tensor is read: FP8 modules to yield packed (weight and scale
        slices), not dequantized."""
        self._it = self._stream()

    def __iter__(self) -> "ShardedWeights":
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._it)

    def shard_shape(self, name: str, shape: list[int]) -> list[int]:
        return shard_shape(name, shape, self.rule(name), self.tp, self.model_dir)

    def _stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        files = loader.weight_files(self.model_dir)
        fmt = self.fp8
        # quantizing on load, the loader's stream quantizes this rank's (floating-point) slices
        paired = fp8_loading.paired_scales(files, fmt.scale_suffix) if fmt is not None and not fmt.on_load else {}
        suffix = fmt.scale_suffix if fmt is not None else None
        stacks: dict[str, dict[str, tuple[Path, str]]] = {}  # a kept layer's first fused stack, until its partner
        for f in files:
            with loader.open_safetensors(f) as sf:
                for name in sf.keys():
                    module = name.rsplit(".", 1)[0]
                    if module in paired and name.endswith(suffix):
                        continue  # read with its weight
                    stack = self._kept_stack(name)
                    if stack is not None:
                        pair = stacks.setdefault(stack[0], {})
                        pair[stack[1]] = (f, name)
                        if len(pair) == 2:
                            yield from self._quantized_experts(stacks.pop(stack[0]))
                        continue
                    rule = self.rule(name)
                    kept_fp8 = name.endswith(".weight") and self.keep_fp8 is not None and self.keep_fp8(module)
                    if kept_fp8 and fmt.on_load:
                        yield from self._quantized_shard(sf, name, rule, fmt, f)
                    elif module in paired and kept_fp8:
                        yield from self._packed_shard(sf, name, rule, fmt, paired[module][0], f)
                    elif module in paired and name.endswith(".weight"):
                        yield name, self._dequantized_shard(sf, name, rule, fmt, paired[module][0], f)
                    else:
                        yield name, _read_shard(sf, name, rule, self.tp, f)
        for pair in stacks.values():  # partnerless: the loader's quantizer names what is missing
            for f, name in pair.values():
                with loader.open_safetensors(f) as sf:
                    yield name, _read_shard(sf, name, self.rule(name), self.tp, f)

    def _kept_stack(self, name: str) -> tuple[str, str] | None:
        """`fp8_loading.fused_expert_stack` of a fused expert stack that ``--quantization fp8`` quantizes (the
        loader keeps its experts packed), else None."""
        stack = fp8_loading.fused_expert_stack(name)
        if stack is None or self.fp8 is None or not self.fp8.on_load or self.keep_fp8 is None:
            return None
        return stack if self.keep_fp8(fp8_loading.stack_expert(stack)) else None

    def _quantized_experts(self, pair: dict[str, tuple[Path, str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``--quantization fp8`` on one layer's fused expert stacks: each expert read whole and quantized per output
        channel as one process does (`fp8_loading.quantized_expert`), then this rank's share of its gate, up and down
        weights and scales (down's scales come from whole rows, not this rank's half of them)."""
        (f13, n13), (f2, n2) = pair["gate_up_proj"], pair["down_proj"]
        with loader.open_safetensors(f13) as a, loader.open_safetensors(f2) as b:
            s13, s2 = a.get_slice(n13), b.get_slice(n2)
            dims = fp8_loading.fused_expert_dims(list(s13.get_shape()), list(s2.get_shape()))
            if dims is None:  # the loader's quantizer names both shapes
                yield n13, _read_shard(a, n13, self.rule(n13), self.tp, f13)
                yield n2, _read_shard(b, n2, self.rule(n2), self.tp, f2)
                return
            inter, _, transposed = dims
            prefix = n13[: -len("gate_up_proj")]
            for e in range(s13.get_shape()[0]):
                for name, q in fp8_loading.quantized_expert(f"{prefix}{e}.", s13[e:e + 1][0], s2[e:e + 1][0],
                                                                inter, transposed):
                    yield from self._share(name, q, self.rule(name), f13)

    def _quantized_shard(self, sf: Any, name: str, rule: tuple, fmt: fp8_loading.FP8Format,
                         source: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """``--quantization fp8``: the whole weight quantized per output channel, then this rank's slice of it and
        of its scales, so every rank holds exactly its share of what one process would (a row-parallel slice's
        scales come from whole rows)."""
        yield from self._share(name, fp8_block.quantize(sf.get_tensor(name), fmt.block), rule, source)

    def _share(self, name: str, q: fp8_block.FP8BlockTensor, rule: tuple,
               source: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's slice of the per-channel quantized weight ``name`` and of its ``[N, 1]`` scales."""
        kept = _kept_ranges(list(q.weight.shape), name, rule, self.tp, source)
        if kept is None:
            yield name, q.weight
            yield name[: -len(".weight")] + fp8_loading.SCALE, q.scale
            return
        dim, ranges = kept
        yield name, _take(q.weight, dim, ranges)
        yield name[: -len(".weight")] + fp8_loading.SCALE, _take(q.scale, 0, ranges) if dim == 0 else q.scale

    def _packed_shard(self, sf: Any, name: str, rule: tuple, fmt: fp8_loading.FP8Format, scale_file: Path,
                      source: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's slice of an FP8 weight as it is stored, then the part of its scale tensor (as stored: block
        grid, per-channel column or per-tensor scalar) that covers it; the slice must start on a block boundary, as
        the model checked when it chose to keep it packed."""
        module = name[: -len(".weight")]
        shape = list(sf.get_slice(name).get_shape())
        kept = _kept_ranges(shape, name, rule, self.tp, source)
        yield name, _read_shard(sf, name, rule, self.tp, source)
        scale_name = module + fmt.scale_suffix
        with loader.open_safetensors(scale_file) as scales:
            scale = scales.get_tensor(scale_name)
        if kept is None or scale.numel() == 1 or fmt.granularity == "tensor" or (fmt.granularity == "channel"
                                                                                 and kept[0] == 1):
            yield scale_name, scale  # the whole of it covers any slice
            return
        dim, ranges = kept
        b = fmt.block[dim]
        if any(a % b or (z % b and z != shape[dim]) for a, z in ranges):
            raise ConfigError(f"{source}: tensor {name!r}: this rank's rows/columns {ranges} cut its {fmt.block} FP8 "
                              "scale blocks")
        grid = scale.reshape(-1, 1) if fmt.granularity == "channel" else scale
        yield scale_name, _take(grid, dim, [(a // b, -(-z // b)) for a, z in ranges])

    def _dequantized_shard(self, sf: Any, name: str, rule: tuple, fmt: fp8_loading.FP8Format, scale_file: Path,
                           source: Path) -> torch.Tensor:
        """This rank's slice of an FP8 weight, dequantized by the scale blocks its rows and columns fall in (a slice
        need not start or end on a block boundary)."""
        module = name[: -len(".weight")]
        with loader.open_safetensors(scale_file) as scales:
            scale = scales.get_tensor(module + fmt.scale_suffix)
        shape = list(sf.get_slice(name).get_shape())
        grid = fp8_loading.scale_grid(scale, shape, fmt, module, str(source))
        kept = _kept_ranges(shape, name, rule, self.tp, source)
        index = [torch.arange(n) for n in shape]
        if kept is not None:
            index[kept[0]] = _kept_indices(kept[1])
        bn, bk = fmt.block
        per_element = grid.index_select(0, index[0] // bn).index_select(1, index[1] // bk)
        return _read_shard(sf, name, rule, self.tp, source).float() * per_element


def iter_shard_weights(model_dir: str | Path, tp: TensorParallel, split_rule: Callable[[str], tuple[str, int]]
                       | None = None, fp8: fp8_loading.FP8Format | None = None) -> ShardedWeights:
    """(name, this rank's slice) for every tensor of the checkpoint, reading only that slice from disk. With ``fp8``
    (an FP8 checkpoint's format) its e4m3 weights come dequantized and their scale tensors are consumed, except
    those the loader keeps packed (``keep_fp8``). ``split_rule`` (a model class's ``tp_split_rule`` bound to the
    checkpoint's config, where its tensors differ from the rules here) overrides :func:`_split_rule`."""
    return ShardedWeights(model_dir, tp, split_rule or _split_rule, fp8)


def attach(model: torch.nn.Module, tp: TensorParallel) -> torch.nn.Module:
    """Give every layer that ends in a row-parallel projection (it has a ``tp`` attribute) the group to reduce on."""
    for m in model.modules():
        if hasattr(m, "tp"):
            m.tp = tp
    return model


# ---- processes ----------------------------------------------------------------------------------------------------

def init_group(rank: int, world_size: int, store: dist.Store, device: torch.device) -> TensorParallel:
    """Join the process group through ``store`` (gloo on CPU, NCCL on CUDA) and its gloo command group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return TensorParallel(rank, world_size, control)


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank ``r`` uses ``cuda:r`` on GPUs, the CPU otherwise."""
    return torch.device("cuda", rank) if base.type == "cuda" else torch.device("cpu")


def _load_shard(model_dir: str, spec: ShardSpec, tp: TensorParallel,
                device: torch.device) -> tuple[torch.nn.Module, ModelConfig]:
    """This rank's model (its slices only, wired to reduce over ``tp``) and its per-rank config."""
    from ember.engine.engine import load_model

    full = spec.model_config
    cfg = shard_config(full, tp)
    own = getattr(spec.model_class, "tp_split_rule", None)
    rule = None if own is None else (lambda name: own(name, full))
    fmt = fp8_loading.resolve_format(full.raw, model_dir, spec.quantization)
    model = load_model(model_dir, cfg, spec.max_position, device, spec.dtype,
                       weights=iter_shard_weights(model_dir, tp, rule, fmt), model_class=spec.model_class,
                       quantization=spec.quantization, tokenizer_dir=spec.tokenizer_dir)
    return attach(model, tp), cfg


def worker_main(rank: int, world_size: int, port: int, model_dir: str, spec: ShardSpec) -> None:
    """A worker: load this rank's shard, report, then replay the driver's runner commands until told to stop."""
    torch.set_num_threads(spec.num_threads)
    device = rank_device(torch.device(spec.device_type), rank)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=_COLLECTIVE_TIMEOUT)
    store.add(_JOINED, 1)
    tp = init_group(rank, world_size, store, device)
    try:
        runner, error = None, None
        try:
            model, cfg = _load_shard(model_dir, spec, tp, device)
            runner = WorkerRunner(model, cfg, spec.block_size, device, spec.dtype, kv_cache_dtype=spec.kv_cache_dtype)
            runner.shard = (rank, world_size)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            log.error("tensor-parallel rank %d failed to load:\n%s", rank, traceback.format_exc())
        if any(tp.gather(error)):
            return
        while True:
            cmd: RunnerCommand | None = tp.broadcast(None)
            if cmd is None:
                break
            try:
                getattr(runner, cmd.method)(*cmd.args)
            except Exception:
                # the group cannot go on without this rank: say why, then exit at once, so the driver finds this
                # process gone when its collectives break
                log.error("tensor-parallel rank %d failed in %s; the worker exits:\n%s", rank, cmd.method,
                          traceback.format_exc())
                sys.stderr.flush()
                os._exit(1)
    finally:
        dist.destroy_process_group()


class WorkerRunner(ModelRunner):
    """A worker rank's model runner: runs the steps the driver staged, with the carried tokens it broadcasts."""

    @torch.inference_mode()
    def run_staged(self, st: StagedStep) -> None:
        """Load the driver's host buffers into this rank's staging and run the forward (logits stay unused)."""
        self._staged64.host(st.h64.shape[0])[:] = st.h64
        self._staged32.host(st.h32.shape[0])[:] = st.h32
        self.forward(*self.load(st))

    def carried_values(self, carried: CarriedTokens | None, sampled_rows: torch.Tensor) -> torch.Tensor:
        """The driver's carried tokens, broadcast device to device (no host read on either side)."""
        values = torch.empty(sampled_rows.shape[0], dtype=torch.int64, device=self.device)
        dist.broadcast(values, src=0)
        return values


class DriverRunner(ModelRunner):
    """Rank 0's model runner: broadcasts each call to the workers before making it itself."""

    def __init__(self, *args: Any, tp: TensorParallel, workers: list[mp.process.BaseProcess], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp
        self.workers = workers

    def _send(self, method: str, *args: Any) -> None:
        self.tp.broadcast(RunnerCommand(method, args))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._send("allocate_kv_cache", num_blocks)
        super().allocate_kv_cache(num_blocks)

    def allocate_recurrent_state(self, num_slots: int, num_snapshots: int = 0) -> None:
        if self.recurrent:
            self._send("allocate_recurrent_state", num_slots, num_snapshots)
        super().allocate_recurrent_state(num_slots, num_snapshots)

    def profile_activation_bytes(self, num_tokens: int, num_seqs: int) -> int:
        self._send("profile_activation_bytes", num_tokens, num_seqs)
        return super().profile_activation_bytes(num_tokens, num_seqs)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Every rank routes decode steps alike, so all meet the same all-reduces (the engine captures no CUDA
        graphs under tensor parallelism: `ModelRunner.graph_blocker`; on a CPU this is the padded eager path)."""
        self._send("capture_decode_graphs", max_num_seqs, max_model_len)
        super().capture_decode_graphs(max_num_seqs, max_model_len)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, carried: CarriedTokens | None = None) -> torch.Tensor:
        """Stage the step on the host and send those buffers, so no rank reads a device value back: the tokens the
        previous step left on the device (asynchronous scheduling) follow by a device broadcast."""
        st = self.stage(out, carried)
        self._send("run_staged", st)
        return self.forward(*self.load(st, carried))

    def carried_values(self, carried: CarriedTokens | None, sampled_rows: torch.Tensor) -> torch.Tensor:
        values = super().carried_values(carried, sampled_rows)
        dist.broadcast(values, src=0)
        return values

    def enable_lora(self, slots: int, max_rank: int) -> None:
        self._send("enable_lora", slots, max_rank)
        super().enable_lora(slots, max_rank)

    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Rank 0 reads and checks the adapter first, so a refused one reaches no worker."""
        super().load_lora(name, path, replace)
        self._send("load_lora", name, path, replace)

    def unload_lora(self, name: str) -> None:
        self._send("unload_lora", name)
        super().unload_lora(name)

    def dead_worker(self, wait: float = 0.0) -> str | None:
        """Why this group is broken when a worker process has exited (waiting up to ``wait`` seconds for one to
        exit), naming it and its exit code; None while every worker runs."""
        ended = wait_for_any([p.sentinel for p in self.workers], timeout=wait) if self.workers else []
        for p in self.workers:
            if p.sentinel in ended:
                p.join(5.0)  # its sentinel closes as it exits, a moment before it can be reaped
        dead = next((p for p in self.workers if not p.is_alive()), None)
        if dead is None:
            return None
        return f"tensor-parallel worker {dead.name} died unexpectedly (exit code {dead.exitcode})"

    def shutdown(self) -> None:
        """Tell the workers to exit and wait for them; idempotent."""
        if not self.workers:
            return
        workers, self.workers = self.workers, []
        stop_workers(self.tp, workers)


def start_driver(model_dir: str | Path, mc: ModelConfig, config: EngineConfig, max_position: int,
                 device: torch.device, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> DriverRunner:
    """Check the split, spawn ranks 1..N-1, join the group as rank 0 and load every rank's shard; a failure on any
    rank raises here (after the workers are gone). Workers build the class this process resolves for the model."""
    from ember.engine.models import get_model_class

    n = config.tensor_parallel_size
    source = str(Path(model_dir) / "config.json")
    model_class = get_model_class(mc.architecture, source=source)
    check_split(mc, n, source)
    # a malformed FP8 config, or --quantization of a quantized checkpoint, fails here before any worker starts
    fp8_loading.resolve_format(mc.raw, model_dir, config.quantization)
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ConfigError(f"tensor_parallel_size {n} runs on cuda:0..cuda:{n - 1}; got device {device}")
        if torch.cuda.device_count() < n:
            raise SettingError("--tensor-parallel-size", f"tensor_parallel_size {n} needs {n} GPUs; "
                               f"{torch.cuda.device_count()} visible")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group is already active in this process "
                           "(one tensor-parallel engine per process; shut the other down first)")
    spec = ShardSpec(model_class, max_position, config.block_size, dtype, device.type, torch.get_num_threads(),
                     kv_cache_dtype, config.quantization, mc, str(config.tokenizer or model_dir))
    store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, timeout=_COLLECTIVE_TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=worker_main, args=(r, n, store.port, str(model_dir), spec),
                           name=f"ember-tp-worker-{r}", daemon=True) for r in range(1, n)]
    for p in workers:
        p.start()
    try:
        _wait_for_workers(store, workers)
        tp = init_group(0, n, store, rank_device(device, 0))
    except BaseException:
        _reap(workers)
        raise
    runner, failure = None, None
    try:
        model, cfg = _load_shard(str(model_dir), spec, tp, rank_device(device, 0))
        runner = DriverRunner(model, cfg, spec.block_size, device, dtype, kv_cache_dtype=kv_cache_dtype, tp=tp,
                              workers=workers)
        runner.shard = (0, n)
    except Exception as e:
        failure = e
    errors = tp.gather(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None or any(errors):
        dist.destroy_process_group()
        _reap(workers)
        if failure is not None:
            raise failure
        rank, msg = next((r, e) for r, e in enumerate(errors) if e)
        raise RuntimeError(f"tensor-parallel rank {rank} failed to load {model_dir}: {msg}")
    return runner


def _wait_for_workers(store: dist.Store, workers: list[mp.process.BaseProcess]) -> None:
    """Return once every worker has reached the store; raise as soon as one has died instead (a spawned worker that
    cannot start, e.g. a script without a main guard, would otherwise leave the driver waiting for the timeout)."""
    deadline = time.monotonic() + _COLLECTIVE_TIMEOUT.total_seconds()
    while store.add(_JOINED, 0) < len(workers):
        dead = next((p for p in workers if not p.is_alive()), None)
        if dead is not None and dead.exitcode is not None and dead.exitcode < 0:  # a signal, not its own error
            raise RuntimeError(f"tensor-parallel worker {dead.name} was killed by signal {-dead.exitcode} before "
                               "joining the group")
        if dead is not None:
            raise RuntimeError(f"tensor-parallel worker {dead.name} exited (code {dead.exitcode}) before joining the "
                               "group; its error is printed above. Workers are spawned: a script that starts a "
                               "tensor-parallel engine needs an `if __name__ == \"__main__\":` guard")
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor-parallel workers did not start within {_COLLECTIVE_TIMEOUT}")
        time.sleep(0.02)


def _reap(procs: list[mp.process.BaseProcess], timeout: float = 30.0) -> None:
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            log.warning("tensor-parallel worker %s did not exit; terminating it", p.name)
            p.terminate()
            p.join(timeout=5)


def stop_workers(tp: TensorParallel, procs: list[mp.process.BaseProcess]) -> None:
    """Tell the workers to exit (driver side), leave the group and wait for them; when one has already exited the
    group is broken, and the others are terminated instead."""
    if not tp.enabled:
        return
    alive = [p for p in procs if p.is_alive()]
    try:
        if len(alive) == len(procs):
            tp.broadcast(None)
        else:
            for p in alive:
                p.terminate()
        dist.destroy_process_group()
    except Exception:  # the group may already be broken; the processes are still reaped below
        log.exception("stopping tensor-parallel workers")
    _reap(procs)
