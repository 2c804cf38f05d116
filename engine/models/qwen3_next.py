"""Qwen3-Next: a hybrid of Gated DeltaNet linear attention and gated full attention, over Qwen3-MoE experts with a
gated shared expert.

- **Layers**: ``linear_attention`` ones (``layer_types``, or all but every ``full_attention_interval``-th) keep a
  per-sequence recurrent state instead of KV: a depthwise causal conv window (``linear_conv_kernel_dim - 1`` inputs)
  and the delta-rule state ``[hv, dk, dv]`` (fp32), in the slot the scheduler gave the sequence
  (``Sequence.state_slot``). Only the full-attention layers have paged KV; prefix hits also restore a saved state
  (``meta.recurrent.restores``, `ember.engine.state_snapshots`) before each layer computes, and the runner copies
  saves out after the step's forward (:meth:`Qwen3NextForCausalLM.save_states`, also after a graph replay).
- **Linear attention**: ``in_proj_qkvz`` / ``in_proj_ba`` are grouped per key head (q, k, then the group's v and z;
  b then a); q/k/v go through the conv and SiLU; ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``;
  the gated delta rule runs one-token chunks batched (with the Triton attention backend, in place in their slots by
  `ember.kernels.gated_delta_decode`; else `ember.kernels.gated_delta_rule`) and longer chunks in blocks (with that
  backend one batched call per step, its walk across blocks in `ember.kernels.gated_delta_scan`);
  its output is RMS-normed per value head, gated by ``silu(z)``, and projected by ``out_proj``.
- **Full attention**: ``q_proj`` gives each head's query and an output gate (``o * sigmoid(gate)`` before
  ``o_proj``); q/k norms; rotary on the first ``partial_rotary_factor`` of each head.
- **Norms** other than the gated one are zero-centred: ``x_normed * (1 + w)`` in fp32 (weights stored as offsets).
- **MoE**: Qwen3-MoE's experts and router plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``.
Multi-token-prediction weights (``mtp.*``) are not used and are skipped on load.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from ember.engine.attention import AttentionMetadata, RecurrentMetadata, is_triton_backend
from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models.layers import (Attention, DecoderLayer, GatedMLP, OffsetRMSNorm, RotaryEmbedding,
                                        partial_rotary_dim)
from ember.engine.models.qwen3_moe import Qwen3MoeForCausalLM, SharedExpertMoeBlock
from ember.kernels import gated_delta_rule

_CHUNK = 64


def qkv_channel_parts(cfg: ModelConfig) -> tuple[int, int, int]:
    """The linear attention's q, k and v channel counts (the conv's channels, in that order)."""
    keys = cfg.raw_int("linear_num_key_heads") * cfg.raw_int("linear_key_head_dim")
    return keys, keys, cfg.raw_int("linear_num_value_heads") * cfg.raw_int("linear_value_head_dim")


class GatedRMSNorm(nn.Module):
    """``w * rmsnorm(x) * silu(gate)`` over the last dimension in ``gate``'s dtype (``x`` rounded to it first, the
    norm in fp32, cast back before the weight); one Triton launch on the Triton row-ops path."""

    triton = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        from ember.kernels import norm, reference_ops

        return (norm if self.triton else reference_ops).gated_rms_norm(x, gate, self.weight, self.eps)


class GatedAttention(Attention):
    """Full attention whose ``q_proj`` also yields a per-channel output gate (fused as ``qkv_proj``: each head's
    query and gate, then k, then v)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, qk_norm=False)
        self.qkv_proj = nn.Linear(cfg.hidden_size, (2 * self.hq + 2 * self.hkv) * self.d, bias=cfg.attention_bias)
        self.q_norm = OffsetRMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, rope: RotaryEmbedding,
                kv: tuple[torch.Tensor, torch.Tensor], backend: ModuleType) -> torch.Tensor:
        t = x.shape[0]
        qg, k, v = self.qkv_proj(x).split([2 * self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, gate = qg.reshape(t, self.hq, 2 * self.d).split(self.d, dim=-1)
        k, v = k.reshape(t, self.hkv, self.d), v.reshape(t, self.hkv, self.d)
        if self._fused_prologue(rope, backend):  # q read in place between the heads' gates
            out = self._attention(self._norm_rope_and_cache(q, k, v, meta, rope, kv), meta, kv, backend)
        else:
            q, k = rope(meta.positions, self.q_norm(q), self.k_norm(k))
            out = self.attend(q, k, v, meta, kv, backend)
        out = out.reshape(t, self.hq * self.d)
        if is_triton_backend(backend):  # the gate read in place, one launch (torch: a copy, a sigmoid, a product)
            from ember.kernels import activation

            out = activation.sigmoid_gate_mul(out, gate)
        else:
            out = out * torch.sigmoid(gate.reshape(t, self.hq * self.d))
        out = self.o_proj(out)
        return out if self.tp is None else self.tp.all_reduce(out)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention over per-sequence states (``conv_state [slots, C, K-1]`` in the model dtype,
    ``ssm_state [slots, hv, dk, dv]`` fp32), allocated by `Qwen3NextForCausalLM.allocate_recurrent_state`.

    Under tensor parallelism (``tp`` set) it holds this rank's key heads with their value heads (and their states)
    and sums the partial ``out_proj`` outputs over the ranks."""

    tp = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hk, self.hv = cfg.raw_int("linear_num_key_heads"), cfg.raw_int("linear_num_value_heads")
        self.dk, self.dv = cfg.raw_int("linear_key_head_dim"), cfg.raw_int("linear_value_head_dim")
        if self.hv % self.hk:
            raise ConfigError("config.json: linear_num_value_heads must be a multiple of linear_num_key_heads")
        self.kernel = cfg.raw_int("linear_conv_kernel_dim")
        self.channels = 2 * self.hk * self.dk + self.hv * self.dv
        self._make_projections(cfg.hidden_size)
        self.conv1d = nn.Conv1d(self.channels, self.channels, self.kernel, groups=self.channels, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, cfg.hidden_size, bias=False)
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)

    def _make_projections(self, hidden: int) -> None:
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.hk * self.dk + 2 * self.hv * self.dv, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.hv, bias=False)

    def _project(self, x: torch.Tensor, triton: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q|k|v [T, C] in the conv's channel order, z [T, hv, dv], b [T, hv], a [T, hv])``: Qwen3-Next's
        projections are grouped per key head (its q, k, then its value heads' v and z; b then a). With ``triton``
        one launch rearranges them (`ember.kernels.gdn_projections`), where torch takes seven."""
        t = x.shape[0]
        hk, dk, dv = self.hk, self.dk, self.dv
        r = self.hv // hk
        qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        if triton:
            from ember.kernels.gdn_projections import split_projections

            return split_projections(qkvz, ba, hk, dk, self.hv, dv)
        q, k, v, z = qkvz.view(t, hk, 2 * dk + 2 * r * dv).split([dk, dk, r * dv, r * dv], -1)
        b, a = ba.view(t, hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return mixed, z.reshape(t, self.hv, dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def allocate_state(self, num_slots: int, device: torch.device) -> int:
        """Zeroed states for ``num_slots`` sequences; returns their bytes."""
        dtype = self.conv1d.weight.dtype  # the model dtype (out_proj may be a packed NVFP4 / FP8 layer)
        self.conv_state = torch.zeros(num_slots, self.channels, self.kernel - 1, dtype=dtype, device=device)
        self.ssm_state = torch.zeros(num_slots, self.hv, self.dk, self.dv, dtype=torch.float32, device=device)
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.ssm_state))

    def forward(self, x: torch.Tensor, rec: RecurrentMetadata, backend: ModuleType) -> torch.Tensor:
        """With the Triton attention backend, one-token chunks update their states in place through
        `ember.kernels.gated_delta_decode`, their gates formed in it; otherwise through the torch step."""
        t = x.shape[0]
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        self._copy_states(rec.restores)
        triton = is_triton_backend(backend)
        mixed, z, b, a = self._project(x, triton)
        q, k, v = self._conv(mixed, rec, triton).split([hk * dk, hk * dk, hv * dv], dim=-1)
        core = self._delta(q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv), a, b, rec, triton)
        out = self.norm(core, z)
        out = self.out_proj(out.reshape(t, hv * dv))
        return out if self.tp is None else self.tp.all_reduce(out)

    def _copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole states between slots (prefix-cache restores and saves): ``(from, to)`` pairs."""
        for src, dst in copies:
            self.conv_state[dst] = self.conv_state[src]
            self.ssm_state[dst] = self.ssm_state[src]

    def _conv(self, mixed: torch.Tensor, rec: RecurrentMetadata, triton: bool = False) -> torch.Tensor:
        """The depthwise causal conv (+ SiLU) of every token, continuing each sequence's window; with the Triton
        backend one launch for the step's decode tokens (`ember.kernels.causal_conv_decode`)."""
        out = torch.empty_like(mixed)
        if rec.decode_tokens.numel() and triton:
            from ember.kernels.causal_conv_decode import causal_conv_decode

            causal_conv_decode(mixed, out, rec.decode_tokens, rec.decode_slots, rec.decode_keep, self.conv_state,
                               self.conv1d.weight[:, 0, :])
        if not rec.prefills and triton:
            return out
        w = self.conv1d.weight[:, 0, :].float()  # [C, K]
        if rec.decode_tokens.numel() and not triton:
            idx, slots = rec.decode_tokens, rec.decode_slots
            prev = self.conv_state[slots] * rec.decode_keep[:, None, None].to(mixed.dtype)
            window = torch.cat((prev, mixed[idx].unsqueeze(-1)), dim=-1)  # [D, C, K]
            self.conv_state[slots] = window[:, :, 1:]
            out[idx] = F.silu((window.float() * w).sum(-1)).to(mixed.dtype)
        for slot, s, e, fresh in rec.prefills:
            prev = self.conv_state.new_zeros(self.channels, self.kernel - 1) if fresh else self.conv_state[slot]
            window = torch.cat((prev, mixed[s:e].t()), dim=-1)  # [C, K-1+n]
            self.conv_state[slot] = window[:, window.shape[1] - (self.kernel - 1):]
            y = F.conv1d(window.float().unsqueeze(0), w.unsqueeze(1), groups=self.channels)[0]
            out[s:e] = F.silu(y).t().to(mixed.dtype)
        return out

    def _delta(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               rec: RecurrentMetadata, triton: bool) -> torch.Tensor:
        """The gated delta rule over each sequence's state, its gates ``g = -exp(A_log) * softplus(a + dt_bias)``
        and ``beta = sigmoid(b)``: fp32 ``[T, hv, dv]``. With ``triton`` the decode rows go through one launch that
        forms their gates itself, reading the rows in place when every row of the step decodes."""
        idx = rec.decode_tokens
        if idx.numel() and triton:
            from ember.kernels.gated_delta_decode import gated_delta_decode

            gates = (self.A_log, self.dt_bias)
            if not rec.prefills and idx.numel() == q.shape[0]:  # every row decodes: the rows are idx, in order
                return gated_delta_decode(q, k, v, a, b, rec.decode_keep, self.ssm_state, rec.decode_slots,
                                          gates=gates)
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        if idx.numel() and triton:
            out[idx] = gated_delta_decode(q[idx], k[idx], v[idx], a[idx], b[idx], rec.decode_keep, self.ssm_state,
                                          rec.decode_slots, gates=gates)
        torch_decode = bool(idx.numel()) and not triton
        if not (torch_decode or rec.prefills):
            return out
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if torch_decode:
            slots = rec.decode_slots
            fresh_to_zero = rec.decode_keep.log()[:, None]  # -inf where the token starts its sequence: full decay
            o, self.ssm_state[slots] = gated_delta_rule.decode_step(q[idx], k[idx], v[idx], g[idx] + fresh_to_zero,
                                                                    beta[idx], self.ssm_state[slots])
            out[idx] = o
        # With the Triton backend (CUDA's) a step's longer chunks go through one batched call, zero-padded to the
        # longest: the block loop is launch-bound on a GPU. With the torch backend (a CPU's) one call each: a
        # batch's states no longer fit the CPU's cache (0.6x measured, docs/performance.md).
        for group in ([rec.prefills] if rec.prefills else []) if triton else [[p] for p in rec.prefills]:
            spans = [(s, e) for _, s, e, _ in group]
            chunk = min(_CHUNK, 1 << (max(e - s for s, e in spans) - 1).bit_length())

            def padded(x: torch.Tensor) -> torch.Tensor:
                return torch.nn.utils.rnn.pad_sequence([x[s:e] for s, e in spans], batch_first=True)

            zero = self.ssm_state.new_zeros(self.ssm_state.shape[1:])
            states = torch.stack([zero if fresh else self.ssm_state[slot] for slot, _, _, fresh in group])
            o, states = gated_delta_rule.chunked(padded(q), padded(k), padded(v), padded(g), padded(beta), states,
                                                 chunk, scan_kernel=triton)
            for i, (slot, s, e, _) in enumerate(group):
                out[s:e] = o[i, :e - s]
                self.ssm_state[slot] = states[i]
        return out


class Qwen3NextDecoderLayer(DecoderLayer):
    """Zero-centred pre-norms around either mixer (``linear_attn`` or ``self_attn``) and the MLP."""

    def __init__(self, cfg: ModelConfig, linear: type[GatedDeltaNet] | None, moe: dict | None, device: torch.device,
                 dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.linear_attn = linear(cfg) if linear is not None else None
        self.self_attn = None if linear else GatedAttention(cfg)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SharedExpertMoeBlock(cfg, moe, device, dtype) if moe is not None else GatedMLP(cfg)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                rope: RotaryEmbedding, kv: tuple[torch.Tensor, torch.Tensor] | None,
                backend: ModuleType) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = (self.input_layernorm(h), h) if residual is None else self.input_layernorm(h, residual)
        if self.linear_attn is not None:
            h = self.linear_attn(x, meta.recurrent, backend)
        else:
            h = self.self_attn(x, meta, rope, kv, backend)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class _Body(nn.Module):
    linear_attention: type[GatedDeltaNet] = GatedDeltaNet

    def __init__(self, cfg: ModelConfig, moe: dict, sparse: list[bool], device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        linear = set(cfg.linear_attention_layers)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(cfg, self.linear_attention if i in linear else None, moe if sparse[i] else None,
                                  device, dtype)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3NextForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-Next over the paged KV cache (full-attention layers) and per-sequence recurrent state (the rest)."""

    body = _Body

    rotary_dim = staticmethod(partial_rotary_dim)

    def _linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.linear_attn is not None]

    def allocate_recurrent_state(self, num_slots: int, device: torch.device) -> int:
        """Every linear layer's states for ``num_slots`` sequences; returns their bytes."""
        return sum(layer.allocate_state(num_slots, device) for layer in self._linear_layers())

    def save_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy each ``(sequence slot, snapshot slot)`` pair's state in every linear layer: prefix-cache saves,
        taken after a step's forward (the states then hold that step's tokens)."""
        for layer in self._linear_layers():
            layer._copy_states(copies)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: ModuleType) -> torch.Tensor:
        """Hidden states ``[T, H]`` after the final norm; ``kv_caches`` holds the full-attention layers' caches in
        layer order, and the linear layers update the states of ``meta.recurrent``'s slots."""
        if meta.recurrent is None:
            raise ValueError("Qwen3-Next needs meta.recurrent (the chunks' state slots)")
        h = self.model.embed_tokens(input_ids)
        residual = None
        caches = iter(kv_caches)
        for layer in self.model.layers:
            h, residual = layer(h, residual, meta, self.rope, None if layer.self_attn is None else next(caches),
                                backend)
        return self.model.norm(h, residual)[0]

    def _shard_sizes(self, fused: str) -> list[int]:
        cfg = self.config
        if fused == "qkv_proj":
            d = cfg.head_dim
            return [2 * cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d]
        return super()._shard_sizes(fused)

    @staticmethod
    def tp_split_rule(name: str, cfg: ModelConfig) -> tuple:
        """Tensor-parallel split (see `ember.engine.distributed`): the linear-attention projections are grouped per
        key head (``in_proj_qkvz``, ``in_proj_ba``: rows), ``A_log``/``dt_bias`` follow the value heads,
        ``out_proj`` is row-parallel, and the conv's channels are three parts (q, k, v) split alike; a projection's
        per-tensor scales (``input_scale``, ``weight_scale_2``) cover any slice and are replicated; the rest as for
        Qwen3-MoE (``q_proj``'s rows are each head's query then gate, so heads split by rows)."""
        from ember.engine import distributed

        parent, _, leaf = name.rpartition(".")
        if ".linear_attn" not in name:
            return distributed._split_rule(name)
        if leaf in ("A_log", "dt_bias"):
            return "shard", 0
        if leaf not in ("weight", "bias", "weight_scale"):
            return "replicate", -1
        if parent.endswith(("in_proj_qkvz", "in_proj_ba")):
            return "shard", 0
        if parent.endswith("out_proj"):
            return ("rank0", -1) if leaf == "bias" else ("shard", 1)
        if parent.endswith("conv1d"):
            return "segments", 0, qkv_channel_parts(cfg)
        return "replicate", -1

    def checkpoint_name(self, name: str) -> str | None:
        """The multi-token-prediction head (``mtp.*``) is skipped."""
        return None if name.startswith("mtp.") else name
