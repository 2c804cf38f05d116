"""Gemma 3 (``Gemma3ForCausalLM``, and the language model of ``Gemma3ForConditionalGeneration``) and Gemma 2
(``Gemma2ForCausalLM``): embeddings scaled by ``sqrt(hidden_size)``; zero-centred RMSNorms (``1 + w``) before and
after both the attention and the MLP; a softmax scale of ``query_pre_attn_scalar ** -0.5``; a GELU (tanh) gated MLP;
soft-caps on the attention scores (``attn_logit_softcapping``, Gemma 2 only: transformers' Gemma 3 ignores it) and
the final logits (``final_logit_softcapping``) where config.json sets them.

Gemma 3 adds per-head q/k norms. Layers alternate by ``layer_types`` (or, as older config.json files say, every
``sliding_window_pattern``-th layer global: 6 for Gemma 3, 2 for Gemma 2): ``sliding_attention`` layers attend over
the last ``sliding_window`` keys, ``full_attention`` layers over everything. Gemma 3's local layers have their own
RoPE (theta ``rope_local_base_freq``), its global ones ``rope_theta`` and ``rope_scaling`` (transformers 5 writes
both under ``rope_parameters`` by layer type); Gemma 2 has one RoPE for all.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from ember.engine.attention import AttentionMetadata
from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models.layers import (Attention, DecoderForCausalLM, GatedMLP, OffsetRMSNorm, RotaryEmbedding,
                                        language_model_name)

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


def layer_types(cfg: ModelConfig, default_pattern: int = 6) -> list[str]:
    """Each layer's kind, ``sliding_attention`` or ``full_attention``, as transformers reads config.json."""
    raw = cfg.raw
    types = raw.get("layer_types")
    if types:
        if len(types) != cfg.num_hidden_layers:
            raise ConfigError(f"config.json: layer_types has {len(types)} entries for {cfg.num_hidden_layers} layers")
        return list(types)
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or default_pattern)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(cfg.num_hidden_layers)]


def rope_settings(cfg: ModelConfig, layer_type: str) -> tuple[float, dict | None]:
    """``(theta, scaling)`` of one layer kind's RoPE."""
    raw = cfg.raw
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        p = params[layer_type]
        kind = p.get("rope_type", p.get("type", "default"))
        if kind == "default":
            return float(p.get("rope_theta", 10000.0)), None
        p = dict(p, rope_type=kind)
        if kind in ("llama3", "yarn", "longrope") and p.get("original_max_position_embeddings") is None:
            p["original_max_position_embeddings"] = cfg.max_position_embeddings  # as transformers fills it
        return float(p.get("rope_theta", 10000.0)), p
    if layer_type == "sliding_attention":
        return float(raw.get("rope_local_base_freq", 10000.0)), None
    return float(raw.get("rope_theta", 1_000_000.0)), cfg.rope_scaling


class GeluTanhMLP(GatedMLP):
    """``down(gelu_tanh(gate(x)) * up(x))``; on the Triton path the activation-and-mul is one kernel
    (`ember.kernels.activation.gelu_tanh_and_mul`)."""

    def local(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.triton:
            from ember.kernels import activation

            return self.down_proj(activation.gelu_tanh_and_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """Pre- and post-norms around the attention and the MLP, each added to the residual stream: by the next pre-norm,
    fused (one launch on the Triton path), as `DecoderLayer` adds its sublayers."""

    def __init__(self, cfg: ModelConfig, window: int | None, qk_norm: bool, attn_softcap: bool) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg, qk_norm=False)
        if qk_norm:
            self.self_attn.q_norm = OffsetRMSNorm(cfg.head_dim, eps)
            self.self_attn.k_norm = OffsetRMSNorm(cfg.head_dim, eps)
        self.self_attn.scale = float(cfg.raw.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
        self.self_attn.sliding_window = window
        if attn_softcap:
            self.self_attn.softcap = float(cfg.raw.get("attn_logit_softcapping") or 0.0) or None
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.mlp = GeluTanhMLP(cfg)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                rope: RotaryEmbedding, kv: tuple[torch.Tensor, torch.Tensor],
                backend: ModuleType) -> tuple[torch.Tensor, torch.Tensor]:
        """``(post-normed MLP output, residual stream)``: the stream is ``h + residual`` (``h`` alone for the first
        layer); the next layer's input norm (or the final norm) adds them."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        attn = self.post_attention_layernorm(self.self_attn(x, meta, rope, kv, backend))
        x, residual = self.pre_feedforward_layernorm(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig, windows: list[int | None], qk_norm: bool, attn_softcap: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, w, qk_norm, attn_softcap) for w in windows)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3's decoder over the paged KV cache, from the text-only or the multimodal checkpoint layout."""

    qk_norm = True
    attn_softcap = False  # transformers' Gemma 3 reads no attn_logit_softcapping
    local_rope = True  # sliding layers have their own RoPE
    default_pattern = 6  # every 6th layer global, when config.json has no layer_types

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        nn.Module.__init__(self)
        raw = cfg.raw
        if raw.get("use_bidirectional_attention"):
            raise ConfigError("config.json: use_bidirectional_attention is not supported (a decoder is causal)")
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GELU_TANH:
            raise ConfigError(f"config.json: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        self.config = cfg
        self.layer_types = layer_types(cfg, self.default_pattern)
        window = int(raw["sliding_window"]) if raw.get("sliding_window") else None
        self.model = _Body(cfg, [window if t == "sliding_attention" else None for t in self.layer_types], self.qk_norm,
                           self.attn_softcap)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.local_rope:
            self.rope = RotaryEmbedding(cfg.head_dim, max_position, *rope_settings(cfg, "full_attention"))
            self.rope_local = RotaryEmbedding(cfg.head_dim, max_position, *rope_settings(cfg, "sliding_attention"))
        else:
            self.rope = self.rope_local = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.softcap = float(raw.get("final_logit_softcapping") or 0.0)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: ModuleType) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype).item()  # the scale as rounded to h's dtype
        residual = None
        for layer, kind, kv in zip(self.model.layers, self.layer_types, kv_caches):
            h, residual = layer(h, residual, meta, self.rope_local if kind == "sliding_attention" else self.rope, kv,
                                backend)
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def checkpoint_name(self, name: str) -> str | None:
        return language_model_name(name)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's layers without q/k norms, one RoPE, every other layer global, soft-capped attention."""

    qk_norm = False
    attn_softcap = True
    local_rope = False
    default_pattern = 2
