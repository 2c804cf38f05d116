"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``; bf16/fp16/fp32, NVFP4 or block-FP8 checkpoints): grouped-query
attention with q/k/v biases (``attention_bias``; ``o_proj`` has none), optional per-head q/k RMSNorm
(``use_qk_norm``) and neox RoPE on the first ``partial_rotary_factor`` of each head; from layer
``first_k_dense_replace`` on, DeepSeek-V3's MoE (sigmoid group-limited routing with ``e_score_correction_bias``,
``routed_scaling_factor``, shared experts). Multi-token-prediction layers past ``num_hidden_layers`` (GLM ships one)
are skipped. Under tensor parallelism the attention splits by heads and the experts by intermediate channels, as in
Qwen3-MoE.
"""
from __future__ import annotations

from torch import nn

from ember.engine.config import ModelConfig
from ember.engine.models import deepseek_v3
from ember.engine.models.layers import Attention, partial_rotary_dim


class Glm4MoeDecoderLayer(deepseek_v3.DeepseekV3DecoderLayer):
    @staticmethod
    def attention(cfg: ModelConfig) -> nn.Module:
        return Attention(cfg, qk_norm=bool(cfg.raw.get("use_qk_norm", False)), o_bias=False)


class _Body(deepseek_v3._Body):
    layer = Glm4MoeDecoderLayer


class Glm4MoeForCausalLM(deepseek_v3.DeepseekV3ForCausalLM):
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
        return None if deepseek_v3.prediction_layer(name, self.config) else name
