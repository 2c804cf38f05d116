"""Mistral: the Llama decoder; config.json's ``sliding_window`` (None in most checkpoints since v0.2), when set,
limits every layer's attention to that many positions. Ministral 3 / Mistral Large 3 (``Ministral3ForCausalLM``)
add an attention temperature past the YaRN context (``rope_parameters.llama_4_scaling_beta``).
``Mistral3ForConditionalGeneration`` (Mistral Small 3.x, Magistral, Devstral, Ministral 3) serves its language
model, one of these decoders, from the multimodal checkpoint layout."""
from __future__ import annotations

from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models.layers import DecoderForCausalLM, language_model_name


class MistralForCausalLM(DecoderForCausalLM):
    qk_norm = False

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__(cfg, max_position)
        rope = cfg.rope_scaling or {}
        beta = rope.get("llama_4_scaling_beta")
        if beta:
            length = rope.get("original_max_position_embeddings")
            if not length:
                raise ConfigError("config.json: llama_4_scaling_beta needs rope_parameters."
                                  "original_max_position_embeddings")
            for layer in self.model.layers:
                layer.self_attn.q_position_scale = (float(beta), int(length), 0)


class Mistral3ForCausalLM(MistralForCausalLM):
    """The language model of a Mistral 3 multimodal checkpoint (its vision tower and projector are not loaded)."""

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        if cfg.model_type not in ("mistral", "ministral3"):
            raise ConfigError(f"config.json: text_config.model_type {cfg.model_type!r} is not supported in "
                              "Mistral3ForConditionalGeneration (mistral, ministral3)")
        super().__init__(cfg, max_position)

    def checkpoint_name(self, name: str) -> str | None:
        return language_model_name(name)
