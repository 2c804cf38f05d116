"""Runs the model for one scheduler step: builds the step's metadata, owns the paged KV cache, and returns the
logits of the sequences that sample. One forward per step over every scheduled chunk (mixed prefill + decode).

Decode graphs: after the KV cache is allocated, `capture_decode_graphs` puts a `DecodeGraphRunner` in front of the
model. From then on every decode-only step (each chunk one token, every sequence sampling, at most the largest
captured batch) replays the CUDA graph of the next captured size, padding the batch; prefill and mixed steps, and
larger decode batches, stay eager. Without CUDA the same runner runs eagerly over its padded buffers (what the CPU
tests use to check the routing and the padding). `graph_blocker` says why a runner must not capture.

Host syncs: `prepare` fills two persistent host buffers (int64: token IDs, positions, slots, logits indices and, for
recurrent models, the one-token chunks' token indices, state slots and keep flags; int32:
query starts, sequence lengths, block table) and uploads each with one non-blocking copy from pinned memory
(`ember.engine.staging`); nothing in `prepare` or the forward reads a device value back, so a decode step's only
device -> host read is the sampler's. `prepare` is `stage` (host only: the buffers, a `StagedStep`) then `load` (the
uploads and the metadata over them), the split a tensor-parallel driver sends its workers through.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from ember.engine.attention import AttentionMetadata, RecurrentMetadata, get_backend, is_triton_backend
from ember.engine.block_rows import block_row
from ember.engine.config import ModelConfig
from ember.engine.cuda_graphs import DecodeGraphRunner
from ember.engine.lora import LoRAStack
from ember.engine.models.layers import DecoderForCausalLM, row_ops_backend, use_triton_row_ops
from ember.engine.scheduler import SchedulerOutput
from ember.engine.staging import Staging

log = logging.getLogger(__name__)


@dataclass
class CarriedTokens:
    """Inputs of a step that the step before it sampled and the host has not read yet (asynchronous scheduling):
    flat input row ``rows[i]`` takes ``tokens[sampled_rows[i]]``, copied on the device."""

    rows: list[int]
    sampled_rows: list[int]
    tokens: torch.Tensor
    """The earlier step's sampled token IDs (int64 ``[S]``, on the device)."""


@dataclass
class StagedStep:
    """A step's inputs on the host, as `ModelRunner.stage` wrote them into its staging buffers: what `load` turns
    into the forward's tensors (a tensor-parallel worker gets a copy and loads it the same way)."""

    h64: np.ndarray
    """ids [T] | positions [T] | slots [T] | logits and score indices [S] | recurrent decode rows [3R] | carried rows
    [C] | their sampled rows [C]"""
    h32: np.ndarray
    """query starts [B+1] | sequence lengths [B] | block table [B, width]"""
    num_tokens: int
    num_seqs: int
    width: int
    num_logits: int
    num_rows: int
    """Logits rows plus prompt-scoring rows."""
    num_recurrent: int
    num_carried: int
    max_seqlen_q: int
    max_seqlen_k: int
    prefills: list[tuple[int, int, int, bool]]
    state_restores: list[tuple[int, int]]
    state_saves: list[tuple[int, int]]
    token_type_starts: list[int] | None
    lora: tuple[list[int], list[int]] | None
    """Each chunk's adapter slot and token count, when the runner serves adapters."""


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all KV layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_kv_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class ModelRunner:
    """Owns the model, its KV cache and the attention backend; turns a `SchedulerOutput` into logits."""

    def __init__(self, model: DecoderForCausalLM, cfg: ModelConfig, block_size: int, device: torch.device,
                 dtype: torch.dtype, backend: ModuleType | None = None,
                 kv_cache_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        """The KV cache's element type: the model dtype, or ``torch.float8_e4m3fn`` (per-layer scales)."""
        self.backend = backend if backend is not None else get_backend(device)
        self.row_ops = row_ops_backend(device)
        use_triton_row_ops(model, self.row_ops == "triton")
        self._staged64 = Staging(torch.int64, device)
        self._staged32 = Staging(torch.int32, device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.last_batch_size = 0
        self.last_num_tokens = 0
        self.graphs: DecodeGraphRunner | None = None
        self.graph_pool_bytes = 0  # CUDA memory the captured graphs hold (measured at capture)
        self.num_graph_steps = 0  # forwards routed through `graphs`
        self.num_eager_steps = 0
        self.scoring_hidden: torch.Tensor | None = None
        """Hidden states ``[Q, hidden]`` of the last step's prompt-scoring rows (`AttentionMetadata.score_indices`);
        None when it had none."""
        self.recurrent = hasattr(model, "allocate_recurrent_state")
        """The model has layers with a per-sequence recurrent state (kept in ``Sequence.state_slot``)."""
        self.state_pad_slot: int | None = None
        """The extra state slot padding rows of a decode graph write to (recurrent models)."""
        self.first_snapshot_slot: int | None = None
        """Where the prefix-cache snapshot slots start, after the padding slot (recurrent models)."""
        self.lora: LoRAStack | None = None
        """The adapters this runner's model serves (`enable_lora`): `prepare` groups each step's rows by slot."""
        self.shard = (0, 1)
        """(rank, world size) of this runner's model under tensor parallelism."""

    def allocate_recurrent_state(self, num_slots: int, num_snapshots: int = 0) -> None:
        """Zeroed recurrent state for ``num_slots`` sequences (one per possible running one), a scratch slot for
        graph padding (slot ``num_slots``) and ``num_snapshots`` prefix-cache snapshots after it; nothing for models
        without recurrent layers. On CUDA, call before sizing the KV cache from free memory."""
        if self.recurrent:
            total = num_slots + 1 + num_snapshots
            size = self.model.allocate_recurrent_state(total, self.device)
            self.state_pad_slot = num_slots
            self.first_snapshot_slot = num_slots + 1
            log.info("recurrent state: %d slots (%d running, 1 graph padding, %d prefix snapshots), %.1f MiB",
                     total, num_slots, num_snapshots, size / 2**20)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.cfg.num_key_value_heads, self.cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
            for _ in range(self.cfg.num_kv_layers)
        ]
        self.num_blocks = num_blocks

    def prepare(self, out: SchedulerOutput, carried: CarriedTokens | None = None
                ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Flat input ids ``[T]`` and the step's metadata; sampling rows follow the order of ``out.chunks``. The
        ``carried`` rows' ids come from the previous step's tokens on the device (their host value is a placeholder).

        The tensors are views of persistent device buffers, valid until the next `prepare`."""
        return self.load(self.stage(out, carried), carried)

    def stage(self, out: SchedulerOutput, carried: CarriedTokens | None = None) -> StagedStep:
        """The host half of `prepare`: fill the staging buffers from the scheduler's chunks (no device work)."""
        bs = self.block_size
        chunks = out.chunks
        b = len(chunks)
        t = sum(c.num_tokens for c in chunks)
        used = [(c.start + c.num_tokens + bs - 1) // bs for c in chunks]  # blocks each chunk's positions reach
        width = max(used)
        s = sum(1 + len(c.draft) for c in chunks if c.samples)  # a speculative chunk samples every position
        scored = [c.prompt_rows for c in chunks]
        s += sum(q for _, q in scored)  # prompt-logprob rows follow the sampling rows
        r = sum(1 for c in chunks if c.num_tokens == 1) if self.recurrent else 0
        c = len(carried.rows) if carried is not None else 0
        # int64 buffer: ids [t] | positions [t] | slots [t] | logits indices [s] | recurrent decode rows [3r] |
        # carried rows [c] | their sampled rows [c]
        n64 = 3 * t + s + 3 * r + 2 * c
        h64 = self._staged64.host(n64)
        ids, pos, slots, li = h64[:t], h64[t:2 * t], h64[2 * t:3 * t], h64[3 * t:3 * t + s]
        prefills = self._fill_recurrent(chunks, h64[3 * t + s:3 * t + s + 3 * r]) if self.recurrent else []
        if c:
            h64[n64 - 2 * c:n64 - c] = carried.rows
            h64[n64 - c:] = carried.sampled_rows
        # int32 buffer: query starts [b+1] | seq lens [b] | block table [b, width]
        h32 = self._staged32.host(2 * b + 1 + b * width)
        cu, lens, table = h32[:b + 1], h32[b + 1:2 * b + 1], h32[2 * b + 1:].reshape(b, width)
        cu[0] = 0
        table[:] = 0
        row = j = 0
        k = k0 = s - sum(q for _, q in scored)  # next prompt-logprob row's index in `li`
        max_q = max_k = 0
        for i, chunk in enumerate(chunks):
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            end = start + n
            nb = used[i]
            blocks = block_row(seq)
            if n == 1:
                ids[row] = seq.token_ids_slice(start, end)[0]
                pos[row] = start
                slots[row] = int(blocks[start // bs]) * bs + start % bs
            else:
                ids[row:row + n] = seq.token_ids_slice(start, end) + list(chunk.draft)
                p = np.arange(start, end)
                pos[row:row + n] = p
                slots[row:row + n] = blocks[p // bs].astype(np.int64) * bs + p % bs
            row += n
            cu[i + 1] = row
            lens[i] = end
            table[i, :nb] = blocks[:nb]
            if chunk.draft:
                li[j:j + n] = np.arange(row - n, row)
                j += n
            elif chunk.samples:
                li[j] = row - 1
                j += 1
            lo, q = scored[i]
            if q:
                li[k:k + q] = np.arange(row - n + lo - start, row - n + lo - start + q)
                k += q
            max_q, max_k = max(max_q, n), max(max_k, end)
        token_types = None
        if getattr(self.model, "reads_token_types", False):
            token_types = [-1 if c.seq.params.token_type_start is None else c.seq.params.token_type_start
                           for c in chunks]
        lora = ([c.seq.lora_slot for c in chunks], [c.num_tokens for c in chunks]) if self.lora is not None else None
        return StagedStep(h64, h32, t, b, width, k0, s, r, c, max_q, max_k, prefills, out.state_restores,
                          out.state_saves, token_types, lora)

    def load(self, st: StagedStep, carried: CarriedTokens | None = None) -> tuple[torch.Tensor, AttentionMetadata]:
        """The device half of `prepare`: upload the staging buffers `stage` filled and build the metadata over
        them; ``carried`` supplies the carried rows' tokens (`carried_values`)."""
        t, b, s, k0, r, c = st.num_tokens, st.num_seqs, st.num_rows, st.num_logits, st.num_recurrent, st.num_carried
        n64 = st.h64.shape[0]
        d64 = self._staged64.upload(n64)
        d32 = self._staged32.upload(st.h32.shape[0])
        if c:
            d64[:t].index_copy_(0, d64[n64 - 2 * c:n64 - c], self.carried_values(carried, d64[n64 - c:]))
        meta = AttentionMetadata(
            query_start_loc=d32[:b + 1],
            seq_lens=d32[b + 1:2 * b + 1],
            block_table=d32[2 * b + 1:].view(b, st.width),
            slot_mapping=d64[2 * t:3 * t],
            positions=d64[t:2 * t],
            logits_indices=d64[3 * t:3 * t + k0],
            max_seqlen_q=st.max_seqlen_q,
            max_seqlen_k=st.max_seqlen_k,
            score_indices=d64[3 * t + k0:3 * t + s] if s > k0 else None,
        )
        if st.token_type_starts is not None:  # an encoder step: one small upload, no graphs
            meta.token_type_starts = torch.tensor(st.token_type_starts, dtype=torch.int64).to(self.device,
                                                                                              non_blocking=True)
        if st.lora is not None:
            slots, counts = st.lora
            meta.lora_rows = self.lora.group_rows(slots, counts)
            if self.graphs is not None and t == b:  # a decode step: a graph may replay it
                meta.lora_row_slots = self.lora.row_slots(slots)
        if self.recurrent:
            rec = d64[3 * t + s:3 * t + s + 3 * r].view(3, r)
            meta.recurrent = RecurrentMetadata(rec[0], rec[1], rec[2].float(), st.prefills, st.state_restores,
                                               st.state_saves)
        return d64[:t], meta

    def carried_values(self, carried: CarriedTokens, sampled_rows: torch.Tensor) -> torch.Tensor:
        """The tokens of the carried rows (int64 ``[c]``, on the device): the earlier step's ``sampled_rows``."""
        return carried.tokens.index_select(0, sampled_rows)

    @staticmethod
    def _fill_recurrent(chunks: list, rows: np.ndarray) -> list[tuple[int, int, int, bool]]:
        """Write the one-token chunks' token index, state slot and keep flag (0: the token starts its sequence)
        into ``rows`` ``[3 * r]``; return the longer chunks as ``(slot, first token, end token, starts it)``."""
        r = rows.shape[0] // 3
        tokens, slots, keep = rows[:r], rows[r:2 * r], rows[2 * r:]
        prefills: list[tuple[int, int, int, bool]] = []
        row = j = 0
        for c in chunks:
            slot = c.seq.state_slot
            if slot < 0:
                raise RuntimeError(f"request {c.seq.request_id!r} is scheduled without a state slot")
            if c.num_tokens == 1:
                tokens[j], slots[j], keep[j] = row, slot, int(c.start > 0)
                j += 1
            else:
                prefills.append((slot, row, row + c.num_tokens, c.start == 0))
            row += c.num_tokens
        return prefills

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, carried: CarriedTokens | None = None) -> torch.Tensor:
        """Logits ``[S, vocab]`` (fp32) for the chunks that sample, in chunk order. The hidden states of the rows
        that score prompt tokens (`ScheduledChunk.prompt_rows`) stay for `scoring_logits`."""
        input_ids, meta = self.prepare(out, carried)
        return self.forward(input_ids, meta)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`execute` after `prepare`: the model over the loaded step (every tensor-parallel rank runs it).

        With decode graphs, a decode step's logits are a view of the graph's output buffer, valid until the next
        step."""
        self.last_batch_size = meta.num_seqs
        self.last_num_tokens = meta.num_tokens
        self.scoring_hidden = None
        saves = meta.recurrent.saves if meta.recurrent is not None else None
        if self.lora is not None:
            self.lora.rows.use_groups(meta.lora_rows)
        if self.graphs is not None and self._graph_step(meta):
            self.num_graph_steps += 1
            logits = self.graphs.run(input_ids, meta)
        else:
            self.num_eager_steps += 1
            hidden = self.model(input_ids, meta, self.kv_caches, self.backend)
            if meta.score_indices is not None:
                self.scoring_hidden = hidden[meta.score_indices]
            if meta.logits_indices.numel() == 0:
                logits = torch.empty(0, self.cfg.vocab_size, device=self.device)
            else:
                logits = self.model.compute_logits(hidden[meta.logits_indices]).float()
        if saves:  # prefix-cache snapshots of the states this step left (outside any graph)
            self.model.save_states(saves)
        return logits

    def enable_lora(self, slots: int, max_rank: int) -> None:
        """Wrap the model's projections for ``slots`` LoRA adapters of rank up to ``max_rank``."""
        self.lora = LoRAStack(self.model, slots, max_rank, self.device, self.dtype, self.shard)

    @torch.inference_mode()
    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Load an adapter into a free slot, or into its own with ``replace`` (this rank's share of it under tensor
        parallelism)."""
        self.lora.add(name, path, replace)

    def unload_lora(self, name: str) -> None:
        self.lora.remove(name)

    @torch.inference_mode()
    def scoring_logits(self, lo: int, hi: int) -> torch.Tensor:
        """fp32 logits of the last step's prompt-scoring rows ``lo .. hi-1``: computed on demand, a slice at a time,
        so that a long scored prompt never holds a ``[prompt, vocab]`` tensor."""
        return self.model.compute_logits(self.scoring_hidden[lo:hi]).float()

    def _graph_step(self, meta: AttentionMetadata) -> bool:
        """Decode-only (one token per sequence, each sampling), no larger than the largest captured batch, and no
        prefix-cache restore (restores happen eagerly, before the layers compute; saves come after any step)."""
        n = meta.num_seqs
        rec = meta.recurrent
        return (meta.max_seqlen_q == 1 and meta.num_tokens == n and meta.logits_indices.shape[0] == n
                and n <= self.graphs.max_batch_size and (rec is None or not rec.restores)
                and meta.score_indices is None)

    def _decode_logits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The graphed forward: fp32 logits of every row of a decode batch."""
        if self.lora is not None:
            self.lora.rows.use_slots(meta.lora_row_slots, self.lora.slots, self.dtype)
        return self.model.compute_logits(self.model(input_ids, meta, self.kv_caches, self.backend)).float()

    def graph_blocker(self) -> str | None:
        """Why this runner cannot capture CUDA graphs (None: it can)."""
        if self.device.type != "cuda":
            return "no CUDA device"
        if getattr(self.model, "is_encoder", False):
            return "an encoder computes whole prompts and never decodes"
        from ember.engine.models.qwen3_moe import SparseMoeBlock
        from ember.engine.nvfp4_loading import use_triton as use_triton_moe

        if not is_triton_backend(self.backend):
            return (f"the attention backend {getattr(self.backend, 'name', self.backend)!r} synchronises with the "
                    "host (only the Triton kernels are graph-safe)")
        for m in self.model.modules():
            # Every MoE block (Qwen3-MoE, gpt-oss, DeepSeek-V3) routes with static-shape torch ops and, on the Triton
            # path, aligns and dispatches tokens without reading the device (`kernels.moe.moe_align_block_size`).
            if isinstance(m, SparseMoeBlock) and not use_triton_moe(self.device):
                return "MoE layers on the torch reference path (torch.unique/nonzero) synchronise with the host"
            tp = getattr(m, "tp", None)
            if tp is not None and tp.enabled:
                return ("tensor parallelism: capturing torch.distributed NCCL all-reduces in CUDA graphs is not "
                        "verified (it needs two GPUs to test)")
        return None

    @torch.inference_mode()
    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Route decode steps of up to ``max_num_seqs`` sequences through a `DecodeGraphRunner`, capturing its
        graphs now (CUDA; call after `allocate_kv_cache`, whose tensors the graphs read) or, without CUDA, running
        it eagerly over the padded buffers. Measures the graphs' memory pool into ``graph_pool_bytes``."""
        if not self.kv_caches:
            raise RuntimeError("capture_decode_graphs needs the KV cache: call allocate_kv_cache first")
        runner = DecodeGraphRunner(self._decode_logits, max_num_seqs=max_num_seqs,
                                   max_blocks_per_seq=-(-max_model_len // self.block_size),
                                   max_seqlen_k=max_model_len, device=self.device,
                                   state_pad_slot=self.state_pad_slot, lora=self.lora is not None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
            t0 = time.perf_counter()
            runner.capture()
            self.graph_pool_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
            log.info("CUDA graphs: decode batch sizes %s captured in %.1f s, %.1f MiB", runner.sizes,
                     time.perf_counter() - t0, self.graph_pool_bytes / 2**20)
        self.graphs = runner

    def shutdown(self) -> None:
        """Release what outlives the engine: nothing here; the tensor-parallel driver stops its workers."""

    @torch.inference_mode()
    def profile_activation_bytes(self, num_tokens: int, num_seqs: int) -> int:
        """Peak CUDA bytes a forward of ``num_tokens`` (plus logits for ``num_seqs`` rows) needs beyond the weights."""
        assert self.device.type == "cuda"
        bs = self.block_size
        nblocks = (num_tokens + bs - 1) // bs
        shape = (nblocks, bs, self.cfg.num_key_value_heads, self.cfg.head_dim)
        kvd = self.kv_cache_dtype
        caches = [(torch.zeros(shape, dtype=kvd, device=self.device),
                   torch.zeros(shape, dtype=kvd, device=self.device)) for _ in range(self.cfg.num_kv_layers)]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            block_table=torch.arange(nblocks, dtype=torch.int32, device=dev).unsqueeze(0),
            slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=dev),
            positions=torch.arange(num_tokens, dtype=torch.int64, device=dev),
            logits_indices=torch.arange(num_tokens - min(num_seqs, num_tokens), num_tokens, device=dev),
            max_seqlen_q=num_tokens,
            max_seqlen_k=num_tokens,
            recurrent=RecurrentMetadata.one_prefill(num_tokens, dev) if self.recurrent else None,
        )
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        hidden = self.model(ids, meta, caches, self.backend)
        logits = self.model.compute_logits(hidden[meta.logits_indices]).float()
        logits.sort(dim=-1, descending=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del caches, hidden, logits
        torch.cuda.empty_cache()
        return max(0, peak - base)
