"""IBM Granite 3.x dense (``GraniteForCausalLM``): the Llama decoder with four multipliers from config.json:
embeddings times ``embedding_multiplier``, a softmax scale of ``attention_multiplier`` (instead of
``head_dim ** -0.5``), each sublayer's output times ``residual_multiplier`` before it joins the residual stream, and
logits divided by ``logits_scaling``."""
from __future__ import annotations

from types import ModuleType

import torch

from ember.engine.attention import AttentionMetadata
from ember.engine.config import ModelConfig
from ember.engine.models.layers import DecoderLayer, RotaryEmbedding
from ember.engine.models.llama import LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    residual_multiplier = 1.0

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                rope: RotaryEmbedding, kv: tuple[torch.Tensor, torch.Tensor],
                backend: ModuleType) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = (self.input_layernorm(h), h) if residual is None else self.input_layernorm(h, residual)
        h = self.self_attn(x, meta, rope, kv, backend) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    layer = GraniteDecoderLayer

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__(cfg, max_position)
        raw = cfg.raw
        self.embedding_multiplier = float(raw.get("embedding_multiplier", 1.0))
        self.logits_scaling = float(raw.get("logits_scaling", 1.0))
        for layer in self.model.layers:
            layer.residual_multiplier = float(raw.get("residual_multiplier", 1.0))
            layer.self_attn.scale = float(raw.get("attention_multiplier", cfg.head_dim ** -0.5))

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: ModuleType) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids) * self.embedding_multiplier
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches):
            h, residual = layer(h, residual, meta, self.rope, kv, backend)
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
