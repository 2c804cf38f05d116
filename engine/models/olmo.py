"""OLMo 2 / OLMo 3 (``Olmo2ForCausalLM``, ``Olmo3ForCausalLM``): post-norm decoder layers (each sublayer's output is
normed before it joins the residual stream; no norm before the sublayers), q/k RMSNorms over the whole q / k
projections, and norms that multiply by their weight in fp32 before casting back. OLMo 3 alternates sliding-window
layers with global ones by ``layer_types``, each kind with its own RoPE (``rope_parameters`` by layer type, as
Gemma 3). Under tensor parallelism each rank holds its heads' share of the q/k norm weights (`Attention`)."""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from ember.engine.attention import AttentionMetadata
from ember.engine.config import ModelConfig
from ember.engine.models.gemma3 import rope_settings
from ember.engine.models.layers import Attention, DecoderForCausalLM, GatedMLP, RotaryEmbedding


class OlmoRMSNorm(nn.Module):
    """``(w * x * rsqrt(mean(x^2) + eps))`` in fp32, then cast (the weight applied before the cast)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.normed(xf, xf.pow(2).mean(-1, keepdim=True), x.dtype)

    def normed(self, xf: torch.Tensor, variance: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`forward` of fp32 ``xf`` whose ``variance`` the caller reduced (see `RMSNorm.normed`)."""
        return (self.weight.float() * xf * torch.rsqrt(variance + self.eps)).to(dtype)


class OlmoDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg, qk_norm=False)
        self.self_attn.q_norm = OlmoRMSNorm(cfg.num_attention_heads * cfg.head_dim, eps)
        self.self_attn.k_norm = OlmoRMSNorm(cfg.num_key_value_heads * cfg.head_dim, eps)
        self.self_attn.whole_qk_norm = True
        self.self_attn.sliding_window = window
        self.post_attention_layernorm = OlmoRMSNorm(cfg.hidden_size, eps)
        self.mlp = GatedMLP(cfg)
        self.post_feedforward_layernorm = OlmoRMSNorm(cfg.hidden_size, eps)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, rope: RotaryEmbedding,
                kv: tuple[torch.Tensor, torch.Tensor], backend: ModuleType) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(h, meta, rope, kv, backend))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig, windows: list[int | None]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OlmoDecoderLayer(cfg, w) for w in windows)
        self.norm = OlmoRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class OlmoForCausalLM(DecoderForCausalLM):
    """OLMo 2 (every layer global, one RoPE) and OLMo 3 (``layer_types``)."""

    @staticmethod
    def tp_split_rule(name: str, cfg: ModelConfig) -> tuple[str, int]:
        from ember.engine import distributed

        return distributed.whole_qk_norm_rule(name)

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        nn.Module.__init__(self)
        raw = cfg.raw
        self.config = cfg
        types = raw.get("layer_types") or ["full_attention"] * cfg.num_hidden_layers
        window = int(raw["sliding_window"]) if raw.get("sliding_window") else None
        self.layer_types = list(types)
        self.model = _Body(cfg, [window if t == "sliding_attention" else None for t in types])
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        per_type = isinstance(raw.get("rope_parameters"), dict) and "full_attention" in raw["rope_parameters"]
        if per_type:
            self.rope = RotaryEmbedding(cfg.head_dim, max_position, *rope_settings(cfg, "full_attention"))
            self.rope_local = RotaryEmbedding(cfg.head_dim, max_position, *rope_settings(cfg, "sliding_attention"))
        else:
            self.rope = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
            self.rope_local = self.rope

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: ModuleType) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        for layer, kind, kv in zip(self.model.layers, self.layer_types, kv_caches):
            h = layer(h, meta, self.rope_local if kind == "sliding_attention" else self.rope, kv, backend)
        return self.model.norm(h)
