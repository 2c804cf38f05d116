"""LoRA adapters served beside the base model (vLLM's ``--enable-lora --lora-modules name=path``).

An adapter is a PEFT folder: ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``) and
``adapter_model.safetensors`` (or ``.bin``) with ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` per target
projection. Ember applies LoRA to the attention projections (``q/k/v/o_proj``) and the dense MLP's
(``gate/up/down_proj``); an adapter that targets anything else (embeddings, the LM head, MoE experts), trains extra
modules (``modules_to_save``), biases, DoRA or activated LoRA is refused by name rather than served partly.

Every adapter lives on the device in its own slot, and one batch mixes any of them with base-model requests: each
wrapped projection adds ``(x[rows] @ A_s^T) @ B_s^T`` for the token rows of the sequences using slot ``s``
(`LoRARows`, set by the model runner each step from host-side data, so grouping never reads the device). Fused
projections (``qkv_proj``, ``gate_up_proj``) hold their parts' ``A`` stacked and ``B`` block-diagonal, so one pair
of matmuls serves all parts (an adapter of the fused projection itself, as Phi-3's checkpoints have it, has one ``A``
and a ``B`` over all the parts' rows: each part gets that ``A`` and its rows of ``B``); the scaling (``alpha / r``, or
``alpha / sqrt(r)`` with rsLoRA) is folded into ``B``.
Under tensor parallelism each rank holds its share of the adapter (`COLUMN_PARALLEL`), and the step's rows reach
every rank in `AttentionMetadata.lora_rows`. A decode step a CUDA graph replays uses the static-shape form instead:
every slot's update over the whole batch, masked to that slot's rows (`LoRARows.masks`).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ember.engine.checkpoint import CheckpointError, read_json
from ember.engine.config import ConfigError
from ember.engine.client import UnknownAdapterError
from ember.engine.nvfp4_loading import fused_target

PREFIX = "base_model.model."


@dataclass
class Adapter:
    """One adapter read from disk: per Ember projection, ``(part, A [r, in], B * scaling [out_part, r])``."""

    name: str
    path: str
    rank: int
    weights: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


_PEFT_DEFAULT_ALPHA = 8
"""peft's `LoraConfig.lora_alpha` default: what a config that leaves the field out was trained with."""


def _read_config(folder: Path, name: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from ``adapter_config.json``; ConfigError naming the field Ember cannot serve."""
    path = folder / "adapter_config.json"
    try:
        cfg = read_json(path)
    except CheckpointError as e:
        raise ConfigError(f"LoRA adapter {name!r}: {e} (a PEFT adapter folder is expected)") from None
    where = f"LoRA adapter {name!r} ({path})"
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: the file must hold a JSON object, not {type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ConfigError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "fully trained modules (modules_to_save)"),
                      ("rank_pattern", "per-module ranks (rank_pattern)"),
                      ("alpha_pattern", "per-module alphas (alpha_pattern)"), ("fan_in_fan_out", "fan_in_fan_out"),
                      ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)"),
                      ("arrow_config", "Arrow routing (arrow_config)"), ("layer_replication", "layer_replication"),
                      ("target_parameters", "LoRA on parameters (target_parameters)")):
        if cfg.get(key):
            raise ConfigError(f"{where}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ConfigError(f"{where}: bias {cfg['bias']!r} is not supported (only 'none')")
    alpha = cfg.get("lora_alpha", _PEFT_DEFAULT_ALPHA)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ConfigError(f"{where}: lora_alpha must be a finite number, got {alpha!r}")
    return rank, alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)


def _read_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors; ConfigError naming the file when it cannot be read (a Git LFS pointer, a truncated
    download, not a tensor file)."""
    st, pt = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if not st.exists() and not pt.exists():
        raise ConfigError(f"LoRA adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {folder}")
    path = st if st.exists() else pt
    try:
        tensors = load_file(str(st)) if path is st else torch.load(str(pt), map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors and torch raise their own types for a malformed file
        raise ConfigError(f"LoRA adapter {name!r}: {path} cannot be read ({type(e).__name__}: {e}); a Git LFS "
                          f"pointer or a partial download looks like this") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ConfigError(f"LoRA adapter {name!r}: {path} does not hold a mapping of tensors")
    return tensors


COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
"""Projections whose output rows a tensor-parallel rank holds a contiguous share of (their ``lora_B`` rows split);
``o_proj`` and ``down_proj`` hold a share of their input columns (their ``lora_A`` columns split, and the partial
updates are summed by the layer's all-reduce with the rest of the output)."""


def _rank_share(a: torch.Tensor, b: torch.Tensor, column: bool, shard: tuple[int, int],
                where: str) -> tuple[torch.Tensor, torch.Tensor]:
    rank, world = shard
    if world == 1:
        return a, b
    t, dim = (b, 0) if column else (a, 1)
    if t.shape[dim] % world:
        raise ConfigError(f"{where}: tensor_parallel_size {world} does not divide its {t.shape[dim]} "
                          f"{'output rows' if dim == 0 else 'input columns'}")
    piece = t.chunk(world, dim)[rank]
    return (a, piece) if dim == 0 else (piece, b)


def _parts(a: torch.Tensor, b: torch.Tensor, part: int, whole: bool, column: bool, wrapped: "LoRALinear",
           rank: int, shard: tuple[int, int], where: str) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(part, A, B)`` of one adapted checkpoint projection on this rank (``column``: its output rows are split
    across ranks): ``part`` of ``wrapped`` alone, or, for the fused projection itself (``whole``), every part with
    the same ``A`` and its rows of ``B``; ConfigError naming the shapes this model needs otherwise."""
    if whole and len(wrapped.part_sizes) > 1:
        rows = [n * shard[1] for n in wrapped.part_sizes]
        _check_pair(a, b, rank, wrapped.in_features, sum(rows), where,
                    f" (its parts' {' + '.join(map(str, rows))} rows)")
        pieces, column = [(i, a, piece) for i, piece in enumerate(b.split(rows))], True
    else:
        pieces = [(part, a, b)]
    out = []
    for i, a, b in pieces:
        a, b = _rank_share(a, b, column, shard, where)
        _check_pair(a, b, rank, wrapped.in_features, wrapped.part_sizes[i], where)
        out.append((i, a, b))
    return out


def _check_pair(a: torch.Tensor, b: torch.Tensor, rank: int, in_features: int, rows: int, where: str,
                detail: str = "") -> None:
    """ConfigError naming the shapes this model needs unless ``a`` is [rank, in_features] and ``b`` [rows, rank]."""
    if a.ndim != 2 or b.ndim != 2 or a.shape != (rank, in_features) or b.shape != (rows, rank):
        raise ConfigError(f"{where} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this model needs "
                          f"({rank}, {in_features}) and ({rows}, {rank}){detail}")


def read_adapter(name: str, path: str, model: nn.Module, targets: dict[str, "LoRALinear"],
                 max_rank: int, shard: tuple[int, int] = (0, 1)) -> Adapter:
    """Adapter ``name`` from the PEFT folder ``path``, its tensors mapped onto ``model``'s projections (``targets``:
    the wrapped ones by module name), this tensor-parallel rank's share of them when ``shard`` is ``(rank, world)``;
    ConfigError naming the file, tensor or field that cannot be served."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"LoRA adapter {name!r}: {folder} is not a directory")
    rank, scaling = _read_config(folder, name, max_rank)
    tensors = _read_tensors(folder, name)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, _, kind = key.removeprefix(PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ConfigError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A / lora_B weight (embedding "
                              f"adapters, biases and trained modules are not supported)")
        pairs.setdefault(module, {})[kind[0]] = t
    adapter = Adapter(name, str(folder), rank)
    filled: set[tuple[str, int]] = set()
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ConfigError(f"LoRA adapter {name!r}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        ember = model.checkpoint_name(module + ".weight")
        own = ember.removesuffix(".weight") if ember else module
        target, part = fused_target(own) if ember else (module, 0)
        wrapped = targets.get(target)
        if wrapped is None:
            raise ConfigError(f"LoRA adapter {name!r}: it targets {module}, which Ember does not apply LoRA to "
                              f"(on this model: {_target_kinds(targets)})")
        where = f"LoRA adapter {name!r}: {module}"
        column = module.rpartition(".")[2] in COLUMN_PARALLEL
        for part, a, b in _parts(ab["A"], ab["B"], part, target == own, column, wrapped, rank, shard, where):
            if (target, part) in filled:
                raise ConfigError(f"{where} adapts part {part} of {target}, which another of its tensors adapts too")
            filled.add((target, part))
            adapter.weights.setdefault(target, []).append((part, a.float(), b.float() * scaling))
    if not adapter.weights:
        raise ConfigError(f"LoRA adapter {name!r}: {folder} holds no lora_A / lora_B weights")
    return adapter


@dataclass
class LoRARows:
    """Which token rows each adapter slot updates this step, shared by every `LoRALinear` of one model: ``groups``
    (``(slot, rows)``, ``rows`` a device index tensor; empty when no sequence uses an adapter) for an eager step, or,
    for a decode step a CUDA graph may replay, ``masks`` ``[slots, T, 1]`` (1 where the row's sequence uses the
    slot), computed on the device from the step's per-row slots so every shape is static."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    masks: torch.Tensor | None = None

    def use_slots(self, row_slots: torch.Tensor, slots: int, dtype: torch.dtype) -> None:
        """Switch to the masked form for the rows' slots (int64 ``[T]``, -1: none)."""
        wanted = torch.arange(slots, device=row_slots.device)
        self.masks = (row_slots.unsqueeze(0) == wanted.unsqueeze(1)).to(dtype).unsqueeze(-1)
        self.groups = []

    def use_groups(self, groups: list[tuple[int, torch.Tensor]] | None) -> None:
        self.groups, self.masks = groups or [], None


class LoRALinear(nn.Module):
    """A projection plus the low-rank update of each adapter slot, applied to that slot's rows only."""

    def __init__(self, base: nn.Module, in_features: int, part_sizes: list[int], slots: int, rank: int,
                 rows: LoRARows, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.part_sizes, self.rank, self.rows = in_features, part_sizes, rank, rows
        width = len(part_sizes) * rank
        self.register_buffer("lora_a", torch.zeros(slots, width, in_features, device=device, dtype=dtype),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots, sum(part_sizes), width, device=device, dtype=dtype),
                             persistent=False)

    def load(self, slot: int, parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Fill ``slot`` with an adapter's parts (zeros where it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for part, a, b in parts:
            r, lo = a.shape[0], sum(self.part_sizes[:part])
            cols = slice(part * self.rank, part * self.rank + r)
            self.lora_a[slot, cols] = a.to(self.lora_a.dtype)
            self.lora_b[slot, lo:lo + self.part_sizes[part], cols] = b.to(self.lora_b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # a fresh tensor: the updates land in it in place
        masks = self.rows.masks
        if masks is not None:  # static shapes (a decode graph): every slot, rows of other slots masked to zero
            for slot in range(masks.shape[0]):
                y.add_(((x @ self.lora_a[slot].T) * masks[slot]) @ self.lora_b[slot].T)
            return y
        for slot, rows in self.rows.groups:
            y.index_add_(0, rows, (x[rows] @ self.lora_a[slot].T) @ self.lora_b[slot].T)
        return y


_KINDS = {"qkv_proj": "attention q/k/v", "o_proj": "attention o", "gate_up_proj": "MLP gate/up",
          "down_proj": "MLP down"}


def _target_kinds(targets: dict[str, "LoRALinear"]) -> str:
    """The projections ``targets`` offers adapters, in words (a hybrid model's own attention layers have none)."""
    kinds = {name.rpartition(".")[2] for name in targets}
    named = [words for kind, words in _KINDS.items() if kind in kinds]
    return (", ".join(named) + " projections only") if named else "no projection"


def _projections(model: nn.Module) -> dict[str, tuple[nn.Module, int, list[int]]]:
    """Every projection LoRA may target: name -> (module, input width, output parts)."""
    from ember.engine.models.layers import Attention, GatedMLP

    hidden = model.config.hidden_size
    found: dict[str, tuple[nn.Module, int, list[int]]] = {}
    for name, m in model.named_modules():
        if type(m) is Attention:  # subclasses (Qwen3-Next's gated q) lay their projections out differently
            q, kv = m.hq * m.d, m.hkv * m.d
            found[f"{name}.qkv_proj"] = (m.qkv_proj, hidden, [q, kv, kv])
            found[f"{name}.o_proj"] = (m.o_proj, q, [hidden])
        elif isinstance(m, GatedMLP):
            found[f"{name}.gate_up_proj"] = (m.gate_up_proj, hidden, [m.inter, m.inter])
            found[f"{name}.down_proj"] = (m.down_proj, m.inter, [hidden])
    return found


class LoRAStack:
    """The adapters an engine serves: wraps the model's projections once, then loads adapters into slots."""

    def __init__(self, model: nn.Module, slots: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype, shard: tuple[int, int] = (0, 1)) -> None:
        self.model, self.slots, self.max_rank, self.device, self.shard = model, slots, max_rank, device, shard
        self.rows = LoRARows()
        self.targets: dict[str, LoRALinear] = {}
        for name, (module, width, parts) in _projections(model).items():
            wrapped = LoRALinear(module, width, parts, slots, max_rank, self.rows, device, dtype)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, wrapped)
            self.targets[name] = wrapped
        if not self.targets:
            raise ConfigError(f"{type(model).__name__} has no projection Ember applies LoRA to")
        self.adapters: dict[str, tuple[int, str]] = {}  # name -> (slot, folder); the weights live in the slots
        self._roots: dict[str, bytes] = {}
        self._loads = 0

    def add(self, name: str, path: str, replace: bool = False) -> int:
        """Load adapter ``name`` from ``path`` into a free slot, or with ``replace`` into the slot of the adapter
        loaded under that name (vLLM's ``load_inplace``); its slot. The folder is read and checked before any slot
        changes, so an adapter that cannot be served leaves the ones served as they were."""
        slot = self.slot(name) if replace else None
        if not replace and name in self.adapters:
            raise ConfigError(f"LoRA adapter {name!r} is already loaded")
        adapter = read_adapter(name, path, self.model, self.targets, self.max_rank, self.shard)  # a bad path first
        if slot is None:
            used = {s for s, _ in self.adapters.values()}
            slot = next((s for s in range(self.slots) if s not in used), None)
            if slot is None:
                raise ConfigError(f"LoRA adapter {name!r}: all {self.slots} adapter slots are in use (--max-loras)")
        for target, wrapped in self.targets.items():
            wrapped.load(slot, adapter.weights.get(target, []))
        self.adapters[name] = (slot, adapter.path)
        self._loads += 1
        self._roots[name] = hashlib.sha256(f"ember-lora\0{self._loads}\0{name}".encode()).digest()
        return slot

    def remove(self, name: str) -> None:
        """Forget adapter ``name`` (its slot is reused by the next load)."""
        self.slot(name)
        del self.adapters[name], self._roots[name]

    def listed(self) -> tuple[tuple[str, str], ...]:
        """(name, folder) of every loaded adapter, in load order."""
        return tuple((name, path) for name, (_, path) in self.adapters.items())

    def slot(self, name: str) -> int:
        """The slot of a loaded adapter; `UnknownAdapterError` naming the adapters that are loaded otherwise."""
        if name not in self.adapters:
            raise UnknownAdapterError(name, list(self.adapters))
        return self.adapters[name][0]

    def cache_root(self, name: str) -> bytes:
        """The prefix-cache root of the sequences under a loaded adapter: KV computed under one adapter is never
        reused by another, by the base model, or by an adapter loaded later under the same name."""
        return self._roots[name]

    def group_rows(self, slots: list[int], counts: list[int]) -> list[tuple[int, torch.Tensor]]:
        """This step's token rows by slot (for `LoRARows.groups`): the i-th scheduled chunk has ``counts[i]`` rows
        and uses ``slots[i]`` (-1: the base model)."""
        by_slot: dict[int, list[int]] = {}
        row = 0
        for s, n in zip(slots, counts):
            if s >= 0:
                by_slot.setdefault(s, []).extend(range(row, row + n))
            row += n
        return [(s, torch.tensor(r, dtype=torch.int64).to(self.device, non_blocking=True))
                for s, r in by_slot.items()]

    def row_slots(self, slots: list[int]) -> torch.Tensor:
        """int64 ``[n]`` on the device: the slot of each row of a decode step (one row per sequence)."""
        return torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
