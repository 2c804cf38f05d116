"""Layers shared by the decoder-only models: RMSNorm, RoPE (with rope_scaling), paged-KV attention, gated MLP, and
the decoder stack with its Hugging Face weight-name mapping (q/k/v and gate/up are fused on load).

Row-wise ops: on CUDA the norms (plain and fused residual-add, `RMSNorm` and the zero-centred `OffsetRMSNorm`), the
rotary embedding and the gated MLPs' activation-and-mul run the Triton kernels of `ember.kernels` (`norm`, `rotary`,
`activation`); elsewhere the torch code below, which matches transformers. `row_ops_backend` decides
(``EMBER_ROW_OPS=triton|torch`` overrides, e.g. to run the kernels under the Triton interpreter on a CPU) and
`use_triton_row_ops` switches a built model.
"""
from __future__ import annotations

import dataclasses
import math
import os
from types import ModuleType
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ember.engine.attention import AttentionMetadata, check_triton_device, is_triton_backend
from ember.engine.config import ConfigError, ModelConfig, model_family, rope_field


def row_ops_backend(device: torch.device) -> str:
    """``"triton"`` on CUDA, ``"torch"`` elsewhere; ``--row-ops-backend`` (``EMBER_ROW_OPS``: triton / torch)
    overrides."""
    forced = os.environ.get("EMBER_ROW_OPS", "").strip().lower()
    if forced == "triton":
        check_triton_device(device, "--row-ops-backend (EMBER_ROW_OPS)")
    if forced in ("triton", "torch"):
        return forced
    if forced:
        raise ValueError(f"EMBER_ROW_OPS={forced!r}: expected 'triton' or 'torch'")
    return "triton" if device.type == "cuda" else "torch"


def use_triton_row_ops(model: nn.Module, enabled: bool) -> None:
    """Run ``model``'s norms, rotary embedding and gated-MLP activations through the Triton kernels (or the torch
    code): every module whose class declares a boolean ``triton`` flag (`RMSNorm`, `OffsetRMSNorm`,
    `RotaryEmbedding`, `GatedMLP` and their kin in the model files)."""
    for m in model.modules():
        if isinstance(getattr(type(m), "triton", None), bool):
            m.triton = enabled


class RMSNorm(nn.Module):
    """``w * (x * rsqrt(mean(x^2) + eps))`` computed in fp32, cast back before the weight (as transformers does).

    With a ``residual``, the pre-norm of a residual block: returns ``(norm(x + residual), x + residual)`` (one fused
    kernel on the Triton path)."""

    triton = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.triton:
            from ember.kernels import norm

            if residual is None:
                return norm.rms_norm(x, self.weight, self.eps)
            return norm.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            return self.forward(x), x
        xf = x.float()
        return self.normed(xf, xf.pow(2).mean(-1, keepdim=True), x.dtype)

    def normed(self, xf: torch.Tensor, variance: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The norm of fp32 ``xf`` given its ``variance`` (mean square), in ``dtype``: what `forward` computes, for
        a caller that reduced the variance itself (a whole-projection q/k norm under tensor parallelism)."""
        return self.weight * (xf * torch.rsqrt(variance + self.eps)).to(dtype)


def float_weight(tensor: torch.Tensor, name: str, source: object) -> torch.Tensor:
    """``tensor`` where it is floating point; an integer or bool tensor for an unquantized weight (a quantized
    export whose config.json declares no quantization, or a broken file) is a ConfigError naming it and its dtype,
    never cast and served."""
    if not tensor.is_floating_point():
        raise ConfigError(f"{source}: tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}, not floating "
                          "point (a quantized checkpoint whose config.json declares no quantization?)")
    return tensor


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for RoPE types default, linear, llama3, yarn and
    longrope; a rope_theta or scaling factor that is not a positive number is a ConfigError naming it (either would
    make every logit NaN)."""
    if not (math.isfinite(theta) and theta > 0):
        raise ConfigError(f"config.json: rope_theta must be a positive number, got {theta}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind in ("linear", "llama3", "yarn") and scaling.get("factor") is None:
        raise ConfigError(f"config.json: {kind} RoPE scaling needs rope_scaling.factor")
    factor = float(scaling.get("factor", 1.0))
    if not (math.isfinite(factor) and factor > 0):
        raise ConfigError(f"config.json: rope_scaling.factor must be a positive number, got {scaling.get('factor')}")
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        if not scaling.get("original_max_position_embeddings"):
            raise ConfigError("config.json: llama3 RoPE needs original_max_position_embeddings")
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "yarn":
        orig = scaling.get("original_max_position_embeddings") or max_position
        beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = scaling.get("attention_factor")
        if attn is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

        def corr_dim(rot: float) -> float:
            return (head_dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        extra = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
        return inv, float(attn)
    if kind in ("longrope", "su"):
        return _longrope_inv_freq(head_dim, theta, scaling, max_position)
    raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported (default, linear, llama3, yarn, "
                      f"longrope)")


def _longrope_inv_freq(head_dim: int, theta: float, scaling: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3.5, Phi-4-mini): per-frequency divisors, ``long_factor`` when the served context
    (``max_position``) is longer than the pretrained one, else ``short_factor``, and the paper's attention factor.

    transformers switches between the two per forward by the sequence's current length; a paged KV cache cannot
    (keys cached under one set would be read under the other), so the set is chosen once for the served context, as
    vLLM does. Sequences are then exact to transformers' whenever the context fits the pretrained length, or, with a
    longer context, once they pass it."""
    orig = scaling.get("original_max_position_embeddings")
    if not orig:
        raise ConfigError("config.json: LongRoPE needs original_max_position_embeddings")
    orig = int(orig)
    factor = scaling.get("factor") or float(scaling.get("max_position_embeddings") or orig) / orig
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = scaling["long_factor"] if max_position > orig else scaling["short_factor"]
    if len(ext) != head_dim // 2:
        raise ConfigError(f"config.json: LongRoPE factors have {len(ext)} entries; the rotary dimension "
                          f"{head_dim} needs {head_dim // 2}")
    freq = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * freq), float(attn)


class OffsetRMSNorm(nn.Module):
    """Zero-centred RMSNorm (Gemma, Qwen3-Next): ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, then cast; with a
    ``residual``, ``(norm(x + residual), x + residual)`` like `RMSNorm` (one fused kernel on the Triton path)."""

    triton = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.triton:
            from ember.kernels import norm

            if residual is None:
                return norm.rms_norm(x, self.weight, self.eps, offset=True)
            return norm.fused_add_rms_norm(x, residual, self.weight, self.eps, offset=True)
        if residual is not None:
            x = x + residual
            return self.forward(x), x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def partial_rotary_dim(cfg: ModelConfig) -> int:
    """Channels of each head that RoPE turns: ``partial_rotary_factor`` of ``head_dim`` (top level in older
    config.json, in ``rope_parameters`` in transformers 5's; 1.0 when absent)."""
    return int(cfg.head_dim * float(rope_field(cfg.raw, "partial_rotary_factor") or 1.0))


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate_half) RoPE with a cos/sin cache indexed by position. Heads wider than ``head_dim`` turn
    their first ``head_dim`` channels only (partial rotary, e.g. Qwen3-Next's ``partial_rotary_factor``)."""

    triton = False

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        self.cos = self.sin = self.cos_sin = torch.empty(0)

    def build_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq, attn_scale = rope_inv_freq(self.head_dim, self.theta, self.scaling, self.max_position)
        t = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attn_scale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attn_scale).to(device=device, dtype=dtype)
        half = self.head_dim // 2
        # the rotary kernel's layout: [max_position, head_dim] with the cos half first, then the sin half
        self.cos_sin = torch.cat((self.cos[:, :half], self.sin[:, :half]), dim=-1).contiguous()

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.triton:
            from ember.kernels import rotary

            return rotary.rotary_neox(positions, q, k, self.cos_sin)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        rot = self.head_dim
        if q.shape[-1] > rot:  # partial rotary: the first head_dim channels turn, the rest pass through
            q1, k1 = q[..., :rot], k[..., :rot]
            return (torch.cat((q1 * cos + self._rotate_half(q1) * sin, q[..., rot:]), dim=-1),
                    torch.cat((k1 * cos + self._rotate_half(k1) * sin, k[..., rot:]), dim=-1))
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


class Attention(nn.Module):
    """GQA self-attention over the paged KV cache, with optional per-head q/k RMSNorm (Qwen3) before RoPE.

    ``qkv_bias`` / ``o_bias`` default to ``attention_bias`` (Qwen2 has biases on q/k/v only). ``sliding_window``
    (keys ``pos - window < key_pos <= pos``) and ``sinks`` (one learned logit per query head in the softmax
    denominator, gpt-oss) are set per layer by the model; None means full causal attention without sinks.
    ``softcap`` (Gemma 2's ``attn_logit_softcapping``) bounds each scaled score to ``c * tanh(s / c)``; ``chunk``
    (Llama 4's ``attention_chunk_size``) keeps each query to the keys of its own chunk of positions.

    With an FP8 (e4m3) KV cache, K and V are stored divided by ``k_scale`` / ``v_scale`` (the checkpoint's per-layer
    scales, 1.0 when it has none) and multiplied back when read.

    ``whole_qk_norm`` applies ``q_norm`` / ``k_norm`` over the whole q / k projections instead of per head (OLMo 2 /
    3, MiniMax-M2: norms as wide as the projections); under tensor parallelism each rank holds its heads' share of
    the norm weights and the mean square is summed over the ranks. ``use_rope`` False skips RoPE in this layer
    (SmolLM3's NoPE layers). ``q_position_scale`` ``(beta, length, offset)`` (Mistral 3's and Llama 4's attention
    temperature): after RoPE each query is multiplied by ``1 + beta * log(1 + floor((position + offset) / length))``
    (Mistral 3: offset 0; Llama 4: 1), 1 within the first ``length`` positions.

    Under tensor parallelism (``tp`` set by `ember.engine.distributed.attach`) it holds this rank's heads and sums
    the partial ``o_proj`` outputs over the ranks."""

    tp = None

    def __init__(self, cfg: ModelConfig, qk_norm: bool, qkv_bias: bool | None = None,
                 o_bias: bool | None = None) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if self.hq % self.hkv:
            raise ConfigError("config.json: num_attention_heads must be a multiple of num_key_value_heads")
        qkv_bias = cfg.attention_bias if qkv_bias is None else qkv_bias
        o_bias = cfg.attention_bias if o_bias is None else o_bias
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if qk_norm else None
        self.scale = self.d ** -0.5
        self.sliding_window: int | None = None
        self.sinks: nn.Parameter | None = None
        self.softcap: float | None = None
        self.chunk: int | None = None
        self.k_scale = self.v_scale = 1.0
        self.q_position_scale: tuple[float, int, int] | None = None
        self.use_rope = True
        self.whole_qk_norm = False

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, rope: RotaryEmbedding,
                kv: tuple[torch.Tensor, torch.Tensor], backend: ModuleType) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        if self.whole_qk_norm:
            q, k = self._whole_norm(self.q_norm, q), self._whole_norm(self.k_norm, k)
        q = q.reshape(t, self.hq, self.d)
        k = k.reshape(t, self.hkv, self.d)
        v = v.reshape(t, self.hkv, self.d)
        if self._fused_prologue(rope, backend):
            q = self._norm_rope_and_cache(q, k, v, meta, rope, kv)
            out = self._attention(q, meta, kv, backend)
        else:
            if self.q_norm is not None and not self.whole_qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.use_rope:
                q, k = rope(meta.positions, q, k)
            if self.q_position_scale is not None:
                beta, length, offset = self.q_position_scale
                scale = 1.0 + beta * torch.log1p(torch.floor((meta.positions + offset) / length))
                q = q * scale.to(q.dtype)[:, None, None]
            out = self.attend(q, k, v, meta, kv, backend)
        out = self.o_proj(out.reshape(t, self.hq * self.d))
        return out if self.tp is None else self.tp.all_reduce(out)

    def _fused_prologue(self, rope: RotaryEmbedding, backend: ModuleType) -> bool:
        """Whether norms, RoPE and the KV write run as one launch (`ember.kernels.qk_norm_rope_cache`): the Triton
        attention and row kernels, per-head (or no) q/k norms with weights, RoPE in this layer, no query scaling."""
        norms = self.q_norm is None or (type(self.q_norm) is type(self.k_norm) and type(self.q_norm) in (
            RMSNorm, OffsetRMSNorm) and self.q_norm.weight.shape[0] == self.d and not self.whole_qk_norm)
        return rope.triton and self.use_rope and norms and self.q_position_scale is None and is_triton_backend(backend)

    def _norm_rope_and_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                             rope: RotaryEmbedding, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The rotated (normed) queries; the keys and values written into this layer's cache."""
        from ember.kernels.qk_norm_rope_cache import qk_norm_rope_cache

        k_cache, v_cache = kv
        scales = (self.k_scale, self.v_scale) if k_cache.dtype == torch.float8_e4m3fn else ()
        weights = () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return qk_norm_rope_cache(meta.positions, q, k, v, rope.cos_sin, k_cache, v_cache, meta.slot_mapping,
                                  *weights, *scales, offset=isinstance(self.q_norm, OffsetRMSNorm))

    def _whole_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return norm(x)
        xf = x.float()
        total = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        return norm.normed(xf, total / (x.shape[-1] * self.tp.world_size), x.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               kv: tuple[torch.Tensor, torch.Tensor], backend: ModuleType) -> torch.Tensor:
        """Write this step's ``k``/``v`` into the paged cache and attend: ``[T, hq, d]`` from rotated ``q``/``k``."""
        k_cache, v_cache = kv
        scales = (self.k_scale, self.v_scale) if k_cache.dtype == torch.float8_e4m3fn else ()
        backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, *scales)
        return self._attention(q, meta, kv, backend)

    def _attention(self, q: torch.Tensor, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor],
                   backend: ModuleType) -> torch.Tensor:
        """``[T, hq, d]``: attention of rotated ``q`` over the cache, this step's keys and values already in it."""
        k_cache, v_cache = kv
        scales = (self.k_scale, self.v_scale) if k_cache.dtype == torch.float8_e4m3fn else ()
        out = torch.empty_like(q)
        extra = {}
        if self.sliding_window is not None:
            extra["sliding_window"] = self.sliding_window
        if self.sinks is not None:
            extra["sinks"] = self.sinks
        if self.softcap:
            extra["softcap"] = self.softcap
        if self.chunk:
            extra["chunk"] = self.chunk
        backend.paged_attention(q.contiguous(), k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                                meta.block_table, meta.max_seqlen_q, meta.max_seqlen_k, self.scale, *scales,
                                **extra)
        return out


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused in one matmul (under tensor parallelism: this rank's
    intermediate channels, ``down`` summed over the ranks)."""

    tp = None
    triton = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.local(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output (the whole output without tensor parallelism), before any reduction."""
        gate_up = self.gate_up_proj(x)
        if self.triton:
            from ember.kernels import activation

            act = activation.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.inter, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                rope: RotaryEmbedding, kv: tuple[torch.Tensor, torch.Tensor],
                backend: ModuleType) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sublayer output, residual stream)``: the stream is ``h + residual`` (``h`` alone for the first layer);
        the next layer's (or the final) norm adds them, fused."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, meta, rope, kv, backend)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool, layer: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, qk_norm) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def apply_sliding_windows(layers: Iterable[nn.Module], cfg: ModelConfig) -> None:
    """Give each layer's attention its window from `sliding_windows` (layers with none keep full attention)."""
    for layer, window in zip(layers, sliding_windows(cfg)):
        if window is not None:
            layer.self_attn.sliding_window = window


_EVERY_LAYER_WINDOW = frozenset({"mistral", "ministral3", "mixtral", "phi3", "qwen3_moe"})
"""Model types whose transformers attention takes config.json's ``sliding_window`` on every layer (``layer_types``
ignored); Qwen3-MoE's only where ``use_sliding_window`` is set."""
_USE_SLIDING_WINDOW = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})
"""Model types whose ``sliding_window`` counts only under ``use_sliding_window`` (transformers' default: False)."""


def sliding_windows(cfg: ModelConfig) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers' modeling code for the model type reads
    config.json: Mistral, Ministral 3, Mixtral and Phi-3 put ``sliding_window`` on every layer; Qwen2 / Qwen3 only under
    ``use_sliding_window`` (absent: off), on the ``sliding_attention`` layers of ``layer_types`` or else from layer
    ``max_window_layers`` on (Qwen2-MoE: the even layers below it; Qwen3-MoE: every layer); GPT-OSS on the
    ``sliding_attention`` layers of ``layer_types`` (else alternating, sliding first). Every other model on this
    decoder (Llama, Granite, Seed-OSS, DeepSeek, GLM, ...) has no window in transformers, whatever config.json says.
    """
    raw = cfg.raw
    n = cfg.num_hidden_layers
    family = model_family(cfg.model_type, cfg.architecture)
    window = raw.get("sliding_window")
    if not window or (family in _USE_SLIDING_WINDOW and not raw.get("use_sliding_window")):
        return [None] * n
    window = int(window)
    if family in _EVERY_LAYER_WINDOW:
        return [window] * n
    if family not in _USE_SLIDING_WINDOW and family != "gpt_oss":
        return [None] * n
    types = raw.get("layer_types")
    if types:
        if len(types) != n:
            raise ConfigError(f"config.json: layer_types has {len(types)} entries for {n} layers")
        return [window if t == "sliding_attention" else None for t in types]
    if family == "gpt_oss":
        return [window if i % 2 == 0 else None for i in range(n)]
    first = int(raw.get("max_window_layers") if raw.get("max_window_layers") is not None else 28)
    if family == "qwen2_moe":
        return [window if i % 2 == 0 and i < first else None for i in range(n)]
    return [window if i >= first else None for i in range(n)]


# HF per-projection names -> (fused parameter, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_KV_SCALES = {"k_scale": ("k_scale",), "v_scale": ("v_scale",), "kv_scale": ("k_scale", "v_scale"),
              "q_scale": (), "prob_scale": (), "prob_output_scale": ()}
"""FP8 attention scales a checkpoint may carry -> the `Attention` scales each sets: the deprecated ``kv_scale``
both; query and softmax-probability scales none (Ember keeps queries and probabilities in the model dtype)."""


def _checkpoint_names(param: str) -> list[str]:
    """The checkpoint tensors that fill parameter ``param``: its parts (q/k/v, gate/up) for a fused one."""
    parts = param.split(".")
    if len(parts) < 2:
        return [param]
    shards = [split for split, (fused, _) in _FUSED.items() if fused == parts[-2]]
    return [".".join(parts[:-2] + [s, parts[-1]]) for s in shards] or [param]


_PROJ_OUTPUT_SCALES = {"q_proj": (), "k_proj": ("k_scale",), "v_proj": ("v_scale",)}
"""AutoFP8's ``-FP8-KV`` ``{q,k,v}_proj.output_scale`` -> the `Attention` scales each sets."""


def _materialized(packed: Any, device: torch.device) -> Any:
    """A packed weight dataclass (`NVFP4Tensor`, `FP8BlockTensor`, `MXFP4Tensor`) with its meta tensors allocated
    (zeroed) on ``device``; itself when none is on the meta device."""
    fields = {f.name: getattr(packed, f.name) for f in dataclasses.fields(packed)}
    meta = {k: torch.zeros_like(v, device=device) for k, v in fields.items()
            if isinstance(v, torch.Tensor) and v.is_meta}
    return dataclasses.replace(packed, **meta) if meta else packed


_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                            ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                    "model.visual.", "visual.", "vision_model.", "model.vision_model.")


def language_model_name(name: str) -> str | None:
    """A multimodal (``...ForConditionalGeneration``) checkpoint's tensor under its language model's name
    (``language_model.model.`` or ``model.language_model.`` -> ``model.``); None for the vision tower and its
    projector, which a text-only server does not load."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, ours in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


def _kv_scale_target(parts: list[str]) -> tuple[str, tuple[str, ...]] | None:
    """(the attention module, the `Attention` scales it sets) for an FP8 attention scale: ModelOpt's
    ``self_attn.k_proj.k_scale`` / ``self_attn.v_proj.v_scale``, the older ``self_attn.k_scale`` /
    ``self_attn.v_scale`` or deprecated ``self_attn.kv_scale`` (both), AutoFP8's ``self_attn.k_proj.output_scale`` /
    ``v_proj.output_scale``; query and probability scales set none. None for other names."""
    if len(parts) < 3:
        return None
    leaf, owner = parts[-1], parts[-2]
    if leaf == "output_scale" and owner in _PROJ_OUTPUT_SCALES:
        return ".".join(parts[:-2]), _PROJ_OUTPUT_SCALES[owner]
    if leaf not in _KV_SCALES:
        return None
    return ".".join(parts[:-2] if owner in _PROJ_OUTPUT_SCALES else parts[:-1]), _KV_SCALES[leaf]


class DecoderForCausalLM(nn.Module):
    """A Llama-family decoder over the paged KV cache; subclasses choose ``qk_norm``."""

    qk_norm = False
    layer: type[DecoderLayer] = DecoderLayer
    dense_only: tuple[str, ...] = ()
    """Suffixes of projections the model reads as plain weight matrices: never packed (FP8 ones are dequantized on
    load, NVFP4 ones refused)."""

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg, self.qk_norm, self.layer)
        apply_sliding_windows(self.model.layers, cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: ModuleType) -> torch.Tensor:
        """Hidden states ``[T, H]`` after the final norm; writes this step's K/V into ``kv_caches``."""
        h = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches):
            h, residual = layer(h, residual, meta, self.rope, kv, backend)
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def checkpoint_name(self, name: str) -> str | None:
        """The name this model's loader gives checkpoint tensor ``name``, or None for a tensor it does not use (a
        multi-token-prediction head, a vision tower). A model that renames or skips tensors overrides this; the
        engine's ``load_model`` hands :meth:`load_weights` the stream :meth:`renamed`, and the NVFP4 plan reads the
        checkpoint through it too."""
        return name

    def materialize(self) -> None:
        """Allocate on ``load_device`` whatever is still on the meta device: `ember.engine.engine.load_model` builds
        the model there, and :meth:`load_weights` calls this once the quantized (packed) layers are in place, so a
        quantized checkpoint never holds those layers in the model dtype, not even while loading. Packed weights kept
        outside parameters and buffers (the experts' NVFP4 / FP8 / MXFP4 stacks, dataclass attributes of a module)
        are allocated too. A no-op for a model built on a real device."""
        device = getattr(self, "load_device", None)
        if device is None:
            return
        self._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
        for m in self.modules():
            for attr, value in list(vars(m).items()):
                if dataclasses.is_dataclass(value) and not isinstance(value, type):
                    allocated = _materialized(value, device)
                    if allocated is not value:
                        setattr(m, attr, allocated)

    def keeps_fp8(self, module: str) -> bool:
        """Whether checkpoint module ``module``'s block-FP8 weight and scales reach :meth:`load_weights` packed (an
        :class:`~ember.engine.fp8_loading.FP8Linear` or FP8 experts) rather than dequantized (decided as loading
        starts)."""
        return module in getattr(self, "fp8_packed", ())

    def renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` under :meth:`checkpoint_name`, without the tensors it skips."""
        for name, tensor in weights:
            new = self.checkpoint_name(name)
            if new is not None:
                yield new, tensor

    def _load_kv_scale(self, attn: nn.Module | None, scales: tuple[str, ...], name: str, tensor: torch.Tensor,
                       source: str) -> None:
        if not isinstance(attn, Attention):
            raise ConfigError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}")
        if not scales:
            return
        value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else float("nan")
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{source}: tensor {name!r} must be one positive finite FP8 KV scale, got "
                              f"{tuple(tensor.shape)} {tensor.flatten()[:4].tolist()}")
        for scale in scales:
            setattr(attn, scale, value)

    def _shard_sizes(self, fused: str) -> list[int]:
        cfg = self.config
        if fused == "qkv_proj":
            d = cfg.head_dim
            return [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d]
        return [cfg.intermediate_size, cfg.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters; every parameter must be covered once."""
        from ember.engine import fp8_loading, nvfp4_loading  # quantized linears are swapped in before params are read

        weights = nvfp4_loading.prepare(self, weights, source)
        fmt = getattr(self, "fp8", None)  # the FP8 format load_model chose (checkpoint's or --quantization)
        if fmt is not None and self.nvfp4_plan is None:
            self.fp8_packed = getattr(self, "fp8_packed", set()) | fp8_loading.install_linears(self, fmt)
            weights = fp8_loading.fill_linears(self, weights, source)
        self.materialize()
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        filled: dict[str, set[str]] = {}  # parameter -> the checkpoint tensors copied into it
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            kv_scale = _kv_scale_target(name.split("."))
            if kv_scale is not None:
                self._load_kv_scale(modules.get(kv_scale[0]), kv_scale[1], name, tensor, source)
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            if name in seen:
                raise ConfigError(f"{source}: tensor {name!r} appears more than once in the checkpoint")
            seen.add(name)
            parts = name.split(".")
            target, shard = name, None
            if len(parts) >= 3 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            param = params.get(target)
            if param is None:
                raise ConfigError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}")
            if shard is None:
                dest = param
            else:
                fused = target.split(".")[-2]
                # gate/up halves from the parameter itself: MoE models also fuse shared experts of another width
                sizes = [param.shape[0] // 2] * 2 if fused == "gate_up_proj" else self._shard_sizes(fused)
                start = sum(sizes[:shard])
                dest = param.narrow(0, start, sizes[shard])
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(dest.shape)}")
            dest.copy_(float_weight(tensor, name, source).to(dtype=dest.dtype))
            filled.setdefault(target, set()).add(name)
        for pname in params:
            missing = [n for n in _checkpoint_names(pname) if n not in filled.get(pname, ())]
            if missing:
                raise ConfigError(f"{source}: missing tensor(s) {', '.join(map(repr, missing))} "
                                  f"(for parameter {pname!r})")
