"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``; bf16/fp16/fp32, NVFP4 or block-FP8 checkpoints): grouped-query
attention with q/k/v biases (``attention_bias``; ``o_proj`` has none), optional per-head q/k RMSNorm
(``use_qk_norm``) and neox RoPE on the first ``partial_rotary_factor`` of each head; from layer
``first_k_dense_replace`` on, DeepSeek-V3's MoE (sigmoid group-limited routing with ``e_score_correction_bias``,
``routed_scaling_factor``, shared experts). Multi-token-prediction layers past ``num_hidden_layers`` (GLM ships one)
are skipped. Under tensor parallelism the attention splits by heads and the experts by intermediate channels, as in
Qwen3-MoE.
"""
from __future__ import annotations

import torch
from torch import nn

from ember.engine.config import ModelConfig
from ember.engine.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE
from ember.engine.models.layers import Attention, DecoderLayer, GatedMLP, RMSNorm, partial_rotary_dim


class Glm4MoeDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, moe: dict | None, device: torch.device, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, qk_norm=bool(cfg.raw.get("use_qk_norm", False)), o_bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekV3MoE(cfg, moe, device, dtype) if moe is not None else GatedMLP(cfg)


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: dict, sparse: list[bool], device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Glm4MoeDecoderLayer(cfg, moe if sparse[i] else None, device, dtype) for i in range(len(sparse)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.5's decoder over the paged KV cache; experts and their routing are DeepSeek-V3's."""

    body = _Body
    dense_only = ()
    rotary_dim = staticmethod(partial_rotary_dim)

    @staticmethod
    def tp_split_rule(name: str, cfg: ModelConfig) -> tuple[str, int]:
        from ember.engine import distributed

        return distributed._split_rule(name)

    def checkpoint_name(self, name: str) -> str | None:
        """Every tensor under its own name, but the multi-token-prediction layers past ``num_hidden_layers``."""
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() \
                and int(parts[2]) >= self.config.num_hidden_layers:
            return None
        return name
