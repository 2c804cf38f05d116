"""Qwen3-VL's language model (``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``), served for
text: Qwen3 (dense) or Qwen3-MoE under ``model.language_model.``; the vision tower (``model.visual.``) is not loaded.
Text positions are the same on the three multimodal rotary axes (``mrope_section``), so the rotary embedding is the
plain one, and the deepstack visual features only ever add to image positions.

The MoE checkpoints store each layer's experts fused, ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``,
either as transformers holds them (``[E, 2I, H]``, ``[E, H, I]``) or transposed (``[E, H, 2I]``, ``[E, I, H]``, as
the released checkpoints are); the loader takes either, and under tensor parallelism splits the dimension that holds
the intermediate channels.
"""
from __future__ import annotations

from ember.engine.config import ModelConfig
from ember.engine.models.layers import language_model_name
from ember.engine.models.qwen3 import Qwen3ForCausalLM
from ember.engine.models.qwen3_moe import Qwen3MoeForCausalLM


class Qwen3VLForCausalLM(Qwen3ForCausalLM):
    def checkpoint_name(self, name: str) -> str | None:
        return language_model_name(name)


class Qwen3VLMoeForCausalLM(Qwen3MoeForCausalLM):
    def checkpoint_name(self, name: str) -> str | None:
        return language_model_name(name)

    @staticmethod
    def tp_split_rule(name: str, cfg: ModelConfig) -> tuple:
        """A fused expert stack splits along whichever dimension holds the intermediate channels."""
        from ember.engine import distributed

        inter = int(cfg.raw.get("moe_intermediate_size") or 0)
        if name.endswith(".mlp.experts.gate_up_proj"):
            return "either_dim", 1, 2 * inter, 2
        if name.endswith(".mlp.experts.down_proj"):
            return "either_dim", 2, inter, 1
        return distributed._split_rule(name)
