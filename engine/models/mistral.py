"""Mistral: the Llama decoder; config.json's ``sliding_window`` (None in most checkpoints since v0.2), when set,
limits every layer's attention to that many positions."""
from __future__ import annotations

from ember.engine.models.layers import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    qk_norm = False
