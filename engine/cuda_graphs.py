"""CUDA graphs for decode steps: capture a decode forward once per batch size, replay the next size up with padding.

A decode step (one query token per sequence) has the same shapes every time for a given batch size, so its kernel
launches can be recorded once and replayed for a fraction of the launch overhead. `DecodeGraphRunner` owns the
static input buffers every captured graph reads (sized for the largest batch):

- ``input_ids`` int64 ``[N]``, ``positions`` int64 ``[N]``, ``slot_mapping`` int64 ``[N]``;
- ``query_start_loc`` int32 ``[N+1]`` (fixed ``0..N``: one token per sequence), ``seq_lens`` int32 ``[N]``;
- ``block_table`` int32 ``[N, max_blocks_per_seq]``; ``logits_indices`` int64 ``[N]`` (fixed ``0..N-1``);
- for models with recurrent state (``state_pad_slot`` given): ``state_slots`` int64 ``[N]`` and ``state_keep``
  float32 ``[N]``, the token indices fixed ``0..N-1``; padding rows use the scratch slot ``state_pad_slot``;
- with LoRA adapters (``lora``): ``lora_row_slots`` int64 ``[N]``, each row's adapter slot (-1 for the base model
  and for padding rows), from which the graphed forward masks every slot's update (`ember.engine.lora.LoRARows`).

A batch of ``n`` sequences is copied into the first ``n`` rows (the buffers are never rebound: the graphs hold their
addresses) and replayed with the graph of the smallest captured size ``>= n``; rows ``n..size-1`` are padding: slot ``-1`` (the KV write skips them), ``seq_len 0`` (attention reads
no key and writes zeros), token and position 0. The output rows past ``n`` are garbage and are sliced away. With
graphs the returned tensor lives in the graph's pool and is overwritten by the next replay: consume it first.

The forward must be graph-safe: no host synchronisation, no shape that depends on device values, and everything it
allocates comes from the graph's private pool. The attention kernels in `ember.kernels.attention` qualify. Without a
GPU (``device.type != "cuda"``) the runner runs the forward eagerly on the same padded buffers, which keeps its
padding logic testable on a CPU.

Use from a model runner (decode-only steps with at most ``max_num_seqs`` sequences; prefill stays eager)::

    runner = DecodeGraphRunner(lambda ids, meta: model.compute_logits(model(ids, meta, kv_caches, backend)),
                               max_num_seqs=cfg.max_num_seqs, max_blocks_per_seq=blocks_per_seq,
                               max_seqlen_k=max_model_len, device=device)
    runner.capture()                       # once, after the KV cache is allocated
    logits = runner.run(input_ids, meta)   # per decode step; meta.max_seqlen_q == 1
"""
from __future__ import annotations

from typing import Callable

import torch

from ember.engine.attention import AttentionMetadata, RecurrentMetadata

DecodeForward = Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]
"""``forward(input_ids [n], meta) -> [n, ...]``: e.g. a model's hidden states or logits for a decode batch."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """``1, 2, 4, 8, ...`` below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be >= 1")
    sizes = []
    s = 1
    while s < max_num_seqs:
        sizes.append(s)
        s *= 2
    sizes.append(max_num_seqs)
    return sizes


class DecodeGraphRunner:
    """Captured decode forwards for batch sizes ``capture_sizes(max_num_seqs)`` over shared static buffers."""

    def __init__(
        self,
        forward: DecodeForward,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_seqlen_k: int,
        device: torch.device | str,
        sizes: list[int] | None = None,
        state_pad_slot: int | None = None,
        lora: bool = False,
    ) -> None:
        self.forward = forward
        self.device = torch.device(device)
        self.sizes = sorted(sizes or capture_sizes(max_num_seqs))
        self.max_seqlen_k = max_seqlen_k
        n = self.sizes[-1]
        dev = self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self.state_pad_slot = state_pad_slot
        if state_pad_slot is not None:
            self.state_slots = torch.full((n,), state_pad_slot, dtype=torch.int64, device=dev)
            self.state_keep = torch.zeros(n, dtype=torch.float32, device=dev)
        self.lora_row_slots = torch.full((n,), -1, dtype=torch.int64, device=dev) if lora else None
        self.use_graphs = self.device.type == "cuda"
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_seqs: int) -> int:
        """The captured size a batch of ``num_seqs`` replays with."""
        for s in self.sizes:
            if s >= num_seqs:
                return s
        raise ValueError(f"decode batch of {num_seqs} exceeds the largest captured size {self.sizes[-1]}")

    def static_inputs(self, size: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """The first ``size`` rows of the static buffers as forward arguments (what the ``size`` graph reads)."""
        return self.input_ids[:size], self._meta(size)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            positions=self.positions[:size],
            logits_indices=self.logits_indices[:size],
            max_seqlen_q=1,
            max_seqlen_k=self.max_seqlen_k,
            recurrent=None if self.state_pad_slot is None else RecurrentMetadata(
                self.logits_indices[:size], self.state_slots[:size], self.state_keep[:size], []),
            lora_row_slots=None if self.lora_row_slots is None else self.lora_row_slots[:size],
        )

    def capture(self, warmup: int = 2) -> None:
        """Record one graph per size, largest first so the smaller ones reuse its pool (a no-op without CUDA).

        Capture runs the forward on all-padding inputs, so it writes no KV and reads no cache.
        """
        if not self.use_graphs:
            return
        self._reset_padding(0)
        self._pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            ids, meta = self.static_inputs(size)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(warmup):  # JIT-compiles kernels and settles lazy allocations outside the capture
                    self.forward(ids, meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._outputs[size] = self.forward(ids, meta)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def _reset_padding(self, start: int) -> None:
        self.input_ids[start:] = 0
        self.positions[start:] = 0
        self.slot_mapping[start:] = -1
        self.seq_lens[start:] = 0
        if self.state_pad_slot is not None:
            self.state_slots[start:] = self.state_pad_slot
            self.state_keep[start:] = 0.0
        if self.lora_row_slots is not None:
            self.lora_row_slots[start:] = -1

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward's output for a decode batch (``max_seqlen_q == 1``, one token per sequence), rows ``[:n]``."""
        n = meta.num_seqs
        if meta.max_seqlen_q != 1 or meta.num_tokens != n or input_ids.shape[0] != n:
            raise ValueError("DecodeGraphRunner.run takes decode batches only (one query token per sequence)")
        size = self.padded_size(n)
        width = meta.block_table.shape[1]
        if width > self.block_table.shape[1]:
            raise ValueError(f"block table of width {width} exceeds max_blocks_per_seq {self.block_table.shape[1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_table[:n, :width].copy_(meta.block_table, non_blocking=True)
        if self.state_pad_slot is not None:
            rec = meta.recurrent
            if rec is None or rec.prefills or rec.decode_slots.shape[0] != n:
                raise ValueError("a decode batch of a recurrent model needs one state slot per sequence")
            self.state_slots[:n].copy_(rec.decode_slots, non_blocking=True)
            self.state_keep[:n].copy_(rec.decode_keep, non_blocking=True)
        if self.lora_row_slots is not None:
            if meta.lora_row_slots is None or meta.lora_row_slots.shape[0] != n:
                raise ValueError("a decode batch under LoRA needs one adapter slot per sequence")
            self.lora_row_slots[:n].copy_(meta.lora_row_slots, non_blocking=True)
        self._reset_padding(n)
        if self.use_graphs and size in self._graphs:
            self._graphs[size].replay()
            return self._outputs[size][:n]
        return self.forward(*self.static_inputs(size))[:n]
