"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; bf16/fp16/fp32, NVFP4 or block-FP8 checkpoints): multi-head latent
attention (MLA) over the paged KV cache, and a MoE with sigmoid group-limited routing and shared experts.

MLA runs in its absorbed form, so the cache holds the compressed latent, one "KV head" of ``kv_lora_rank +
qk_rope_head_dim`` per token (`ember.engine.config.ModelConfig` gives the runner that geometry): per head,
``q_lat = q_nope @ W_UK`` (``kv_b_proj``'s key rows) is scored against ``c_kv`` and ``q_pe`` against the shared
roped ``k_pe``; the value is ``c_kv`` itself (cached beside zeros in the rope slots), and the output latent goes
through ``W_UV`` (``kv_b_proj``'s value rows) before ``o_proj``. The scores equal the expanded form's
``q . [k_nope | k_pe]`` exactly, so the shared paged attention (reference or Triton, GQA with every query head on the
one latent head) serves it unchanged. RoPE acts on interleaved pairs (``rope_interleave``): the pairs are
de-interleaved into halves first (the same permutation on q and k), then the shared neox rotation applies. Softmax
scale ``(qk_nope + qk_rope) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN.

Layers ``< first_k_dense_replace`` use the dense gated MLP; the others route each token to ``num_experts_per_tok``
of ``n_routed_experts`` (:func:`ember.kernels.moe_reference.grouped_topk_routing`) and add the shared experts
(a gated MLP of ``moe_intermediate_size * n_shared_experts``). Multi-token-prediction layers past
``num_hidden_layers`` in a checkpoint are skipped.

Under tensor parallelism each rank keeps a contiguous share of the heads (``q_b_proj`` / ``q_proj`` and
``kv_b_proj`` rows, ``o_proj`` columns) and of every expert's intermediate channels; the latent projections
(``q_a_proj``, ``kv_a_proj_with_mqa``), their norms and the router are replicated, and so is the latent cache: each
rank attends its heads over the whole latent, as vLLM does.
"""
from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import Iterable

import torch
from torch import nn

from ember.engine.attention import AttentionMetadata
from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models.layers import DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding
from ember.engine.models import qwen3_moe
from ember.engine.models.qwen3_moe import MoEExperts, Qwen3MoeForCausalLM, SparseMoeBlock
from ember.engine.nvfp4_loading import use_triton
from ember.kernels import moe_reference


def prediction_layer(name: str, cfg: ModelConfig) -> bool:
    """Whether checkpoint tensor ``name`` belongs to a multi-token-prediction layer (``model.layers.N`` with N past
    ``num_hidden_layers``), which the served model does not run."""
    parts = name.split(".")
    return len(parts) > 2 and parts[1] == "layers" and parts[2].isascii() and parts[2].isdigit() \
        and int(parts[2]) >= cfg.num_hidden_layers


class MLAttention(nn.Module):
    """Multi-head latent attention in absorbed form over the latent paged cache (see the module doc)."""

    tp = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        raw = cfg.raw
        self.h = cfg.num_attention_heads
        self.nope, self.rope_dim = cfg.raw_int("qk_nope_head_dim"), cfg.raw_int("qk_rope_head_dim")
        self.v_dim, self.lora = cfg.raw_int("v_head_dim"), cfg.raw_int("kv_lora_rank")
        self.q_lora = raw.get("q_lora_rank")
        bias = bool(raw.get("attention_bias", False))
        qk = self.nope + self.rope_dim
        if self.q_lora:
            self.q_a_proj = nn.Linear(cfg.hidden_size, self.q_lora, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora, self.h * qk, bias=False)
        else:
            self.q_proj_mla = nn.Linear(cfg.hidden_size, self.h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.lora + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.lora, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.lora, self.h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.h * self.v_dim, cfg.hidden_size, bias=bias)
        self.interleave = bool(raw.get("rope_interleave", True))
        self.scale = qk ** -0.5
        scaling = cfg.rope_scaling or {}  # any scaled RoPE (None: default) scales the softmax, as transformers does
        if scaling.get("mscale_all_dim"):
            factor = float(scaling["factor"])
            m = 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
            self.scale *= m * m

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.interleave else x

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, rope: RotaryEmbedding,
                kv: tuple[torch.Tensor, torch.Tensor], backend: ModuleType) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj_mla(x)
        q_nope, q_pe = q.view(t, self.h, -1).split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.lora, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = rope(meta.positions, self._deinterleave(q_pe), self._deinterleave(k_pe).unsqueeze(1))
        w = self.kv_b_proj.weight.view(self.h, self.nope + self.v_dim, self.lora)
        q_lat = torch.einsum("thn,hnl->thl", q_nope, w[:, :self.nope])
        query = torch.cat((q_lat, q_pe), dim=-1).contiguous()
        key = torch.cat((c_kv.unsqueeze(1), k_pe), dim=-1).contiguous()
        value = torch.cat((c_kv.unsqueeze(1), torch.zeros_like(k_pe)), dim=-1).contiguous()
        k_cache, v_cache = kv
        backend.reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        backend.paged_attention(query, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                                meta.block_table, meta.max_seqlen_q, meta.max_seqlen_k, self.scale)
        o = torch.einsum("thl,hvl->thv", out[..., :self.lora], w[:, self.nope:])
        out = self.o_proj(o.reshape(t, self.h * self.v_dim))
        return out if self.tp is None else self.tp.all_reduce(out)


class Router(nn.Module):
    """The router's fp32-computed logits and its ``e_score_correction_bias`` (checkpoint names ``gate.weight``,
    ``gate.e_score_correction_bias``)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight.float())


class DeepseekV3MoE(SparseMoeBlock):
    """Routed experts (grouped sigmoid top-k) plus the shared experts."""

    def __init__(self, cfg: ModelConfig, moe: dict, device: torch.device, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        raw = cfg.raw
        self.top_k = moe["top_k"]
        self.groups, self.topk_groups = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
        if moe["num_experts"] % self.groups or not 1 <= self.topk_groups <= self.groups:
            raise ConfigError("config.json: n_group must divide n_routed_experts and 1 <= topk_group <= n_group")
        self.norm_topk_prob = moe["norm_topk_prob"]
        self.scaling = float(raw.get("routed_scaling_factor") or 1.0)
        self.gate = Router(cfg.hidden_size, moe["num_experts"])
        self.experts = MoEExperts(moe["num_experts"], cfg.hidden_size, moe["inter"], dtype, device)
        shared = moe["inter"] * int(raw.get("n_shared_experts") or 0)
        self.shared_experts = GatedMLP(dataclasses.replace(cfg, intermediate_size=shared)) if shared else None

    def _experts_out(self, x: torch.Tensor) -> torch.Tensor:
        topk_w, topk_ids = moe_reference.grouped_topk_routing(
            self.gate(x), self.gate.e_score_correction_bias, self.top_k, self.groups, self.topk_groups,
            self.norm_topk_prob, self.scaling)
        w13, w2 = self.experts.stacks()
        if use_triton(x.device):
            from ember.kernels import moe

            out = moe.fused_moe(x, w13, w2, topk_w, topk_ids)
        else:
            out = moe_reference.fused_moe(x, w13, w2, topk_w, topk_ids)
        return out if self.shared_experts is None else out + self.shared_experts.local(x)  # reduced with `out`


class DeepseekV3DecoderLayer(DecoderLayer):
    """Latent attention (``attention``; GLM-4.5 brings its own) + DeepSeek's MoE, or the dense gated MLP."""

    @staticmethod
    def attention(cfg: ModelConfig) -> nn.Module:
        return MLAttention(cfg)

    def __init__(self, cfg: ModelConfig, moe: dict | None, device: torch.device, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekV3MoE(cfg, moe, device, dtype) if moe is not None else GatedMLP(cfg)


class _Body(qwen3_moe._Body):
    layer = DeepseekV3DecoderLayer


class DeepseekV3ForCausalLM(Qwen3MoeForCausalLM):
    """DeepSeek-V3 over the latent paged KV cache; experts load as Qwen3-MoE's do (per-expert or fused keys)."""

    body = _Body
    dense_only = (".kv_b_proj",)
    """Projections the absorbed MLA reads as weights: an FP8 one is dequantized on load, an NVFP4 one refused."""

    @staticmethod
    def moe_settings(cfg: ModelConfig) -> tuple[dict, list[bool]]:
        """Routed experts from layer ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer."""
        raw = cfg.raw
        num_experts = int(raw.get("n_routed_experts") or 0)
        first_dense = int(raw.get("first_k_dense_replace") or 0)
        step = int(raw.get("moe_layer_freq") or 1)
        sparse = [num_experts > 0 and i >= first_dense and i % step == 0 for i in range(cfg.num_hidden_layers)]
        moe = {"num_experts": num_experts, "top_k": int(raw.get("num_experts_per_tok") or 0),
               "inter": int(raw.get("moe_intermediate_size") or 0),
               "norm_topk_prob": bool(raw.get("norm_topk_prob", True))}
        if any(sparse) and not (1 <= moe["top_k"] <= num_experts and moe["inter"] > 0):
            raise ConfigError("config.json: DeepSeek-V3 needs 1 <= num_experts_per_tok <= n_routed_experts and "
                              "moe_intermediate_size > 0")
        return moe, sparse

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        return cfg.raw_int("qk_rope_head_dim")

    @staticmethod
    def tp_split_rule(name: str, cfg: ModelConfig) -> tuple[str, int]:
        """MLA's per-head up-projections split their rows like q/k/v (see the module doc); the rest as usual."""
        from ember.engine import distributed

        module, _, leaf = name.rpartition(".")
        if module.endswith((".self_attn.q_b_proj", ".self_attn.kv_b_proj")) and leaf in ("weight", "weight_scale"):
            return "shard", 0
        return distributed._split_rule(name)

    def checkpoint_name(self, name: str) -> str | None:
        """``self_attn.q_proj`` (no q LoRA) is ``q_proj_mla`` here (not a fused q/k/v part); multi-token-prediction
        layers past ``num_hidden_layers`` are skipped."""
        if prediction_layer(name, self.config):
            return None
        return name.replace(".self_attn.q_proj.", ".self_attn.q_proj_mla.")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """Qwen3-MoE's loader, refusing FP8 scales that config.json gives no format for."""
        fp8 = getattr(self, "fp8", None) is not None

        def checked() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.endswith(".weight_scale_inv") and not fp8:
                    raise ConfigError(f"{source}: tensor {name!r} is FP8 block-quantized but config.json has no "
                                      "quantization_config (quant_method fp8, weight_block_size) to read it by")
                yield name, tensor

        super().load_weights(checked(), source)
