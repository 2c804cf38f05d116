"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): the Llama decoder with q/k/v and gate/up fused in the checkpoint
(``self_attn.qkv_proj``, ``mlp.gate_up_proj``; split into their parts as they load, and under tensor parallelism each
part split evenly) and RoPE on the first ``partial_rotary_factor`` of each head, LongRoPE included (Phi-3.5's and
Phi-4-mini's long contexts: `ember.engine.models.layers.rope_inv_freq`)."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from ember.engine import nvfp4_loading
from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models.layers import DecoderForCausalLM, RotaryEmbedding, partial_rotary_dim


class Phi3ForCausalLM(DecoderForCausalLM):
    qk_norm = False

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__(cfg, max_position)
        self.rope = RotaryEmbedding(partial_rotary_dim(cfg), max_position, cfg.rope_theta, cfg.rope_scaling)

    def _parts(self, fused: str) -> list[tuple[str, int]]:
        sizes = self._shard_sizes("qkv_proj") if fused == "qkv_proj" else [self.config.intermediate_size] * 2
        names = ("q_proj", "k_proj", "v_proj") if fused == "qkv_proj" else ("gate_proj", "up_proj")
        return list(zip(names, sizes))

    @staticmethod
    def tp_split_rule(name: str, cfg: ModelConfig) -> tuple:
        """The checkpoint's fused q/k/v and gate/up rows (and NVFP4 block scales) split part by part; the rest as
        usual."""
        from ember.engine import distributed

        module, _, leaf = name.rpartition(".")
        if leaf in ("weight", "weight_scale") and module.endswith(".self_attn.qkv_proj"):
            d = cfg.head_dim
            return "segments", 0, (cfg.num_attention_heads * d, cfg.num_key_value_heads * d,
                                   cfg.num_key_value_heads * d)
        if leaf in ("weight", "weight_scale") and module.endswith(".mlp.gate_up_proj"):
            return "segments", 0, (cfg.intermediate_size, cfg.intermediate_size)
        return distributed._split_rule(name)

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            module, _, leaf = name.rpartition(".")
            fused = module.rpartition(".")[2]
            if leaf != "weight" or fused not in ("qkv_proj", "gate_up_proj"):
                yield name, tensor
                continue
            parts = self._parts(fused)
            if tensor.shape[0] != sum(size for _, size in parts):
                raise ConfigError(f"tensor {name!r} has {tensor.shape[0]} rows, expected "
                                  f"{' + '.join(str(size) for _, size in parts)}")
            start = 0
            for part, size in parts:
                yield f"{module.rpartition('.')[0]}.{part}.weight", tensor[start:start + size]
                start += size

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """NVFP4 fused projections stay fused (one packed linear each, with the checkpoint's one tensor scale); the
        other fused weights are split into their parts."""
        prepared = nvfp4_loading.prepare(self, weights, source)
        super().load_weights(nvfp4_loading.PreparedWeights(self._unfused(prepared)), source)
