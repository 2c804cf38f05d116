"""Llama (and Llama-2 style checkpoints such as converted llama2.c models): the shared decoder without q/k norm."""
from __future__ import annotations

from ember.engine.models.layers import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    qk_norm = False
