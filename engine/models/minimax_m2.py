"""MiniMax-M2 / M2.1 / M2.5 (``MiniMaxM2ForCausalLM``; bf16/fp16/fp32 or the block-FP8 release): grouped-query
attention with RMSNorms over the whole q and k projections (``q_norm`` ``[heads * head_dim]``) and neox RoPE on the
first ``rotary_dim`` channels of each head; in every layer a sparse MoE of ``num_local_experts`` experts of
``intermediate_size`` with sigmoid routing: experts chosen on ``sigmoid(logit) + e_score_correction_bias``, weighed by
their plain sigmoid scores renormalised (DeepSeek-V3's routing with one group; no shared experts).

The checkpoint names the experts ``block_sparse_moe.experts.E.w1`` (gate), ``w3`` (up), ``w2`` (down), the router
``block_sparse_moe.gate`` and its bias ``block_sparse_moe.e_score_correction_bias``; they load under Ember's names.
Multi-token-prediction modules are skipped. Under tensor parallelism the attention splits by heads (the q/k norm
weights with them, their mean square summed over the ranks) and the experts by intermediate channels.
"""
from __future__ import annotations

from torch import nn

from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models import deepseek_v3, mixtral, qwen3_moe
from ember.engine.models.layers import Attention, DecoderLayer, RMSNorm, partial_rotary_dim

class MiniMaxM2DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, moe: dict | None, device, dtype) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        attn = Attention(cfg, qk_norm=False, qkv_bias=False, o_bias=False)
        attn.q_norm = RMSNorm(cfg.num_attention_heads * cfg.head_dim, cfg.rms_norm_eps)
        attn.k_norm = RMSNorm(cfg.num_key_value_heads * cfg.head_dim, cfg.rms_norm_eps)
        attn.whole_qk_norm = True
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = deepseek_v3.DeepseekV3MoE(cfg, moe, device, dtype)


class _Body(qwen3_moe._Body):
    layer = MiniMaxM2DecoderLayer


class MiniMaxM2ForCausalLM(qwen3_moe.Qwen3MoeForCausalLM):
    """MiniMax-M2's decoder over the paged KV cache; experts load as Qwen3-MoE's do."""

    body = _Body

    @staticmethod
    def moe_settings(cfg: ModelConfig) -> tuple[dict, list[bool]]:
        scoring = cfg.raw.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"config.json: scoring_func {scoring!r} is not supported (sigmoid)")
        return mixtral.local_experts(cfg, "MiniMax-M2")

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        """``rotary_dim`` (the released config.json) or ``partial_rotary_factor`` of ``head_dim``."""
        return int(cfg.raw["rotary_dim"]) if cfg.raw.get("rotary_dim") else partial_rotary_dim(cfg)

    @staticmethod
    def tp_split_rule(name: str, cfg: ModelConfig) -> tuple[str, int]:
        """The experts as Mixtral's; the whole-projection q/k norm weights split as their projections' rows."""
        from ember.engine import distributed

        return mixtral.expert_split_rule(name) or distributed.whole_qk_norm_rule(name)

    def checkpoint_name(self, name: str) -> str | None:
        """Ember's name of a checkpoint tensor; None for the multi-token-prediction modules."""
        if ".mtp" in name or name.startswith("mtp") or deepseek_v3.prediction_layer(name, self.config):
            return None
        name = mixtral.expert_name(name)
        if name.endswith(".mlp.e_score_correction_bias"):
            return name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
        return name
