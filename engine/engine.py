"""The synchronous engine: add requests (token IDs + SamplingParams), step, get each request's new tokens.

One `step()` = schedule -> one forward over every scheduled chunk -> sample -> stop checks. Text never enters here:
the output pipeline decodes and may end a request early through `abort`. With ``async_scheduling`` a step may be
launched before the previous one's tokens are read; their stop checks and outputs then come in the next `step()`
(`ember.engine.overlap`).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator

import torch

from ember.engine import checkpoint, fp8_loading, loader, pooling
from ember.engine.args import FIT_MAX_MODEL_LEN
from ember.engine.config import (ConfigError, EngineConfig, ModelConfig, SettingError, kv_cache_torch_dtype,
                                 parse_dtype)
from ember.engine.constraint import BitmaskFiller, Constraint
from ember.engine.eos import end_of_turn_ids
from ember.engine.kv_cache import ROOT_HASH, KVCacheManager, salted_root
from ember.engine.lora import LoRAStack
from ember.engine.model_runner import ModelRunner, kv_bytes_per_block
from ember.engine.models import classifier, get_model_class
from ember.engine.models.layers import RotaryEmbedding
from ember.engine.overlap import InFlightStep, carried_tokens, defer_blocker, reads_before_sampling, still_running
from ember.engine.params import FinishReason, RequestOutput, SamplingParams
from ember.engine.prompt_logprobs import score_rows
from ember.engine.sampler import Sampler, SamplerOutput, validate_params
from ember.engine.scheduler import Scheduler, SchedulerOutput
from ember.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from ember.engine.speculative import Drafter, NgramIndex, parse_speculative_config, speculates
from ember.engine.state_snapshots import StateSnapshots

log = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hit_rate: float
    prefix_cache_hits: int
    prefix_cache_queries: int
    num_preemptions: int
    last_batch_size: int
    num_steps: int = 0  # steps that ran a forward
    step_ms: float = 0.0  # mean wall time of the recent steps (set by the loop that drives the engine)
    spec_draft_tokens: int = 0  # speculative tokens computed (`ember.engine.speculative`)
    spec_accepted_tokens: int = 0  # of those, the ones kept
    spec_drafts: int = 0  # speculative chunks verified
    spec_accepted_per_pos: tuple[int, ...] = ()  # kept drafts by their position in the chunk (0: the first draft)
    max_loras: int = 0  # LoRA adapter slots (0: the engine serves no adapters)
    running_lora_adapters: tuple[str, ...] = ()  # the adapters the running sequences use, sorted
    waiting_lora_adapters: tuple[str, ...] = ()  # the adapters the waiting sequences use, sorted


def _adapters(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The LoRA adapters ``seqs`` run under, sorted by name."""
    return tuple(sorted({s.params.lora for s in seqs if s.params.lora is not None}))


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def _skip_init(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in ``dtype`` and skip the random initialisation the checkpoint overwrites."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    saved_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)
        torch.set_default_dtype(saved_dtype)


def load_model(model_dir: str | os.PathLike, cfg: ModelConfig, max_position: int, device: torch.device,
               dtype: torch.dtype, weights: Iterable[tuple[str, torch.Tensor]] | None = None,
               model_class: type | None = None, quantization: str | None = None,
               tokenizer_dir: str | os.PathLike | None = None):
    """Instantiate the architecture named in config.json (or ``model_class``) on ``device`` and fill it from the
    safetensors files (or ``weights``, e.g. one tensor-parallel rank's slices); ``quantization="fp8"`` quantizes an
    unquantized checkpoint's projections to FP8 as they load. ``tokenizer_dir`` (default: ``model_dir``) resolves
    the tokens of a classifier made from LM-head rows."""
    cls = model_class or get_model_class(cfg.architecture,
                                         source=str(loader.checkpoint_dir(model_dir) / "config.json"))
    with torch.device("meta"), _skip_init(dtype):  # allocated on `device` once the loader knows what is packed
        model = cls(cfg, max_position)
        if classifier.causal_architecture(cfg.architecture) and not cfg.is_encoder:
            classifier.attach_head(model, cfg)
    model = model.to(dtype)
    model.load_device = device
    weights = loader.iter_weights(model_dir) if weights is None else weights
    keep = getattr(model, "keeps_fp8", None)  # FP8 modules the model runs packed (decided as it starts loading)
    if hasattr(weights, "shard_shape"):  # one tensor-parallel rank's slices (`distributed.ShardedWeights`)
        model.shard_shape = weights.shard_shape
        weights.keep_fp8 = keep
    fmt = fp8_loading.resolve_format(cfg.raw, loader.checkpoint_dir(model_dir), quantization)
    model.fp8 = fmt
    # the modules that can stay FP8, read once from the headers for every layer kind that may keep them packed
    model.fp8_candidates = fp8_loading.packed_candidates(loader.weight_files(model_dir), fmt) if fmt else {}
    if fmt is not None:
        weights = fp8_loading.dequantized(weights, fmt, str(model_dir), keep)
    stream = model.renamed(weights)  # under the model's own names
    head = classifier.token_head(cfg)
    if head is not None:  # a causal LM served as a classifier: its score head comes from LM-head rows
        score = classifier.converted_head_weight(model, loader.weight_files(model_dir), tokenizer_dir or model_dir,
                                                 head)
        stream = itertools.chain(stream, [("score.weight", score)])
    model.load_weights(stream, source=str(model_dir))
    for m in model.modules():  # the model's RoPE tables (Gemma 3 has a local and a global one)
        if isinstance(m, RotaryEmbedding):
            m.build_cache(device, dtype)
    return model.eval()


class Engine:
    """Continuous-batching inference over a paged KV cache."""

    def __init__(self, model_dir: str | os.PathLike, config: EngineConfig,
                 bitmask_filler: BitmaskFiller | None = None) -> None:
        self.model_dir = loader.checkpoint_dir(model_dir)
        self.config = config
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.model_config = loader.load_model_config(self.model_dir, config.hf_overrides)
        self.tokenizer_dir = checkpoint.tokenizer_dir(self.model_dir, config.tokenizer)
        self.tokenizer = loader.load_tokenizer(self.tokenizer_dir)
        self.eos_token_ids: set[int] = set(end_of_turn_ids(self.tokenizer, self.model_dir))
        mc = self.model_config
        self.device = torch.device(config.device) if config.device is not None else _default_device()
        self.dtype = config.dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        if config.max_model_len is not None and config.max_model_len > mc.max_context:
            yarn = " (YaRN's pretrained length times its factor)" if mc.max_context > mc.max_position_embeddings else ""
            raise SettingError("--max-model-len", f"max_model_len {config.max_model_len} exceeds the model's context "
                               f"of {mc.max_context} tokens{yarn} in {self.model_dir / 'config.json'}")
        self.fit_max_model_len = config.max_model_len == FIT_MAX_MODEL_LEN
        """vLLM's ``max_model_len`` auto (-1): the model's length, cut to what the KV cache holds once it is sized."""
        self.max_model_len = mc.max_context if self.fit_max_model_len else config.max_model_len or mc.max_context
        self.vocab_size = mc.vocab_size
        self.speculative = parse_speculative_config(config.speculative_config) if config.speculative_config else None
        if self.speculative is not None and mc.linear_attention_layers:
            raise SettingError("--speculative-config", f"{mc.architecture} keeps recurrent state, which cannot undo "
                               f"rejected speculative tokens: serve it without speculative_config")
        self.spec_draft_tokens = self.spec_accepted_tokens = self.spec_drafts = 0
        self.spec_accepted_per_pos = [0] * (self.speculative.num_speculative_tokens if self.speculative else 0)
        if mc.is_encoder and (config.tensor_parallel_size != 1 or config.lora_modules or config.enable_lora):
            raise ConfigError(f"{mc.architecture} is an encoder: Ember serves it in one process without LoRA "
                              f"adapters (tensor_parallel_size 1, no lora_modules)")
        if config.tensor_parallel_size != 1:
            from ember.engine import distributed

            if config.tensor_parallel_size < 1:
                raise ValueError(f"tensor_parallel_size must be >= 1, got {config.tensor_parallel_size}")
            self.runner = distributed.start_driver(self.model_dir, mc, config, self.max_model_len, self.device,
                                                   self.dtype, self.kv_cache_dtype)
        else:
            model = load_model(self.model_dir, mc, self.max_model_len, self.device, self.dtype,
                               quantization=config.quantization, tokenizer_dir=self.tokenizer_dir)
            if mc.is_encoder:  # BERT's token types are read at the tokenizer's separator
                model.sep_token_id = self.tokenizer.sep_token_id
            self.runner = ModelRunner(model, mc, config.block_size, self.device, self.dtype,
                                      kv_cache_dtype=self.kv_cache_dtype)
        try:
            if config.lora_modules or config.enable_lora:
                self.runner.enable_lora(max(config.max_loras, len(config.lora_modules)), config.max_lora_rank)
                for name, path in config.lora_modules:
                    self.runner.load_lora(name, path)
            self.cuda_graphs = self._use_cuda_graphs()
            snapshots = self._num_state_snapshots()
            self.runner.allocate_recurrent_state(config.max_num_seqs, snapshots)
            num_blocks = self._num_kv_blocks()
            if self.fit_max_model_len:
                self._fit_max_model_len(num_blocks)
            self.runner.allocate_kv_cache(num_blocks)
            if self.cuda_graphs:
                self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        except BaseException:
            self.runner.shutdown()
            raise
        # a hybrid model without saved states cannot resume from cached KV blocks
        prefix_caching = config.enable_prefix_caching and (snapshots > 0 or not mc.linear_attention_layers)
        # an encoder computes each prompt whole, in one step: never chunked, never resumed from cached blocks
        prefix_caching = prefix_caching and not mc.is_encoder
        step_tokens = max(config.max_num_batched_tokens, self.max_model_len) if mc.is_encoder else \
            config.max_num_batched_tokens
        self.kv = KVCacheManager(num_blocks, config.block_size, prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, step_tokens, self.max_model_len,
                                   enable_chunked_prefill=config.enable_chunked_prefill and not mc.is_encoder,
                                   policy=config.scheduling_policy,
                                   snapshots=StateSnapshots(self.runner.first_snapshot_slot, snapshots)
                                   if snapshots else None)
        self.sampler = Sampler(self.vocab_size, self.device, bitmask_filler)
        self.score_head: torch.nn.Module | None = getattr(getattr(self.runner, "model", None), "score", None)
        """A classifier's head (`ember.engine.models.classifier`): its pooling requests end in logits."""
        self._pending: list[RequestOutput] = []
        self._inflight: InFlightStep | None = None
        """The last step, launched but not read yet (asynchronous scheduling)."""
        self.async_scheduling = config.async_scheduling and self.scheduler.snapshots is None
        """Steps may run ahead of their tokens; not with recurrent-state snapshots, which key a state by the
        tokens of the block it ends."""
        if config.async_scheduling and not self.async_scheduling:
            log.info("async scheduling is off: the recurrent-state snapshots of prefix caching key each state by "
                     "tokens a step would still hold on the device (serve with --state-snapshots 0 to overlap)")
        self.num_deferred_steps = 0
        """Steps launched before the previous one's tokens were read."""
        self.last_batch_size = 0
        self.num_steps = 0

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, *, max_num_seqs: int = 64,
                        max_num_batched_tokens: int = 2048, max_model_len: int | None = None, block_size: int = 16,
                        num_kv_blocks: int | None = None, kv_cache_memory: int | None = None,
                        enable_prefix_caching: bool = True, dtype: str | torch.dtype | None = None,
                        device: str | torch.device | None = None, bitmask_filler: BitmaskFiller | None = None,
                        enable_chunked_prefill: bool = True, gpu_memory_utilization: float = 0.9,
                        tensor_parallel_size: int = 1, enforce_eager: bool = False, async_scheduling: bool = False,
                        kv_cache_dtype: str = "auto", state_snapshots: int | None = None,
                        quantization: str | None = None, hf_overrides: dict[str, Any] | None = None,
                        lora_modules: tuple[tuple[str, str], ...] = (), max_loras: int = 1,
                        max_lora_rank: int = 16, enable_lora: bool = False, seed: int | None = None,
                        tokenizer: str | None = None, max_logprobs: int = 20,
                        scheduling_policy: str = "fcfs",
                        speculative_config: dict[str, Any] | None = None) -> "Engine":
        config = EngineConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            block_size=block_size, num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill, dtype=parse_dtype(dtype),
            device=torch.device(device) if device is not None else None, tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager, async_scheduling=async_scheduling, kv_cache_dtype=kv_cache_dtype,
            state_snapshots=state_snapshots,
            quantization=quantization, hf_overrides=hf_overrides, lora_modules=tuple(lora_modules),
            max_loras=max_loras, max_lora_rank=max_lora_rank, enable_lora=enable_lora, seed=seed, tokenizer=tokenizer,
            max_logprobs=max_logprobs, scheduling_policy=scheduling_policy, speculative_config=speculative_config,
        )
        return cls(model_dir, config, bitmask_filler)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do for one process); the engine cannot step afterwards."""
        self.runner.shutdown()

    def _num_state_snapshots(self) -> int:
        """Saved recurrent states for prefix caching: 0 unless the model has linear-attention layers and prefix
        caching is on (then ``state_snapshots``, default ``max_num_seqs``; 0 turns prefix caching off)."""
        c = self.config
        if not self.model_config.linear_attention_layers or not c.enable_prefix_caching:
            return 0
        n = c.max_num_seqs if c.state_snapshots is None else c.state_snapshots
        if n < 0:
            raise ValueError(f"state_snapshots must be >= 0, got {n}")
        return n

    def _use_cuda_graphs(self) -> bool:
        """Capture decode graphs unless ``enforce_eager`` or the runner cannot (e.g. on a CPU; logged on CUDA)."""
        if self.config.enforce_eager:
            return False
        reason = self.runner.graph_blocker()
        if reason is not None and self.device.type == "cuda":
            log.info("CUDA graphs off (decoding eagerly): %s", reason)
        return reason is None

    def _num_kv_blocks(self) -> int:
        c = self.config
        per_block = kv_bytes_per_block(self.runner.cfg, c.block_size, self.kv_cache_dtype)  # this rank's KV heads
        if c.num_kv_blocks is not None:
            if c.num_kv_blocks < 1:
                raise ValueError(f"num_kv_blocks must be >= 1, got {c.num_kv_blocks}")
            self._check_fits("--kv-cache-blocks", c.num_kv_blocks * per_block)
            return c.num_kv_blocks
        one_seq = -(-self.max_model_len // c.block_size)
        if per_block == 0:  # an encoder keeps no KV: its blocks only count positions for the scheduler
            return c.max_num_seqs * one_seq
        if c.kv_cache_memory is not None:
            n = c.kv_cache_memory // per_block
            if n < 1:
                raise SettingError("--kv-cache-memory", f"kv_cache_memory={c.kv_cache_memory} bytes holds no KV block "
                                   f"({per_block} bytes each)")
            self._check_fits("--kv-cache-memory", n * per_block)
            return int(n)
        if self.device.type == "cuda":
            if not 0.0 < c.gpu_memory_utilization <= 1.0:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")
            act = self.runner.profile_activation_bytes(min(c.max_num_batched_tokens, self.max_model_len),
                                                       c.max_num_seqs)
            if self.cuda_graphs:  # the graphs' private pool (captured after the KV cache) is held beside it
                act += self.runner.profile_activation_bytes(min(c.max_num_seqs, self.max_model_len), c.max_num_seqs)
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * c.gpu_memory_utilization) - (total - free) - act
            n = budget // per_block
            if n < (1 if self.fit_max_model_len else one_seq):
                raise RuntimeError(f"KV cache budget {budget} bytes holds {max(n, 0)} blocks; one "
                                   f"{self.max_model_len}-token sequence needs {one_seq}: raise "
                                   f"gpu_memory_utilization, lower max_model_len or set it to auto (-1) to fit")
            log.info("KV cache: %d blocks (%.2f GiB), activations %.2f GiB", n, n * per_block / 2**30, act / 2**30)
            return int(n)
        wanted = c.max_num_seqs * one_seq
        n = int(max(1 if self.fit_max_model_len else one_seq, min(wanted, _CPU_DEFAULT_KV_BYTES // per_block)))
        if n * per_block > _CPU_DEFAULT_KV_BYTES:
            log.warning("KV cache: one %d-token sequence needs %.2f GiB; pass max_model_len or kv_cache_memory "
                        "to use less", self.max_model_len, n * per_block / 2**30)
        return n

    def _check_fits(self, flag: str, kv_bytes: int) -> None:
        """SettingError naming ``flag`` where a KV cache asked for by size exceeds the device's whole memory (it could
        never be allocated; torch would fail in its own words, or overflow)."""
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if kv_bytes > total:
            raise SettingError(flag, f"a KV cache of {kv_bytes / 2**30:.4g} GiB exceeds the {total / 2**30:.4g} GiB "
                               f"of {self.device.type} memory")

    def _fit_max_model_len(self, num_blocks: int) -> None:
        """vLLM's auto-fit: ``max_model_len`` cut to the tokens ``num_blocks`` KV blocks hold (the longest sequence
        the cache can take), where that is shorter than the model's length; logged either way."""
        tokens = num_blocks * self.config.block_size
        if tokens >= self.max_model_len:
            log.info("max_model_len auto: the model's full length %d fits in the KV cache", self.max_model_len)
            return
        log.info("max_model_len auto: reduced from %d to %d to fit in the KV cache (%d blocks of %d tokens)",
                 self.max_model_len, tokens, num_blocks, self.config.block_size)
        self.max_model_len = tokens

    # ---- requests ----------------------------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, constraint: Constraint | None = None) -> str:
        """Queue a request; ValueError (naming the problem) when it is invalid or can never fit."""
        params = params if params is not None else SamplingParams()
        validate_params(params, self.vocab_size, self.config.max_logprobs)
        ids = [int(t) for t in prompt_ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if self.model_config.is_encoder and params.pooling is None:
            raise ValueError(f"this model is an encoder ({self.model_config.architecture}): it embeds and scores "
                             f"prompts and does not generate")
        if self.score_head is not None and params.pooling is None:
            raise ValueError(f"this model is a classifier ({self.model_config.architecture}): it scores prompts "
                             f"(/classify, /score, /rerank) and does not generate")
        if len(ids) >= self.max_model_len + (params.pooling is not None):  # a pooled prompt needs no room after it
            raise ValueError(f"the prompt has {len(ids)} tokens; the maximum model length is {self.max_model_len}, "
                             f"which leaves no room for output")
        seq = Sequence(request_id if request_id is not None else uuid.uuid4().hex, ids, params, constraint=constraint)
        if params.lora is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {params.lora!r} requested, but this engine serves no adapters")
            seq.lora_slot = self.lora.slot(params.lora)
            seq.cache_root = self.lora.cache_root(params.lora)
        if params.cache_salt:
            seq.cache_root = salted_root(seq.cache_root or ROOT_HASH, params.cache_salt)
        if self.speculative is not None and speculates(params, constraint):
            spec = self.speculative
            seq.drafter = Drafter(NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max),
                                  spec.num_speculative_tokens)
        self.scheduler.add(seq)
        return seq.request_id

    @property
    def lora(self) -> LoRAStack | None:
        """The adapters this engine serves (rank 0's under tensor parallelism), None without LoRA support."""
        return self.runner.lora

    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Serve one more LoRA adapter (vLLM's runtime loading), or with ``replace`` new weights under a loaded
        adapter's name (refused while a request runs under it; weights that cannot be served leave the old ones);
        ValueError naming why it cannot be."""
        if self.lora is None:
            raise ValueError("this engine was started without LoRA support (start it with --enable-lora)")
        if replace:
            self._check_unused(name)
        self.runner.load_lora(name, path, replace)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``; ValueError while a request still runs under it."""
        if self.lora is None:
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: none)")
        self._check_unused(name)
        self.runner.unload_lora(name)

    def _check_unused(self, name: str) -> None:
        slot = self.lora.slot(name)
        users = sum(1 for s in [*self.scheduler.running, *self.scheduler.waiting] if s.lora_slot == slot)
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s); retry once they end")

    def abort(self, request_id: str) -> bool:
        """End the request now and free its blocks; its final output (finish_reason "abort") comes with the next
        `step()`. False when the request is not in the engine."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self.sampler.forget(request_id)
        self._pending.append(self._output(seq, [], None, finished=True, reason="abort"))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def stats(self) -> EngineStats:
        q = self.kv.prefix_queries
        lora = self.lora
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_usage=self.kv.usage(), num_free_blocks=self.kv.num_free_blocks, num_total_blocks=self.kv.num_blocks,
            prefix_cache_hit_rate=(self.kv.prefix_hits / q) if q else 0.0, prefix_cache_hits=self.kv.prefix_hits,
            prefix_cache_queries=q, num_preemptions=self.scheduler.num_preemptions,
            last_batch_size=self.last_batch_size, num_steps=self.num_steps,
            spec_draft_tokens=self.spec_draft_tokens, spec_accepted_tokens=self.spec_accepted_tokens,
            spec_drafts=self.spec_drafts, spec_accepted_per_pos=tuple(self.spec_accepted_per_pos),
            max_loras=lora.slots if lora is not None else 0,
            running_lora_adapters=_adapters(self.scheduler.running) if lora is not None else (),
            waiting_lora_adapters=_adapters(self.scheduler.waiting) if lora is not None else (),
        )

    # ---- steps -------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; outputs for every request that got a token or finished."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self._inflight is not None:
                outputs.extend(self._resolve())
            return outputs
        self.num_steps += 1
        now = time.monotonic()
        for chunk in sched.chunks:
            if chunk.seq.scheduled_at is None:
                chunk.seq.scheduled_at = now
        try:
            outputs.extend(self._run(sched))
        except Exception as e:  # a failed forward ends the requests it carried, never the engine
            log.exception("engine step failed")
            msg = f"engine step failed: {type(e).__name__}: {e}"
            unread = self._inflight.chunks if self._inflight is not None else []
            self._inflight = None
            self._drop_unsaved_states()
            for chunk in [*unread, *sched.chunks]:
                seq = chunk.seq
                if seq.status is not SequenceStatus.FINISHED:
                    outputs.append(self._finish(seq, [], None, "error", error=msg))
        return outputs

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        logits = self.runner.execute(sched, carried_tokens(sched, self._inflight))
        self.last_batch_size = self.runner.last_batch_size
        chunks = [c for c in sched.chunks if c.samples]
        outputs: list[RequestOutput] = []
        scores = self.runner.scoring_hidden is not None
        if scores:
            self._keep_rows(sched)
        if not chunks:
            if self._inflight is not None:
                outputs = self._resolve()
            self.scheduler.update(sched, {})
            return self._finish_pooled(sched, outputs)
        if reads_before_sampling(chunks, self._inflight):
            # a grammar masks this step's row from its state after the previous step's token, bad words ban from the
            # tokens: read that step now (this step's forward is already queued); what the read ends does not sample
            outputs = self._resolve()
            chunks, logits = still_running(chunks, logits)
            if not chunks:
                self.scheduler.update(sched, {})
                return self._finish_pooled(sched, outputs)
        # one sampler row per sampled position: a speculative chunk's every position, its sequence repeated, each
        # row ahead of it by the drafts before that position
        ahead = [c.draft[:j] for c in chunks for j in range(1 + len(c.draft))] if any(c.draft for c in chunks) else None
        defer = self.async_scheduling and defer_blocker(sched, chunks, scores) is None
        result = self.sampler(logits, [c.seq for c in chunks for _ in range(1 + len(c.draft))], self.eos_token_ids,
                              ahead, defer=defer)
        if self._inflight is not None:  # the previous step's tokens: read while this step computes
            outputs.extend(self._resolve())
        if defer:
            self.scheduler.update(sched, {c.seq.request_id: PLACEHOLDER for c in chunks})
            self._inflight = InFlightStep(chunks, [c.seq.num_output_tokens - 1 for c in chunks], result)
            self.num_deferred_steps += 1
            return outputs
        sampled: dict[str, int | list[int]] = {}
        spec_ends: dict[str, tuple[FinishReason | None, int | None]] = {}
        starts = list(itertools.accumulate((1 + len(c.draft) for c in chunks), initial=0))
        for c, i, end in zip(chunks, starts, starts[1:]):
            seq = c.seq
            if i in result.errors:
                outputs.append(self._unsampled(seq, result, i))
                continue
            if c.draft:
                # rows past one that could not sample (its constraint allows nothing there) are not checked
                usable = next((j for j in range(i + 1, end) if j in result.errors), end) - i
                kept, why, err = self._verify(seq, c.draft[:usable - 1], result.token_ids[i:i + usable])
                if err is not None:
                    out = self._finish(seq, [], None, "error", error=err[0])
                    out.rejected = err[1]
                    outputs.append(out)
                else:
                    sampled[seq.request_id], spec_ends[seq.request_id] = kept, why
                continue
            tok = result.token_ids[i]
            if self._accepted(seq, tok, outputs):
                sampled[seq.request_id] = tok
        self.scheduler.update(sched, sampled)
        self._finish_pooled(sched, outputs)
        for c, i in zip(chunks, starts):
            seq = c.seq
            if seq.request_id not in sampled or seq.status is not SequenceStatus.RUNNING:
                continue
            if c.draft:
                kept, (reason, stop_tok) = sampled[seq.request_id], spec_ends[seq.request_id]
                lp = result.logprobs[i:i + len(kept)] if seq.params.logprobs is not None else None
            else:
                tok = sampled[seq.request_id]
                kept = [tok]
                lp = [result.logprobs[i]] if seq.params.logprobs is not None else None
                reason, stop_tok = self._stop_reason(seq, tok)
            if reason is None:
                outputs.append(self._output(seq, kept, lp))
            else:
                outputs.append(self._finish(seq, kept, lp, reason, stop_token_id=stop_tok))
        if self.speculative is not None:
            self._propose(chunks)
        return outputs

    def _resolve(self) -> list[RequestOutput]:
        """Read the in-flight step's tokens into its sequences' placeholders; their outputs and stop checks (a
        sequence aborted since is skipped; one preempted since keeps its token for its recompute)."""
        step, self._inflight = self._inflight, None
        result = step.sample.result()
        outputs: list[RequestOutput] = []
        for i, (c, at) in enumerate(zip(step.chunks, step.at)):
            seq = c.seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            if i in result.errors:
                outputs.append(self._unsampled(seq, result, i))
                continue
            tok = result.token_ids[i]
            if not self._accepted(seq, tok, outputs):
                continue
            seq.output_token_ids[at] = tok
            lp = [result.logprobs[i]] if seq.params.logprobs is not None else None
            reason, stop_tok = self._stop_reason(seq, tok, at + 1, seq.num_prompt_tokens + at + 1)
            if reason is None:
                outputs.append(self._output(seq, [tok], lp))
            else:
                outputs.append(self._finish(seq, [tok], lp, reason, stop_token_id=stop_tok))
        return outputs

    def _verify(self, seq: Sequence, draft: tuple[int, ...], sampled: list[int]
                ) -> tuple[list[int], tuple[FinishReason | None, int | None], tuple[str, bool] | None]:
        """The tokens a speculative chunk emits: its drafts up to the first position whose sampled token differs,
        then that token; cut at the first that ends the request (with why). Each is accepted by the sequence's
        constraint in turn; the third value, when the constraint did not, is why and whether it refused the token
        (a client error, as in `_accepted`)."""
        accepted = 0
        while accepted < len(draft) and draft[accepted] == sampled[accepted]:
            accepted += 1
        self.spec_draft_tokens += len(draft)
        self.spec_accepted_tokens += accepted
        self.spec_drafts += 1
        for j in range(accepted):
            self.spec_accepted_per_pos[j] += 1
        seq.drafter.verified(accepted)
        self.sampler.drafts_kept(seq, accepted)
        tokens = list(draft[:accepted]) + [sampled[accepted]]
        for m, tok in enumerate(tokens, 1):
            if seq.constraint is not None:
                err, refused = self._accept(seq, tok)
                if err is not None:
                    return [], (None, None), (err, refused)
            why = self._stop_reason(seq, tok, seq.num_output_tokens + m, seq.num_tokens + m)
            if why[0] is not None:
                return tokens[:m], why, None
        return tokens, (None, None), None

    def _unsampled(self, seq: Sequence, result: SamplerOutput, row: int) -> RequestOutput:
        """End ``seq``, whose sampler row ``row`` could not sample, with "error" (``rejected``: its own settings and
        grammar left no token)."""
        out = self._finish(seq, [], None, "error", error=result.errors[row])
        out.rejected = row in result.rejected
        return out

    def _accepted(self, seq: Sequence, tok: int, outputs: list[RequestOutput]) -> bool:
        """Whether ``seq``'s constraint, if it has one, accepts ``tok``; when it refuses, ``seq`` ends with "error"
        (its output appended to ``outputs``)."""
        err, refused = self._accept(seq, tok) if seq.constraint is not None else (None, False)
        if err is not None:
            out = self._finish(seq, [], None, "error", error=err)
            out.rejected = refused
            outputs.append(out)
        return err is None

    @staticmethod
    def _accept(seq: Sequence, tok: int) -> tuple[str | None, bool]:
        """Advance ``seq``'s constraint past ``tok``: why it did not (None: it accepted), and whether it refused the
        token (the request's grammar ends it: a client error) rather than failing."""
        try:
            ok = seq.constraint.accept_token(tok)
            return (None, False) if ok else (seq.constraint.error_message() or f"the constraint rejected token {tok}",
                                             True)
        except Exception as e:
            return f"constraint failed on token {tok}: {type(e).__name__}: {e}", False

    def _propose(self, chunks: list) -> None:
        """Draft tokens for the next step of each speculating sequence that sampled this step and still runs; none
        while the engine holds more requests than ``disable_by_batch_size``."""
        limit = self.speculative.disable_by_batch_size
        if limit is not None and self.scheduler.num_running + self.scheduler.num_waiting > limit:
            return
        for c in chunks:
            seq, p = c.seq, c.seq.params
            if seq.drafter is None or seq.status is not SequenceStatus.RUNNING:
                continue
            room = self.max_model_len - seq.num_tokens
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)
            seq.draft = seq.drafter.draft(seq.token_ids_slice, seq.num_tokens, room)

    def _keep_rows(self, sched: SchedulerOutput) -> None:
        """Take this step's kept hidden rows (in chunk order) into their sequences: a pooling request folds them
        into its pool (`ember.engine.pooling`); a prompt-logprob request scores them, ``max_num_seqs`` rows of
        logits at a time (`ember.engine.prompt_logprobs`)."""
        row = 0
        for chunk in sched.chunks:
            lo, q = chunk.prompt_rows
            if not q:
                continue
            seq = chunk.seq
            kind = seq.params.pooling
            if kind is not None:
                seq.pooled = pooling.fold(kind, seq.pooled, lo, self.runner.scoring_hidden[row:row + q])
            else:
                targets = seq.prompt_token_ids[lo + 1:lo + 1 + q]
                seq.prompt_logprobs += score_rows(self.runner.scoring_logits, row, targets,
                                                  seq.params.prompt_logprobs or 0, self.config.max_num_seqs)
                seq.num_prompt_logprobs = lo + q
            row += q
        self.runner.scoring_hidden = None

    def _finish_pooled(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Finish (``stop``) the pooling requests whose prompt this step completed, each output carrying its
        embedding (a classifier's logits); returns ``outputs``."""
        for chunk in sched.chunks:
            seq = chunk.seq
            kind = seq.params.pooling
            if kind is None or seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens < seq.num_tokens:
                continue
            embedding = pooling.result(kind, seq.pooled, seq.num_prompt_tokens, self.score_head)
            seq.pooled = None
            out = self._finish(seq, [], None, "stop")
            out.embedding = embedding
            outputs.append(out)
        return outputs

    def _stop_reason(self, seq: Sequence, tok: int, num_output: int | None = None, num_tokens: int | None = None
                     ) -> tuple[FinishReason | None, int | None]:
        """Why ``tok`` ends ``seq`` (None: it does not), with ``seq``'s output and total lengths once ``tok`` is
        appended (default: ``seq``'s own, for a token already appended)."""
        p = seq.params
        num_output = seq.num_output_tokens if num_output is None else num_output
        num_tokens = seq.num_tokens if num_tokens is None else num_tokens
        if num_output >= p.min_tokens and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids)):
            return "stop", tok
        if seq.constraint is not None and num_output >= p.min_tokens:
            try:
                if seq.constraint.is_terminated():
                    return "stop", None
            except Exception:
                log.exception("constraint.is_terminated failed for %s", seq.request_id)
                return "stop", None
        if p.max_tokens is not None and num_output >= p.max_tokens:
            return "length", None
        if num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _output(self, seq: Sequence, new: list[int], lp, finished: bool = False,
                reason: FinishReason | None = None, stop_token_id: int | None = None,
                error: str | None = None) -> RequestOutput:
        prompt_lps = None
        if seq.params.prompt_logprobs is not None and new and seq.prompt_logprobs is not None:
            prompt_lps, seq.prompt_logprobs = seq.prompt_logprobs, None  # sent once, with the first token
        return RequestOutput(request_id=seq.request_id, new_token_ids=new, logprobs=lp, finished=finished,
                             finish_reason=reason, stop_token_id=stop_token_id, error=error,
                             num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                             queue_seconds=None if seq.scheduled_at is None else seq.scheduled_at - seq.queued_at,
                             scheduled_at=seq.scheduled_at, prompt_logprobs=prompt_lps)

    def _finish(self, seq: Sequence, new: list[int], lp, reason: FinishReason, stop_token_id: int | None = None,
                error: str | None = None) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        self.sampler.forget(seq.request_id)
        return self._output(seq, new, lp, True, reason, stop_token_id, error)

    def _drop_unsaved_states(self) -> None:
        """Forget the recurrent-state snapshots a failed step was to save, so no later request restores them."""
        if self.scheduler.snapshots is not None:
            self.scheduler.snapshots.discard_pending()

    failed_step_wait_s = 1.0
    """How long a failed step waits for a tensor-parallel worker to exit (`broken_group`) before the failure is taken
    as the step's own: the broken collective can reach the driver a moment before the worker's exit."""

    def broken_group(self, outputs: list[RequestOutput],
                     wait: float = 0.0) -> tuple[str, list[RequestOutput]] | None:
        """When a tensor-parallel worker has died (waiting up to ``wait`` seconds for one to exit; its exit may
        trail the broken collective): why (naming the worker; the engine can run no more steps), and every request
        ended with that reason, those failing in ``outputs`` included. None while the group is whole or there is
        none."""
        dead_worker = getattr(self.runner, "dead_worker", None)
        reason = dead_worker(wait) if dead_worker is not None else None
        if reason is None:
            return None
        fatal = f"{reason}; the engine stops"
        ended = [replace(o, error=fatal) if o.finish_reason == "error" and not o.rejected else o
                 for o in outputs]
        return fatal, ended + self.fail_all(fatal)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every unfinished request with finish_reason "error" (used when the step loop itself breaks)."""
        outs, self._pending = self._pending, []
        self._inflight = None
        self._drop_unsaved_states()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            outs.append(self._finish(seq, [], None, "error", error=message))
        return outs
