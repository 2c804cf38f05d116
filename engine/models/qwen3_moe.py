"""Qwen3-MoE: Qwen3's attention (shared layers) with a sparse mixture-of-experts MLP.

Layer ``i`` is sparse when ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``;
other layers use the dense gated MLP of ``intermediate_size``. The router is ``softmax(x @ gate.T)`` in fp32, top-k
(``num_experts_per_tok``), renormalised when ``norm_topk_prob``, cast to the hidden dtype (as transformers does).
Experts are stacked per layer (``w13 [E, 2I, H]`` gate rows first, ``w2 [E, H, I]``), loaded from either key form:
per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, what ``save_pretrained`` writes) or fused
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``, transformers 5's in-memory form, or
transposed, ``[E, H, 2I]`` / ``[E, I, H]``, as Qwen3-VL-MoE and Llama 4 release them).
NVFP4 experts (ModelOpt per-expert tensors) and block-FP8 experts (the ``-FP8`` releases, where each rank's share of
the channels is whole scale blocks) stay packed and run through the fused-MoE kernels; the dense stacks are
allocated only for a checkpoint whose experts are not packed.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterable

import torch
from torch import nn

from ember.engine import fp8_loading, nvfp4_loading
from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models.layers import (
    Attention,
    DecoderForCausalLM,
    DecoderLayer,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    apply_sliding_windows,
    float_weight,
)
from ember.engine.nvfp4_loading import QuantizationError
from ember.kernels import moe_reference
from ember.kernels.fp8_block import CHANNEL, FP8BlockTensor
from ember.kernels.nvfp4 import BLOCK, NVFP4Tensor

_PROJ = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}
log = logging.getLogger(__name__)


class MoEExperts(nn.Module):
    """All experts of one layer as two stacks (buffers, so the dense loader's parameter checks skip them).

    The dense stacks are placeholders (on the meta device) until the loader has chosen the checkpoint's format; the
    model allocates the ones that stay dense (`DecoderForCausalLM.materialize`), so a quantized checkpoint never
    holds its experts in the model dtype, not even while loading."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.device = device
        self.register_buffer("w13", torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device="meta"))
        self.register_buffer("w2", torch.empty(num_experts, hidden, inter, dtype=dtype, device="meta"))
        self.quant13: NVFP4Tensor | FP8BlockTensor | None = None
        self.quant2: NVFP4Tensor | FP8BlockTensor | None = None
        self.a13_scale: torch.Tensor | None = None
        self.a2_scale: torch.Tensor | None = None

    def make_fp8(self, block: tuple[int, int]) -> None:
        """Replace both stacks by empty block-FP8 stacks (e4m3 weights, a float32 scale per ``block``) for the loader
        to fill; gate and up rows keep their own scale blocks, so ``inter`` must be a multiple of the block's rows."""
        bn, bk = block
        e, h, i = self.num_experts, self.hidden, self.inter

        def stack(n: int, k: int) -> FP8BlockTensor:
            return FP8BlockTensor(torch.zeros(e, n, k, dtype=torch.uint8, device=self.device).view(torch.float8_e4m3fn),
                                  torch.zeros(e, -(-n // bn), -(-k // bk), dtype=torch.float32, device=self.device),
                                  (bn, bk))

        self.quant13, self.quant2 = stack(2 * i, h), stack(h, i)
        self.register_buffer("w13", None)
        self.register_buffer("w2", None)

    def make_nvfp4(self, which: str) -> None:
        """Replace one stack (``"w13"`` or ``"w2"``) by an empty NVFP4 stack to be filled by the loader."""
        e, device = self.num_experts, self.device
        n, k, parts = (2 * self.inter, self.hidden, 2) if which == "w13" else (self.hidden, self.inter, 1)
        q = NVFP4Tensor(
            torch.zeros(e, n, k // 2, dtype=torch.uint8, device=device),
            torch.zeros(e, n, k // BLOCK, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn),
            torch.zeros(e, parts, dtype=torch.float32, device=device).squeeze(-1),
        )
        setattr(self, "quant13" if which == "w13" else "quant2", q)
        self.register_buffer(which, None)

    def stacks(self) -> tuple[torch.Tensor | NVFP4Tensor, torch.Tensor | NVFP4Tensor]:
        return (self.quant13 if self.quant13 is not None else self.w13,
                self.quant2 if self.quant2 is not None else self.w2)

    def triton(self, x: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor,
               shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The Triton fused MoE over these experts: NVFP4 stacks through `moe.fused_moe_nvfp4` (which picks W4A4
        where it runs, with the checkpoint's activation scales), any other stack through `moe.fused_moe`."""
        from ember.kernels import moe

        w13, w2 = self.stacks()
        if isinstance(w13, NVFP4Tensor) and isinstance(w2, NVFP4Tensor):
            return moe.fused_moe_nvfp4(x, w13, w2, topk_w, topk_ids, self.a13_scale, self.a2_scale, shared=shared)
        return moe.fused_moe(x, w13, w2, topk_w, topk_ids, shared=shared)


class SparseMoeBlock(nn.Module):
    """Router + experts; the Triton fused MoE on CUDA (or ``EMBER_MOE=triton``), the torch reference otherwise.
    Under tensor parallelism (``tp`` set) each rank holds every expert's share of the intermediate channels and
    the partial outputs are summed over the ranks."""

    tp = None

    def __init__(self, cfg: ModelConfig, moe: dict, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = moe["top_k"]
        self.norm_topk_prob = moe["norm_topk_prob"]
        self.gate = nn.Linear(cfg.hidden_size, moe["num_experts"], bias=False)
        self.experts = MoEExperts(moe["num_experts"], cfg.hidden_size, moe["inter"], dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._experts_out(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _experts_out(self, x: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor:
        """The routed experts' output (this rank's share under tensor parallelism); ``shared = (gate, value)``: plus
        a shared expert's ``sigmoid(gate) * value``, added by the fused MoE's combine on the Triton path."""
        logits = self.gate(x)
        if nvfp4_loading.use_triton(x.device):
            from ember.kernels import moe_routing

            topk_w, topk_ids = moe_routing.softmax_topk(logits, self.top_k, self.norm_topk_prob,
                                                        round_through_dtype=True)
            return self.experts.triton(x, topk_w, topk_ids, shared)
        topk_w, topk_ids = moe_reference.topk_routing(logits, self.top_k, self.norm_topk_prob)
        out = moe_reference.fused_moe(x, *self.experts.stacks(), topk_w.to(logits.dtype).float(), topk_ids)
        return out if shared is None else out + torch.sigmoid(shared[0]) * shared[1]


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, cfg: ModelConfig, moe: dict, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(cfg, moe, device, dtype)
        width = int(cfg.raw.get("shared_expert_intermediate_size") or 0)
        self.shared_expert = GatedMLP(dataclasses.replace(cfg, intermediate_size=width)) if width else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if width else None

    def _experts_out(self, x: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor:
        if self.shared_expert is None:
            return super()._experts_out(x)
        return super()._experts_out(x, (self.shared_expert_gate(x), self.shared_expert.local(x)))  # reduced with it


class Qwen3MoeDecoderLayer(DecoderLayer):
    """Qwen3 attention (``qk_norm``: Mixtral's has none) + either a sparse MoE block or the dense gated MLP."""

    qk_norm = True

    def __init__(self, cfg: ModelConfig, moe: dict | None, device: torch.device, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, qk_norm=self.qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg, moe, device, dtype) if moe is not None else GatedMLP(cfg)


class _Body(nn.Module):
    """Embeddings, one ``layer`` per config layer (sparse where ``sparse`` says), the final norm; a MoE family
    subclasses it with its own ``layer``."""

    layer: type[nn.Module] = Qwen3MoeDecoderLayer

    def __init__(self, cfg: ModelConfig, moe: dict, sparse: list[bool], device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            self.layer(cfg, moe if sparse[i] else None, device, dtype) for i in range(len(sparse)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def moe_settings(cfg: ModelConfig) -> tuple[dict, list[bool]]:
    """The MoE fields of config.json and which layers are sparse."""
    raw = cfg.raw
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 0)) or 0)
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    only = set(raw.get("mlp_only_layers") or [])
    sparse = [i not in only and num_experts > 0 and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)]
    moe = {
        "num_experts": num_experts,
        "top_k": int(raw.get("num_experts_per_tok", 0) or 0),
        "inter": int(raw.get("moe_intermediate_size", 0) or 0),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
    }
    if any(sparse) and (moe["top_k"] < 1 or moe["top_k"] > num_experts or moe["inter"] < 1):
        raise ConfigError("config.json: Qwen3-MoE needs 1 <= num_experts_per_tok <= num_experts and "
                          "moe_intermediate_size > 0")
    return moe, sparse


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE over the paged KV cache (forward and logits are the shared decoder's)."""

    qk_norm = True
    body: type[nn.Module] = _Body
    """The decoder stack: ``body(cfg, moe, sparse, device, dtype)``; subclasses bring their own layers."""

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.moe, self.sparse = self.moe_settings(cfg)
        probe = torch.empty(0)
        self.model = self.body(cfg, self.moe, self.sparse, probe.device, probe.dtype)
        apply_sliding_windows(self.model.layers, cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(self.rotary_dim(cfg), max_position, cfg.rope_theta, cfg.rope_scaling)

    @staticmethod
    def moe_settings(cfg: ModelConfig) -> tuple[dict, list[bool]]:
        """The experts' settings and which layers are sparse (`moe_settings`)."""
        return moe_settings(cfg)

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        """Channels of each head that RoPE turns."""
        return cfg.head_dim

    def _experts(self, layer: int) -> MoEExperts:
        mlp = self.model.layers[layer].mlp
        if not isinstance(mlp, SparseMoeBlock):
            raise ConfigError(f"layer {layer} is dense in config.json (mlp_only_layers / decoder_sparse_step) "
                              "but the checkpoint has experts for it")
        return mlp.experts

    def _install_nvfp4_experts(self, plan: nvfp4_loading.NVFP4Plan) -> None:
        """Turn each layer's stacks NVFP4 where the plan says its experts are; all experts of a stack or none."""
        for i, sparse in enumerate(self.sparse):
            if not sparse:
                continue
            ex = self._experts(i)
            prefix = f"model.layers.{i}.mlp.experts."
            for which, projs in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
                names = [f"{prefix}{e}.{p}" for e in range(ex.num_experts) for p in projs]
                hits = [n for n in names if n in plan.modules]
                if not hits:
                    continue
                if len(hits) != len(names):
                    missing = next(n for n in names if n not in plan.modules)
                    raise QuantizationError(f"{plan.modules[hits[0]].file}: {hits[0]} is NVFP4 but {missing} is "
                                            "not; Ember needs all experts of a projection in one format")
                for n in hits:
                    spec = plan.modules[n]
                    want = (ex.inter, ex.hidden) if not n.endswith("down_proj") else (ex.hidden, ex.inter)
                    if (spec.out_features, spec.in_features) != want:
                        raise QuantizationError(f"{spec.file}: tensor {n}.weight is [{spec.out_features}, "
                                                f"{spec.in_features}] (unpacked), expected {list(want)}")
                ex.make_nvfp4(which)

    def _install_fp8_experts(self, source: str) -> None:
        """In a block-FP8 checkpoint, keep a layer's experts in FP8 (W8A16 in the fused MoE) when every expert
        projection of the layer is e4m3 with its scales and this rank's share of ``moe_intermediate_size`` starts
        gate, up and (under tensor parallelism) down on scale-block boundaries; dequantize them otherwise. The kept
        modules' checkpoint names join ``fp8_packed`` (:meth:`keeps_fp8`)."""
        fmt = getattr(self, "fp8", None)  # the FP8 format load_model chose (checkpoint's or --quantization)
        if fmt is None:
            return
        block = fmt.block
        fp8_modules = {}  # the model's module name -> the checkpoint's
        for hf in self.fp8_candidates:
            name = self.checkpoint_name(hf + ".weight")
            if name is not None:
                fp8_modules[name[: -len(".weight")]] = hf
        split = getattr(self, "shard_shape", None) is not None  # one tensor-parallel rank's slices
        for i, sparse in enumerate(self.sparse):
            if not sparse:
                continue
            ex = self._experts(i)
            names = [f"model.layers.{i}.mlp.experts.{e}.{p}" for e in range(ex.num_experts) for p in _PROJ]
            if not all(n in fp8_modules for n in names):
                continue
            # down's K is split too; a per-channel scale spans any K
            if ex.inter % block[0] or (split and block[1] < CHANNEL and ex.inter % block[1]):
                log.warning("%s: layer %d's FP8 experts are dequantized to %s: %d intermediate channels per rank are "
                            "not whole %s scale blocks", source, i, self.model.embed_tokens.weight.dtype, ex.inter,
                            block)
                continue
            ex.make_fp8(block)
            self.fp8_packed |= {fp8_modules[n] for n in names}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """Experts (either key form; bf16, NVFP4 or block FP8) are placed here; everything else goes through the
        shared loader, with NVFP4 attention / dense MLP layers swapped in by :func:`nvfp4_loading.prepare`."""
        self.fp8_packed: set[str] = set()
        stream = nvfp4_loading.prepare(self, weights, source)
        if self.nvfp4_plan is not None:
            self._install_nvfp4_experts(self.nvfp4_plan)
        else:
            self._install_fp8_experts(source)
        filled: dict[tuple[int, str], int] = {}
        expected: dict[tuple[int, str], int] = {}

        def rest() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                if ".mlp.experts." in name:
                    self._place_expert_tensor(name, tensor, source, filled)
                else:
                    yield name, tensor

        super().load_weights(nvfp4_loading.PreparedWeights(rest()), source)
        for i, sparse in enumerate(self.sparse):
            if not sparse:
                continue
            ex = self._experts(i)
            for which in ("w13", "w2"):
                q = ex.quant13 if which == "w13" else ex.quant2
                tensors = 1 if q is None else 2 if isinstance(q, FP8BlockTensor) else 3
                per_expert = (2 if which == "w13" else 1) * tensors
                expected[(i, which)] = ex.num_experts * per_expert
                if filled.get((i, which), 0) not in (expected[(i, which)], -1):
                    raise ConfigError(f"{source}: layer {i} experts' {which} is incomplete "
                                      f"({filled.get((i, which), 0)} of {expected[(i, which)]} tensors)")

    def _place_expert_tensor(self, name: str, tensor: torch.Tensor, source: str,
                             filled: dict[tuple[int, str], int]) -> None:
        parts = name.split(".")
        try:
            layer = int(parts[2])
            rest = parts[parts.index("experts") + 1:]
        except (ValueError, IndexError):
            raise ConfigError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}") from None
        ex = self._experts(layer)
        if rest in (["gate_up_proj"], ["down_proj"]):  # fused form
            which = "w13" if rest[0] == "gate_up_proj" else "w2"
            dest = ex.w13 if which == "w13" else ex.w2
            if dest is None:
                raise QuantizationError(f"{source}: fused tensor {name!r} is not NVFP4 but the layer's experts are")
            if tuple(tensor.shape) != tuple(dest.shape) and tensor.dim() == 3 \
                    and tuple(tensor.shape) == (dest.shape[0], dest.shape[2], dest.shape[1]):
                tensor = tensor.transpose(1, 2)  # the released layout of Qwen3-VL-MoE and Llama 4: [E, H, 2I]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(dest.shape)}")
            dest.copy_(float_weight(tensor, name, source).to(dest.dtype))
            filled[(layer, which)] = -1
            return
        if len(rest) != 3 or rest[1] not in _PROJ:
            raise ConfigError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}")
        e, proj, suffix = int(rest[0]), rest[1], rest[2]
        if not 0 <= e < ex.num_experts:
            raise ConfigError(f"{source}: tensor {name!r} names expert {e} but config.json has {ex.num_experts}")
        which = "w2" if proj == "down_proj" else "w13"
        part = _PROJ[proj] if which == "w13" else 0
        rows = slice(part * ex.inter, (part + 1) * ex.inter) if which == "w13" else slice(None)
        q = ex.quant13 if which == "w13" else ex.quant2
        if q is None:
            if suffix != "weight":
                raise QuantizationError(f"{source}: tensor {name!r} is a quantization tensor but the checkpoint's "
                                        "experts are not NVFP4")
            dest = (ex.w13 if which == "w13" else ex.w2)[e, rows]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(dest.shape)}")
            dest.copy_(float_weight(tensor, name, source).to(dest.dtype))
        elif isinstance(q, FP8BlockTensor):
            self._place_fp8(q, e, part if which == "w13" else None, ex.inter, name, suffix, tensor, source)
        elif suffix == "weight":
            q.weight[e, rows].copy_(tensor)
        elif suffix == "weight_scale":
            q.weight_scale.view(torch.uint8)[e, rows].copy_(tensor.view(torch.uint8))
        elif suffix == "weight_scale_2":
            if which == "w13":
                q.weight_scale_2[e, part] = tensor.float().reshape(())
            else:
                q.weight_scale_2[e] = tensor.float().reshape(())
        elif suffix == "input_scale":
            self._merge_input_scale(ex, which, tensor)
            return
        else:
            raise ConfigError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}")
        if filled.get((layer, which), 0) >= 0:
            filled[(layer, which)] = filled.get((layer, which), 0) + 1

    @staticmethod
    def _place_fp8(q: FP8BlockTensor, e: int, part: int | None, inter: int, name: str, suffix: str,
                   tensor: torch.Tensor, source: str) -> None:
        """Expert ``e``'s e4m3 weight or scale blocks into a block-FP8 stack (``part``: 0 gate, 1 up of ``w13``)."""
        bn = q.block[0]
        rows = slice(None) if part is None else slice(part * inter, (part + 1) * inter)
        scale_rows = slice(None) if part is None else slice(part * inter // bn, (part + 1) * inter // bn)
        dest = {"weight": q.weight[e, rows], "weight_scale_inv": q.scale[e, scale_rows]}.get(suffix)
        if dest is None:
            raise ConfigError(f"{source}: unexpected tensor {name!r} beside block-FP8 experts")
        fp8_loading.check_packed(name, tensor, dest, source)
        dest.copy_(tensor)

    @staticmethod
    def _merge_input_scale(ex: MoEExperts, which: str, tensor: torch.Tensor) -> None:
        """One static activation scale per GEMM: the max over experts (vLLM does the same for W4A4)."""
        v = tensor.float().reshape(()).to(ex.quant13.weight.device if ex.quant13 is not None else tensor.device)
        attr = "a13_scale" if which == "w13" else "a2_scale"
        cur = getattr(ex, attr)
        setattr(ex, attr, v if cur is None else torch.maximum(cur, v))
