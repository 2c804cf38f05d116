"""Qwen2-MoE (``Qwen2MoeForCausalLM``: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (biases on q/k/v, no q/k
norm; a sliding window only where config.json turns it on) and, in the sparse layers (``decoder_sparse_step``,
``mlp_only_layers``), Qwen3-MoE's softmax-routed experts plus a shared expert scaled by
``sigmoid(shared_expert_gate(x))``; the other layers use the dense gated MLP of ``intermediate_size``."""
from __future__ import annotations

import torch
from torch import nn

from ember.engine.config import ModelConfig
from ember.engine.models import qwen3_moe
from ember.engine.models.layers import Attention, DecoderLayer, GatedMLP, RMSNorm


class Qwen2MoeDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, moe: dict | None, device: torch.device, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, qk_norm=False, qkv_bias=True, o_bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = qwen3_moe.SharedExpertMoeBlock(cfg, moe, device, dtype) if moe is not None else GatedMLP(cfg)


class _Body(qwen3_moe._Body):
    layer = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(qwen3_moe.Qwen3MoeForCausalLM):
    """Qwen2-MoE over the paged KV cache; experts load as Qwen3-MoE's do."""

    qk_norm = False
    body = _Body
