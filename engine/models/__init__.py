"""Model implementations, looked up by the Hugging Face architecture name in config.json."""
from __future__ import annotations

from ember.engine.config import ConfigError
from ember.engine.models.layers import DecoderForCausalLM
from ember.engine.models.llama import LlamaForCausalLM
from ember.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str, source: str = "config.json") -> type[DecoderForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ConfigError(
            f"{source}: architecture {architecture!r} is not supported (supported: {', '.join(sorted(MODEL_REGISTRY))})"
        ) from None
