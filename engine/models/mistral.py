"""Mistral: the Llama decoder; config.json's ``sliding_window`` (None in most checkpoints since v0.2), when set,
limits every layer's attention to that many positions. ``Mistral3ForConditionalGeneration`` (Mistral Small 3.x,
Magistral, Devstral) serves its language model, this decoder, from the multimodal checkpoint layout."""
from __future__ import annotations

from typing import Iterable

import torch

from ember.engine.models.layers import DecoderForCausalLM, language_model_name


class MistralForCausalLM(DecoderForCausalLM):
    qk_norm = False


class Mistral3ForCausalLM(MistralForCausalLM):
    """The language model of a Mistral 3 multimodal checkpoint (its vision tower and projector are not loaded)."""

    def checkpoint_name(self, name: str) -> str | None:
        return language_model_name(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        super().load_weights(self.renamed(weights), source)
