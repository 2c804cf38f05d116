"""Qwen3 dense: the shared decoder with per-head q/k RMSNorm applied before RoPE."""
from __future__ import annotations

from ember.engine.models.layers import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
