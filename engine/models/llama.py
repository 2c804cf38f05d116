"""Llama (and Llama-2 style checkpoints such as converted llama2.c models): the shared decoder without q/k norm.
SmolLM3 is this decoder with RoPE left out of every ``no_rope_layer_interval``-th layer (``no_rope_layers``: 1 where
a layer turns its queries and keys, 0 where it does not)."""
from __future__ import annotations

from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models.layers import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    qk_norm = False


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__(cfg, max_position)
        raw, n = cfg.raw, cfg.num_hidden_layers
        uses = raw.get("no_rope_layers")
        if uses is None:
            interval = int(raw.get("no_rope_layer_interval") or 4)
            uses = [int((i + 1) % interval != 0) for i in range(n)]
        if len(uses) != n:
            raise ConfigError(f"config.json: no_rope_layers has {len(uses)} entries for {n} layers")
        types = raw.get("layer_types") or ["sliding_attention" if raw.get("sliding_window") and not u
                                           else "full_attention" for u in uses]
        window = int(raw["sliding_window"]) if raw.get("use_sliding_window") and raw.get("sliding_window") else None
        for layer, use, kind in zip(self.model.layers, uses, types):
            layer.self_attn.use_rope = bool(use)
            layer.self_attn.sliding_window = window if kind == "sliding_attention" else None
