"""What the engine knows about a model (read from config.json) and how it was asked to run (the vLLM-named options)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class ConfigError(ValueError):
    """A checkpoint's config is missing something or names something Ember does not support."""


class SettingError(ConfigError):
    """A setting's value that this model or machine cannot take, found as the engine starts: ``flag`` is the
    setting's `ember serve` flag, so the front end reports it as the bad argument it is."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


KV_CACHE_DTYPES = ("auto", "fp8")
"""``auto``: the KV cache holds the model dtype; ``fp8``: e4m3 with per-layer k/v scales from the checkpoint."""


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for a ``kv_cache_dtype`` setting; ValueError naming the choices."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[str(value).removeprefix("torch.").lower()]
    except KeyError:
        raise ConfigError(f"unsupported dtype {value!r}; expected one of {sorted(_DTYPES)}") from None


ENCODER_ARCHITECTURES = frozenset({
    "BertModel", "BertForSequenceClassification", "RobertaModel", "RobertaForSequenceClassification",
    "XLMRobertaModel", "XLMRobertaForSequenceClassification",
})
"""Bidirectional encoders (`ember.engine.models.bert`): they embed and score prompts and generate nothing."""

_ENCODER_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh")


_TIED_BY_DEFAULT = frozenset({"gemma2", "gemma3", "gemma3_text", "smollm3"})
"""Model types whose transformers config class ties the LM head to the embeddings when config.json has no
``tie_word_embeddings`` (configs saved by transformers 4 leave the key out when it equals that default); every other
architecture Ember serves defaults to untied (checked against the installed transformers' ``configuration_*.py``)."""

_FIELD_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                   rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                        rms_norm_eps=1e-6, rope_local_base_freq=10000.0,
                        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
                        sliding_window_pattern=6),
    "mistral": dict(sliding_window=4096),
    "phi3": dict(original_max_position_embeddings=4096),
}
"""Fields a config.json may leave out, filled as transformers' config class for the model type fills them (its
class defaults, from the installed transformers): Gemma 3's multimodal checkpoints (gemma-3-4b-it, 27b-it) list only
the text fields that differ from ``Gemma3TextConfig``'s. Only keys absent from config.json are filled (an explicit
``null`` stays)."""

_MODEL_TYPE_BY_ARCHITECTURE = (("Gemma3ForConditionalGeneration", "gemma3_text"), ("Gemma3", "gemma3_text"),
                               ("Gemma2", "gemma2"), ("SmolLM3", "smollm3"), ("Mistral3", "mistral"),
                               ("Ministral3", "ministral3"), ("Mistral", "mistral"), ("Mixtral", "mixtral"),
                               ("Phi3", "phi3"), ("Qwen2Moe", "qwen2_moe"), ("Qwen3Moe", "qwen3_moe"),
                               ("Qwen2", "qwen2"), ("Qwen3ForCausalLM", "qwen3"), ("Qwen3ForSequence", "qwen3"),
                               ("GptOss", "gpt_oss"))


def rope_field(raw: dict[str, Any], name: str) -> Any:
    """A RoPE setting (``rope_theta``, ``partial_rotary_factor``) of a config.json: from ``rope_parameters`` first,
    where transformers 5 keeps it and reads it when a stale top-level copy disagrees, else the top level
    (transformers 4); None when neither has it."""
    params = raw.get("rope_parameters")
    value = params.get(name) if isinstance(params, dict) else None
    return value if value is not None else raw.get(name)


def model_family(model_type: str | None, architecture: str) -> str:
    """The transformers model type whose config rules apply: config.json's ``model_type`` (a multimodal checkpoint's
    ``gemma3`` read as its text model's ``gemma3_text``), or where it has none, the one its architecture implies."""
    if model_type:
        return "gemma3_text" if model_type == "gemma3" else model_type
    for prefix, family in _MODEL_TYPE_BY_ARCHITECTURE:
        if architecture.startswith(prefix):
            return family
    return ""


def _own_activation(family: str) -> bool:
    """Gemma reads ``hidden_activation`` (GELU-tanh) and checks it itself (`ember.engine.models.gemma3`)."""
    return family in ("gemma2", "gemma3_text")


@dataclass
class ModelConfig:
    """The architecture facts the model code needs, normalised across transformers v4/v5 config spellings.

    ``num_key_value_heads`` and ``head_dim`` are also the KV cache's geometry; for MLA models (``kv_lora_rank`` in
    config.json) that is one latent head of ``kv_lora_rank + qk_rope_head_dim`` (the model reads its real head
    dimensions from ``raw``). A multimodal config.json's ``text_config`` is read as the model's config (over its
    top-level fields), and ``raw`` is that merged view."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    torch_dtype: torch.dtype | None = None  # config.json torch_dtype / dtype: None unless float32, float16 or bfloat16
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def raw_int(self, key: str) -> int:
        """config.json's positive integer ``key``, for fields this class does not normalise; ConfigError naming the
        architecture and the field when it is missing or not positive."""
        value = self.raw.get(key)
        if value is None or int(value) < 1:
            raise ConfigError(f"config.json: {self.architecture} needs a positive {key!r}")
        return int(value)

    @property
    def max_context(self) -> int:
        """The longest context the model serves, derived as vLLM derives it: ``max_position_embeddings``, or for YaRN
        its pretrained length times ``factor`` where that is longer (so a YaRN ``rope_scaling`` given by
        ``--hf-overrides``, e.g. Qwen3's factor 4 over 32768, extends the context to 131072)."""
        if self.position_offset:
            return self.max_position_embeddings - self.position_offset
        s = self.rope_scaling or {}
        if s.get("rope_type") == "yarn" and s.get("factor") and s.get("original_max_position_embeddings"):
            extended = int(float(s["original_max_position_embeddings"]) * float(s["factor"]))
            return max(self.max_position_embeddings, extended)
        return self.max_position_embeddings

    @property
    def is_encoder(self) -> bool:
        """A bidirectional encoder (`ENCODER_ARCHITECTURES`): no KV cache, no generation."""
        return self.architecture in ENCODER_ARCHITECTURES

    @property
    def position_offset(self) -> int:
        """Where RoBERTa-family encoders start counting positions: after the padding index (``pad_token_id + 1``),
        so their usable length is ``max_position_embeddings`` minus it; 0 for every other model."""
        if self.is_encoder and self.model_type in ("roberta", "xlm-roberta"):
            return int(self.raw.get("pad_token_id", 1)) + 1
        return 0

    @property
    def linear_attention_layers(self) -> list[int]:
        """Layers that keep a per-sequence recurrent state instead of KV (Qwen3-Next's ``linear_attention``), read
        as transformers does: ``layer_types`` where given, else all but every ``full_attention_interval``-th layer."""
        types = self.raw.get("layer_types")
        if types:
            return [i for i, t in enumerate(types) if t == "linear_attention"]
        hybrid = self.model_type.startswith(("qwen3_next", "qwen3_5"))
        interval = self.raw.get("full_attention_interval") if hybrid else None
        return [i for i in range(self.num_hidden_layers) if (i + 1) % int(interval)] if interval else []

    @property
    def num_kv_layers(self) -> int:
        """Layers with a paged KV cache (none in an encoder: each prompt is computed whole, in one step)."""
        if self.is_encoder:
            return 0
        return self.num_hidden_layers - len(self.linear_attention_layers)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ConfigError(f"{source}: no 'architectures' entry")
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ConfigError(f"{source}: 'architectures' must be a list of class names, got {archs!r}")
        tied_default = None
        if isinstance(cfg.get("text_config"), dict):  # a multimodal checkpoint: Ember serves its language model
            top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "audio_config")}
            merged = {**top, **cfg["text_config"], "architectures": archs}
            if "tie_word_embeddings" in top:  # transformers ties by the outer config's setting
                merged["tie_word_embeddings"] = top["tie_word_embeddings"]
            # neither says: tied only where both the outer and the text config classes tie by default (Gemma 3).
            # Where they disagree (Mistral 3's outer class ties, its text one does not), untied: a checkpoint that
            # has no lm_head.weight is then refused, where a wrong tie would drop a real head in silence.
            tied_default = (model_family(top.get("model_type"), archs[0]) in _TIED_BY_DEFAULT
                            and model_family(merged.get("model_type"), archs[0]) in _TIED_BY_DEFAULT)
            cfg = merged
        family = model_family(cfg.get("model_type"), archs[0])
        defaults = _FIELD_DEFAULTS.get(family)
        if defaults:
            cfg = {**defaults, **cfg}
        if tied_default is None:
            tied_default = family in _TIED_BY_DEFAULT

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ConfigError(f"{source}: missing required field {key!r}")
            return cfg[key]

        for key in _POSITIVE_FIELDS:
            value = cfg.get(key)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = rope_field(cfg, "rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        if isinstance(rope_scaling, dict):
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling = None if kind == "default" else dict(rope_scaling, rope_type=kind)
            if kind in ("llama3", "yarn", "longrope", "su"):
                # as transformers' standardize_rope_params reads it: a top-level original_max_position_embeddings
                # (Phi-3 keeps the pretrained length there) wins over the rope dict's, which defaults to the config's
                # max_position_embeddings
                if cfg.get("original_max_position_embeddings") is not None:
                    rope_scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
                elif rope_scaling.get("original_max_position_embeddings") is None:
                    rope_scaling["original_max_position_embeddings"] = cfg.get("max_position_embeddings")
            if kind == "yarn" and rope_scaling.get("factor") is None and cfg.get("max_position_embeddings"):
                # transformers' implicit YaRN factor: the served length over the pretrained one
                pretrained = rope_scaling["original_max_position_embeddings"]
                rope_scaling["factor"] = cfg["max_position_embeddings"] / pretrained
            if kind in ("longrope", "su"):
                rope_scaling.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
        eos = cfg.get("eos_token_id")
        eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        act = cfg.get("hidden_act", "silu")
        encoder = archs[0] in ENCODER_ARCHITECTURES
        if _own_activation(family):  # transformers' Gemma reads hidden_activation (its model checks it)
            act = cfg.get("hidden_activation") or act
        elif act not in (_ENCODER_ACTS if encoder else ("silu", "swish")):
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only "
                              f"{', '.join(_ENCODER_ACTS) if encoder else 'silu'})")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3) caches one latent "head": kv_lora_rank + rope dims
            kv_heads, head_dim = 1, int(cfg["kv_lora_rank"]) + int(need("qk_rope_head_dim"))
        return cls(
            architecture=archs[0],
            model_type=cfg.get("model_type", ""),
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            # MoE-only text configs (Qwen3.5-MoE) may leave the dense width out
            intermediate_size=int(cfg.get("intermediate_size") or cfg.get("moe_intermediate_size")
                                  or need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("layer_norm_eps" if encoder else "rms_norm_eps", 1e-12 if encoder else 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tied_default)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=act,
            torch_dtype=_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype")).removeprefix("torch.").lower()),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list,
            raw=cfg,
        )


_POSITIVE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size",
                    "max_position_embeddings")
"""config.json sizes that must be whole numbers of at least 1 where given (a bad one failed deep in torch)."""


@dataclass
class EngineConfig:
    """How the engine runs; names follow vLLM's flags."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    tensor_parallel_size: int = 1  # ranks that split every layer (ember.engine.distributed)
    enforce_eager: bool = False  # never capture CUDA graphs for decode steps (they are captured on CUDA otherwise)
    async_scheduling: bool = False  # launch the next step before reading this one's tokens (`Engine.step`)
    kv_cache_dtype: str = "auto"  # "fp8": an e4m3 KV cache (half the bytes of bf16), per-layer scales
    quantization: str | None = None  # "fp8": quantize an unquantized checkpoint's projections to FP8 as they load
    state_snapshots: int | None = None  # hybrid models' saved states for prefix caching (None: max_num_seqs)
    hf_overrides: dict[str, Any] | None = None  # config.json fields changed before loading (vLLM's --hf-overrides)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) of each LoRA adapter served
    max_loras: int = 1  # adapter slots on the device (at least one per adapter in lora_modules)
    max_lora_rank: int = 16  # the largest adapter rank accepted (slots are sized for it)
    enable_lora: bool = False  # wrap the projections for adapters even with none at start (runtime loading)
    seed: int | None = None  # torch's generator seeded at start (vLLM's --seed): unseeded draws repeat run to run
    tokenizer: str | None = None  # the tokenizer's folder, when it is not the model's
    max_logprobs: int = 20  # the most alternatives per token a request may ask for (-1: the vocabulary)
    scheduling_policy: str = "fcfs"  # "priority": requests ordered by (priority, arrival) instead of arrival
    speculative_config: dict[str, Any] | None = None  # vLLM's JSON; "ngram" prompt lookup (`ember.engine.speculative`)
