"""Qwen2 / Qwen2.5: the shared decoder with biases on q/k/v (not on o), no q/k norm; a sliding window only where
config.json turns it on (``use_sliding_window``, from layer ``max_window_layers``)."""
from __future__ import annotations

from ember.engine.config import ModelConfig
from ember.engine.models.layers import Attention, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    qk_norm = False

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__(cfg, max_position)
        qkv_bias, o_bias = self.biases(cfg)
        for layer in self.model.layers:
            window = layer.self_attn.sliding_window
            layer.self_attn = Attention(cfg, qk_norm=False, qkv_bias=qkv_bias, o_bias=o_bias)
            layer.self_attn.sliding_window = window

    @staticmethod
    def biases(cfg: ModelConfig) -> tuple[bool, bool]:
        """Whether q/k/v and o have biases: Qwen2's q/k/v do, its o does not."""
        return True, False
