"""Model implementations, looked up by the Hugging Face architecture name in config.json.

Registry values are classes or ``"module:Class"`` strings imported on first lookup (Qwen3-MoE pulls in the NVFP4 and
MoE kernels, which dense models never need).
"""
from __future__ import annotations

import importlib

from ember.engine.config import ENCODER_ARCHITECTURES, ConfigError
from ember.engine.models.classifier import causal_architecture
from ember.engine.models.layers import DecoderForCausalLM
from ember.engine.models.llama import LlamaForCausalLM, SmolLM3ForCausalLM
from ember.engine.models.mistral import Mistral3ForCausalLM, MistralForCausalLM
from ember.engine.models.qwen2 import Qwen2ForCausalLM
from ember.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM] | str] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Olmo2ForCausalLM": "ember.engine.models.olmo:OlmoForCausalLM",
    "Olmo3ForCausalLM": "ember.engine.models.olmo:OlmoForCausalLM",
    "GraniteForCausalLM": "ember.engine.models.granite:GraniteForCausalLM",
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "SeedOssForCausalLM": "ember.engine.models.seed_oss:SeedOssForCausalLM",
    "MistralForCausalLM": MistralForCausalLM,
    "Mistral3ForConditionalGeneration": Mistral3ForCausalLM,
    "Ministral3ForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": "ember.engine.models.phi3:Phi3ForCausalLM",
    "MixtralForCausalLM": "ember.engine.models.mixtral:MixtralForCausalLM",
    "Llama4ForCausalLM": "ember.engine.models.llama4:Llama4ForCausalLM",
    "Llama4ForConditionalGeneration": "ember.engine.models.llama4:Llama4ForCausalLM",
    "Qwen2MoeForCausalLM": "ember.engine.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "ember.engine.models.qwen3_moe:Qwen3MoeForCausalLM",
    "GptOssForCausalLM": "ember.engine.models.gpt_oss:GptOssForCausalLM",
    "DeepseekV3ForCausalLM": "ember.engine.models.deepseek_v3:DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM": "ember.engine.models.glm4_moe:Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM": "ember.engine.models.minimax_m2:MiniMaxM2ForCausalLM",
    "Gemma2ForCausalLM": "ember.engine.models.gemma3:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "ember.engine.models.gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "ember.engine.models.gemma3:Gemma3ForCausalLM",
    "Qwen3VLForConditionalGeneration": "ember.engine.models.qwen3_vl:Qwen3VLForCausalLM",
    "Qwen3VLMoeForConditionalGeneration": "ember.engine.models.qwen3_vl:Qwen3VLMoeForCausalLM",
    "Qwen3NextForCausalLM": "ember.engine.models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": "ember.engine.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "ember.engine.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "ember.engine.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "ember.engine.models.qwen3_5:Qwen3_5ForCausalLM",
}


def get_model_class(architecture: str, source: str = "config.json") -> type[DecoderForCausalLM]:
    """The class serving ``architecture``; a ``*ForSequenceClassification`` one gets its causal LM's class (the
    engine swaps the LM head for the classifier's, `ember.engine.models.classifier`); an encoder
    (`ember.engine.config.ENCODER_ARCHITECTURES`) gets `ember.engine.models.bert.BertEncoderModel`."""
    if architecture in ENCODER_ARCHITECTURES:
        from ember.engine.models.bert import BertEncoderModel

        return BertEncoderModel  # type: ignore[return-value]
    try:
        entry = MODEL_REGISTRY[causal_architecture(architecture) or architecture]
    except KeyError:
        raise ConfigError(
            f"{source}: architecture {architecture!r} is not supported (supported: "
            f"{', '.join(sorted(MODEL_REGISTRY | dict.fromkeys(ENCODER_ARCHITECTURES)))}, and the "
            f"...ForSequenceClassification form of each ...ForCausalLM)"
        ) from None
    if isinstance(entry, str):
        module, name = entry.split(":")
        entry = getattr(importlib.import_module(module), name)
    return entry
