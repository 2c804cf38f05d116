"""Llama 4 (``Llama4ForConditionalGeneration``'s language model, ``Llama4ForCausalLM``): Scout and Maverick, for text.

- Attention: layers with RoPE (``no_rope_layers[i] == 1``) attend within chunks of ``attention_chunk_size`` positions
  (chunked attention in the kernels) and, with ``use_qk_norm``, norm q and k without weights; the other layers (NoPE,
  every fourth) attend over everything, their queries scaled by ``1 + attn_scale * log(1 + floor((pos + 1) /
  floor_scale))`` (``attn_temperature_tuning``). Llama 4 rotates interleaved pairs (channels ``2i``, ``2i + 1``);
  Ember's rotary turns halves, so the q/k projection rows of each head are permuted as they load (even channels
  first), which leaves every attention score unchanged.
- MLP: in ``moe_layers`` (every ``interleave_moe_layer_step``-th layer) a shared expert plus one routed expert per
  token (``num_experts_per_tok`` 1): the router's top logit, through a sigmoid, scales the token before the expert
  (not after it); the other layers have a dense MLP of ``intermediate_size_mlp``. The experts are stored fused and
  transposed (``feed_forward.experts.gate_up_proj [E, H, 2I]``).

Under tensor parallelism the attention splits by heads, the experts and the MLPs by intermediate channels.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

import torch
from torch import nn

from ember.engine import nvfp4_loading
from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models import qwen3_moe
from ember.engine.models.layers import Attention, DecoderLayer, GatedMLP, RMSNorm, language_model_name
from ember.kernels import moe_reference


_PER_ROW_QK = tuple(f".self_attn.{p}_proj.{leaf}" for p in "qk" for leaf in ("weight", "bias", "weight_scale",
                                                                              "weight_scale_inv"))
_QK = (".self_attn.q_proj", ".self_attn.k_proj")


class WeightlessRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps)`` in fp32, cast back (Llama 4's q/k norm has no weight)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Llama4MoE(qwen3_moe.SparseMoeBlock):
    """A shared expert plus the top-1 routed expert, fed the token scaled by its router score."""

    def __init__(self, cfg: ModelConfig, moe: dict, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(cfg, moe, device, dtype)
        self.shared_expert = GatedMLP(cfg)

    def _experts_out(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        top, ids = logits.topk(1, dim=-1)
        routed_in = x * torch.sigmoid(top.float()).to(x.dtype)
        ones = torch.ones(ids.shape, dtype=torch.float32, device=x.device)
        ids = ids.to(torch.int32)
        if nvfp4_loading.use_triton(x.device):
            routed = self.experts.triton(routed_in, ones, ids)
        else:
            routed = moe_reference.fused_moe(routed_in, *self.experts.stacks(), ones, ids)
        return routed + self.shared_expert.local(x)  # reduced with the routed part


def _uses_rope(cfg: ModelConfig) -> list[bool]:
    raw, n = cfg.raw, cfg.num_hidden_layers
    flags = raw.get("no_rope_layers")
    if not flags:
        interval = int(raw.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n:
        raise ConfigError(f"config.json: no_rope_layers has {len(flags)} entries for {n} layers")
    return [bool(f) for f in flags]


class Llama4DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, moe: dict | None, device: torch.device, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, qk_norm=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if moe is not None:
            self.mlp = Llama4MoE(cfg, moe, device, dtype)
        else:
            dense = int(cfg.raw.get("intermediate_size_mlp") or cfg.intermediate_size)
            self.mlp = GatedMLP(dataclasses.replace(cfg, intermediate_size=dense))


class _Body(qwen3_moe._Body):
    layer = Llama4DecoderLayer


class Llama4ForCausalLM(qwen3_moe.Qwen3MoeForCausalLM):
    """Llama 4's text decoder over the paged KV cache."""

    body = _Body

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__(cfg, max_position)
        raw = cfg.raw
        chunk = int(raw["attention_chunk_size"]) if raw.get("attention_chunk_size") else None
        tuning = raw.get("attn_temperature_tuning", True)
        for layer, rope in zip(self.model.layers, _uses_rope(cfg)):
            attn = layer.self_attn
            attn.use_rope = rope
            if rope:
                attn.chunk = chunk
                if raw.get("use_qk_norm", True):
                    attn.q_norm = attn.k_norm = WeightlessRMSNorm(cfg.rms_norm_eps)
            elif tuning:
                attn.q_position_scale = (float(raw.get("attn_scale", 0.1)), int(raw.get("floor_scale", 8192)), 1)

    @staticmethod
    def moe_settings(cfg: ModelConfig) -> tuple[dict, list[bool]]:
        raw, n = cfg.raw, cfg.num_hidden_layers
        moe = {"num_experts": int(raw.get("num_local_experts") or 0), "top_k": int(raw.get("num_experts_per_tok") or 0),
               "inter": cfg.intermediate_size, "norm_topk_prob": False}
        if moe["top_k"] != 1 or moe["num_experts"] < 1:
            raise ConfigError("config.json: Llama 4 needs num_local_experts >= 1 and num_experts_per_tok 1 (each "
                              "token's input is scaled by its one expert's score)")
        layers = raw.get("moe_layers")
        if layers is None:
            step = int(raw.get("interleave_moe_layer_step") or 1)
            layers = list(range(step - 1, n, step))
        return moe, [i in set(layers) for i in range(n)]

    @staticmethod
    def tp_split_rule(name: str, cfg: ModelConfig) -> tuple:
        """The fused, transposed expert stacks split along their intermediate channels; the rest as usual."""
        from ember.engine import distributed

        inter = cfg.intermediate_size
        if name.endswith(".feed_forward.experts.gate_up_proj"):
            return "either_dim", 2, 2 * inter, 2
        if name.endswith(".feed_forward.experts.down_proj"):
            return "either_dim", 1, inter, 1
        return distributed._split_rule(name)

    def checkpoint_name(self, name: str) -> str | None:
        """Ember's name of a language-model tensor (the vision tower and projector are skipped)."""
        name = language_model_name(name)
        if name is None:
            return None
        name = name.replace(".feed_forward.router.", ".mlp.gate.").replace(".feed_forward.", ".mlp.")
        return name

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """As the base loader, with q/k rows in halves (:meth:`_halves`). An FP8 checkpoint whose scale blocks span
        part of a head's rows (block rows neither 1 nor a multiple of ``head_dim``) has q/k dequantized as they load:
        reordered within a head, their rows would leave their scale blocks."""
        fmt = getattr(self, "fp8", None)
        if fmt is not None and fmt.block[0] != 1 and fmt.block[0] % self.config.head_dim:
            self.dense_only = type(self).dense_only + _QK
        super().load_weights(self._halves(weights), source)

    def _halves(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """q/k projection rows of each head reordered from interleaved pairs to halves (even channels first), with
        the scales that have one row per weight row (NVFP4's ``[N, K/16]``, per-channel FP8's ``[N, 1]``) moved
        with their rows; an FP8 block grid whose blocks span whole heads stays (rows move within their block)."""
        cfg, d = self.config, self.config.head_dim
        rows = {"q_proj": cfg.num_attention_heads * d, "k_proj": cfg.num_key_value_heads * d}
        perm = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
        for name, tensor in weights:
            if name.endswith(_PER_ROW_QK) and tensor.dim() >= 1 and tensor.shape[0] == rows[name.split(".")[-2]]:
                heads = tensor.reshape(tensor.shape[0] // d, d, *tensor.shape[1:])
                tensor = heads[:, perm].reshape(tensor.shape)
            yield name, tensor
