"""gpt-oss (``GptOssForCausalLM``): attention with q/k/v/o biases and one learned sink logit per query head,
sliding-window (``sliding_window``) and full layers as ``layer_types`` alternates them, YaRN RoPE, and a MoE MLP in
every layer.

MoE: router ``x @ W.T + b``, top-k of the logits, softmax over those k; each expert computes ``gate_up = x @ W13 + b13``
whose even/odd columns are gate/up (interleaved in the checkpoint, split into ``[gate | up]`` halves on load), the
clamped GLU of :func:`ember.kernels.moe_reference.clamped_swiglu` (``swiglu_limit``, ``swiglu_alpha``), then
``down + b2``. Expert tensors come as transformers writes them (``mlp.experts.gate_up_proj [E, H, 2I]``,
``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``) or as OpenAI's MXFP4 checkpoints
hold them (``gate_up_proj_blocks [E, 2I, H/32, 16]`` + ``gate_up_proj_scales [E, 2I, H/32]``, ``down_proj_blocks`` +
``down_proj_scales``, see :mod:`ember.kernels.mxfp4`), which stay packed (:class:`MXFP4Tensor` stacks). The MoE runs
on the Triton fused MoE on CUDA (or ``EMBER_MOE=triton``: biases and the clamped GLU in its epilogues, MXFP4
dequantized in its W4A16 loads) and on the torch reference otherwise (MXFP4 experts dequantized one hit expert at a
time).
"""
from __future__ import annotations

from functools import partial
from typing import Iterable

import torch
from torch import nn

from ember.engine import nvfp4_loading
from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models.layers import Attention, DecoderForCausalLM, DecoderLayer, RMSNorm, RotaryEmbedding, \
    sliding_windows
from ember.engine.models.qwen3_moe import SparseMoeBlock
from ember.kernels import moe_reference
from ember.kernels.mxfp4 import BLOCK as MX_BLOCK
from ember.kernels.mxfp4 import MXFP4Tensor

_EXPERT_LEAVES = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_MXFP4_LEAVES = {"gate_up_proj_blocks": ("w13", "weight"), "gate_up_proj_scales": ("w13", "scale"),
                 "down_proj_blocks": ("w2", "weight"), "down_proj_scales": ("w2", "scale")}


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[g0, u0, g1, u1, ...]`` along ``dim`` -> ``[g0, g1, ..., u0, u1, ...]``."""
    idx = torch.arange(t.shape[dim], device=t.device)
    return torch.cat((t.index_select(dim, idx[0::2]), t.index_select(dim, idx[1::2])), dim=dim)


class GptOssExperts(nn.Module):
    """All experts of one layer: ``w13 [E, 2I, H]`` (gate rows then up rows), ``b13 [E, 2I]``, ``w2 [E, H, I]``,
    ``b2 [E, H]`` (buffers: the dense loader's parameter checks skip them; this model checks them itself). With
    ``mxfp4`` (config.json's ``quantization_config.quant_method``) the weight stacks are packed MXFP4 from the start,
    so the bf16 stacks are never allocated."""

    def __init__(self, num_experts: int, hidden: int, inter: int, mxfp4: bool = False) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.register_buffer("b13", torch.empty(num_experts, 2 * inter))
        self.register_buffer("b2", torch.empty(num_experts, hidden))
        self.quant13: MXFP4Tensor | None = None
        self.quant2: MXFP4Tensor | None = None
        for which, shape in (("w13", (num_experts, 2 * inter, hidden)), ("w2", (num_experts, hidden, inter))):
            if mxfp4:
                self.make_mxfp4(which)
            else:
                self.register_buffer(which, torch.empty(shape))

    def make_mxfp4(self, which: str) -> MXFP4Tensor:
        """Replace one stack (``"w13"`` or ``"w2"``) by an empty MXFP4 stack for the loader to fill."""
        n, k = (2 * self.inter, self.hidden) if which == "w13" else (self.hidden, self.inter)
        if k % MX_BLOCK:
            field = "hidden_size" if which == "w13" else "intermediate_size"
            raise ConfigError(f"config.json: MXFP4 experts need {field} to be a multiple of {MX_BLOCK}, got {k}")
        device = self.b13.device
        q = MXFP4Tensor(torch.zeros(self.num_experts, n, k // 2, dtype=torch.uint8, device=device),
                        torch.zeros(self.num_experts, n, k // MX_BLOCK, dtype=torch.uint8, device=device))
        setattr(self, "quant13" if which == "w13" else "quant2", q)
        self.register_buffer(which, None)
        return q

    def stacks(self) -> tuple[torch.Tensor | MXFP4Tensor, torch.Tensor | MXFP4Tensor]:
        return (self.quant13 if self.quant13 is not None else self.w13,
                self.quant2 if self.quant2 is not None else self.w2)


class GptOssMoeBlock(SparseMoeBlock):
    """Router with bias, softmax over the top-k logits, biased experts with the clamped GLU. Under tensor
    parallelism each rank holds every expert's share of the intermediate channels (``b2`` is loaded on rank 0
    only, see :meth:`GptOssForCausalLM.tp_split_rule`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        raw = cfg.raw
        num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        self.top_k = int(raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 0)
        if num_experts < 1 or not 1 <= self.top_k <= num_experts:
            raise ConfigError("config.json: gpt-oss needs num_local_experts >= 1 and "
                              "1 <= num_experts_per_tok <= num_local_experts")
        self.router = nn.Linear(cfg.hidden_size, num_experts, bias=True)
        quant = (raw.get("quantization_config") or {}).get("quant_method")
        self.experts = GptOssExperts(num_experts, cfg.hidden_size, cfg.intermediate_size, mxfp4=quant == "mxfp4")
        self.swiglu = (float(raw.get("swiglu_limit", 7.0)), float(raw.get("swiglu_alpha", 1.702)))
        self.activation = partial(moe_reference.clamped_swiglu, limit=self.swiglu[0], alpha=self.swiglu[1])

    def _experts_out(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        ex = self.experts
        w13, w2 = ex.stacks()
        if nvfp4_loading.use_triton(x.device):
            from ember.kernels import moe, moe_routing

            topk_w, topk_ids = moe_routing.softmax_topk(logits, self.top_k, False, round_through_dtype=True,
                                                        softmax_of_chosen=True)
            return moe.fused_moe(x, w13, w2, topk_w, topk_ids, b13=ex.b13, b2=ex.b2, swiglu=self.swiglu)
        topk_w, topk_ids = moe_reference.topk_softmax_routing(logits, self.top_k)
        return moe_reference.fused_moe(x, w13, w2, topk_w, topk_ids, b13=ex.b13, b2=ex.b2,
                                       activation=self.activation)


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        bias = bool(cfg.raw.get("attention_bias", True))  # transformers' GptOssConfig defaults to biases
        self.self_attn = Attention(cfg, qk_norm=False, qkv_bias=bias, o_bias=bias)
        self.self_attn.sliding_window = window
        self.self_attn.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoeBlock(cfg)


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, w) for w in sliding_windows(cfg))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss over the paged KV cache (forward and logits are the shared decoder's)."""

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = _Body(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)

    @staticmethod
    def tp_split_rule(name: str, cfg: ModelConfig) -> tuple[str, int]:
        """Tensor-parallel split of a checkpoint tensor (see `ember.engine.distributed`): the expert stacks split
        their intermediate dimension contiguously (gate/up stay interleaved pairs: ``gate_up_proj [E, H, 2I]`` dim
        2, ``down_proj [E, I, H]`` dim 1), ``down_proj_bias`` goes to rank 0 only, ``sinks`` follow the heads."""
        from ember.engine import distributed

        parent, _, leaf = name.rpartition(".")
        if parent.endswith(".mlp.experts"):
            return {"gate_up_proj": ("shard", 2), "gate_up_proj_bias": ("shard", 1), "down_proj": ("shard", 1),
                    "down_proj_bias": ("rank0", -1), "gate_up_proj_blocks": ("shard", 1),
                    "gate_up_proj_scales": ("shard", 1), "down_proj_blocks": ("shard", 2),
                    "down_proj_scales": ("shard", 2)}.get(leaf, ("replicate", -1))
        if parent.endswith(".self_attn") and leaf == "sinks":
            return "shard", 0
        return distributed._split_rule(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """Expert tensors are placed here (de-interleaving gate/up); everything else, router and sinks included,
        goes through the shared loader. ``--quantization fp8`` is refused: the experts (nearly all the weights) have
        no FP8 path here, and quantizing attention alone would save almost nothing."""
        fmt = getattr(self, "fp8", None)
        if fmt is not None and fmt.on_load:
            raise ConfigError(f"{source}: --quantization fp8 cannot quantize gpt-oss's experts (they run as MXFP4 or "
                              "unquantized); serve the MXFP4 release, or leave --quantization unset")
        filled: dict[tuple[int, str], int] = {}

        def rest() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if ".mlp.experts." in name:
                    self._place_expert_tensor(name, tensor, source, filled)
                else:
                    yield name, tensor

        super().load_weights(nvfp4_loading.PreparedWeights(rest()), source)
        for i, layer in enumerate(self.model.layers):
            ex = layer.mlp.experts
            for leaf in _EXPERT_LEAVES:
                quant = ex.quant13 if leaf == "gate_up_proj" else ex.quant2 if leaf == "down_proj" else None
                needed = [leaf] if quant is None else [f"{leaf}_blocks", f"{leaf}_scales"]
                for n in needed:
                    if not filled.get((i, n)):
                        raise ConfigError(f"{source}: missing tensor model.layers.{i}.mlp.experts.{n}")

    def _place_expert_tensor(self, name: str, tensor: torch.Tensor, source: str,
                             filled: dict[tuple[int, str], int]) -> None:
        parts = name.split(".")
        try:
            layer = int(parts[2])
            ex = self.model.layers[layer].mlp.experts
        except (ValueError, IndexError):
            raise ConfigError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}") from None
        leaf = parts[-1]
        if leaf in _MXFP4_LEAVES:
            self._place_mxfp4(ex, name, leaf, tensor, source)
            filled[(layer, leaf)] = 1
            return
        if leaf in ("gate_up_proj", "down_proj") and getattr(ex, leaf.replace("gate_up_proj", "w13").replace(
                "down_proj", "w2")) is None:
            raise ConfigError(f"{source}: tensor {name!r} is unquantized but config.json's quantization_config "
                              "(quant_method mxfp4) makes the experts MXFP4 (*_blocks / *_scales)")
        if leaf == "gate_up_proj":  # [E, H, 2I] interleaved columns
            dest, value = ex.w13, deinterleave(tensor.transpose(1, 2), 1)
        elif leaf == "gate_up_proj_bias":
            dest, value = ex.b13, deinterleave(tensor, 1)
        elif leaf == "down_proj":  # [E, I, H]
            dest, value = ex.w2, tensor.transpose(1, 2)
        elif leaf == "down_proj_bias":
            dest, value = ex.b2, tensor
        else:
            raise ConfigError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}")
        if tuple(value.shape) != tuple(dest.shape):
            raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, which does not match "
                              f"the experts' {tuple(dest.shape)} (config.json: num_local_experts, hidden_size, "
                              "intermediate_size)")
        dest.copy_(value.to(dest.dtype))
        filled[(layer, leaf)] = 1

    @staticmethod
    def _place_mxfp4(ex: GptOssExperts, name: str, leaf: str, tensor: torch.Tensor, source: str) -> None:
        """``*_blocks [E, N, K/32, 16]`` / ``*_scales [E, N, K/32]`` uint8, rows de-interleaved for gate/up."""
        which, part = _MXFP4_LEAVES[leaf]
        q = ex.quant13 if which == "w13" else ex.quant2
        if q is None:
            if getattr(ex, which) is None:
                raise ConfigError(f"{source}: tensor {name!r}: the layer's experts are already unquantized")
            q = ex.make_mxfp4(which)
        dest = getattr(q, part)
        if tensor.dtype != torch.uint8:
            raise ConfigError(f"{source}: tensor {name!r} is {tensor.dtype}, expected uint8 (MXFP4)")
        value = tensor.reshape(*tensor.shape[:2], -1) if part == "weight" and tensor.dim() == 4 else tensor
        if which == "w13":
            value = deinterleave(value, 1)
        if tuple(value.shape) != tuple(dest.shape):
            raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, which does not match "
                              f"the MXFP4 experts' {tuple(dest.shape)} (config.json: num_local_experts, hidden_size, "
                              "intermediate_size)")
        dest.copy_(value)
