"""Seed-OSS (``SeedOssForCausalLM``, ByteDance Seed-OSS-36B): Qwen2's decoder with its biases as config.json says:
on q/k/v (``attention_bias``), on ``o_proj`` (``attention_out_bias``) and on the MLP (``mlp_bias``)."""
from __future__ import annotations

from ember.engine.config import ModelConfig
from ember.engine.models.qwen2 import Qwen2ForCausalLM


class SeedOssForCausalLM(Qwen2ForCausalLM):
    @staticmethod
    def biases(cfg: ModelConfig) -> tuple[bool, bool]:
        return cfg.attention_bias, bool(cfg.raw.get("attention_out_bias", False))
