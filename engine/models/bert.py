"""Bidirectional encoders: BERT, RoBERTa and XLM-RoBERTa (``BertModel``, ``XLMRobertaModel``, ...) for embeddings
(bge, e5, all-MiniLM, bge-m3), and their ``...ForSequenceClassification`` forms for cross-encoder scoring
(bge-reranker, ms-marco MiniLM).

Every prompt is computed whole in one step (the engine turns chunked prefill and the prefix cache off for an
encoder) and attends to all of its own positions and no other prompt's; nothing is cached, so the model keeps no KV.
The output is the last layer's hidden states, transformers' ``last_hidden_state``.

Token types (BERT's segment embedding) are not sent by the front end; they are read from the prompt as the
tokenizer's pair encoding writes them: 0 up to and including the first separator token, 1 after it. A single text
is all 0s. RoBERTa-family models read type 0 everywhere (their tokenizers write no types) and count positions from
``pad_token_id + 1``.

A classifier's head (``score``) maps the first position's hidden state to the class logits: BERT's pooler
(dense + tanh) then ``classifier``; RoBERTa's ``classifier.dense`` + tanh then ``classifier.out_proj``.

Attention runs one SDPA per prompt, so the forward reads the prompts' boundaries back from the device once; an
encoder step is never graph-captured.
"""
from __future__ import annotations

from types import ModuleType
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ember.engine.attention import AttentionMetadata
from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models.layers import DecoderForCausalLM, float_weight

_PREFIXES = ("bert.", "roberta.")
_UNUSED = ("cls.", "lm_head.", "embeddings.position_ids")  # MLM heads and buffers a checkpoint may carry


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(int(cfg.raw.get("type_vocab_size", 2)), h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.rms_norm_eps)


class SelfAttention(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)


class DenseNorm(nn.Module):
    """A projection added to the residual, then LayerNorm (BERT's post-norm sublayer output)."""

    def __init__(self, d_in: int, h: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, h)
        self.LayerNorm = nn.LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, h: int, eps: float) -> None:
        super().__init__()
        self.self = SelfAttention(h)
        self.output = DenseNorm(h, h, eps)


class Intermediate(nn.Module):
    def __init__(self, h: int, inter: int) -> None:
        super().__init__()
        self.dense = nn.Linear(h, inter)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attention = Attention(h, eps)
        self.intermediate = Intermediate(h, cfg.intermediate_size)
        self.output = DenseNorm(cfg.intermediate_size, h, eps)
        self.heads = cfg.num_attention_heads
        self.tanh_gelu = cfg.hidden_act != "gelu"

    def forward(self, x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        sa = self.attention.self
        t, h = x.shape
        d = h // self.heads
        q, k, v = (p(x).view(t, self.heads, d).transpose(0, 1) for p in (sa.query, sa.key, sa.value))
        ctx = torch.empty_like(q)
        for lo, hi in zip(bounds, bounds[1:]):
            ctx[:, lo:hi] = F.scaled_dot_product_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi])
        x = self.attention.output(ctx.transpose(0, 1).reshape(t, h), x)
        inner = F.gelu(self.intermediate.dense(x), approximate="tanh" if self.tanh_gelu else "none")
        return self.output(inner, x)


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))


class BertPoolerHead(nn.Module):
    """BERT's classification head on the first position: ``classifier(tanh(pooler.dense(x)))``."""

    def __init__(self, pooler: nn.Linear, classifier: nn.Linear) -> None:
        super().__init__()
        self.pooler, self.classifier = pooler, classifier  # the model's own (registered there first, so the
        # checkpoint names, which named_parameters gives once per tensor, stay `pooler.dense.*` / `classifier.*`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(x)))


class RobertaClassificationHead(nn.Module):
    def __init__(self, h: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class _Pooler(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.dense = nn.Linear(h, h)


class BertEncoderModel(nn.Module):
    """One class for the six encoder architectures of `ember.engine.config.ENCODER_ARCHITECTURES`; module names
    follow transformers', so checkpoint names map by dropping the ``bert.`` / ``roberta.`` prefix."""

    is_encoder = True
    lm_head = None

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__()
        from ember.engine.models.classifier import labels

        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.position_offset = cfg.position_offset
        self.sep_token_id: int | None = None  # set by the engine from its tokenizer
        self.score: nn.Module | None = None
        if cfg.architecture.endswith("ForSequenceClassification"):
            n = len(labels(cfg))
            if cfg.position_offset:
                self.classifier = RobertaClassificationHead(cfg.hidden_size, n)
                self.score = self.classifier
            else:
                self.pooler = _Pooler(cfg.hidden_size)
                self.classifier = nn.Linear(cfg.hidden_size, n)
                self.score = BertPoolerHead(self.pooler.dense, self.classifier)

    @property
    def reads_token_types(self) -> bool:
        """BERT with a segment embedding: RoBERTa-family tokenizers write no token types (transformers feeds 0s)."""
        return self.embeddings.token_type_embeddings.num_embeddings > 1 and not self.position_offset

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: ModuleType) -> torch.Tensor:
        """``last_hidden_state`` ``[T, H]`` of every scheduled prompt (each a whole prompt, starting at position 0)."""
        bounds = meta.query_start_loc.tolist()
        positions = meta.positions + self.position_offset
        e = self.embeddings
        x = e.word_embeddings(input_ids) + e.position_embeddings(positions)
        x = x + e.token_type_embeddings(self._token_types(input_ids, meta))
        x = e.LayerNorm(x)
        for layer in self.encoder.layer:
            x = layer(x, bounds)
        return x

    def _token_types(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """1 from each prompt's ``token_type_start`` on (`SamplingParams`), 0 before; where that is not given, 1
        after the prompt's first separator; all 0 with one token type."""
        if not self.reads_token_types:
            return torch.zeros_like(input_ids)
        starts = meta.query_start_loc
        seg = torch.searchsorted(starts[1:].long(), torch.arange(input_ids.shape[0], device=input_ids.device),
                                 right=True)
        given = meta.token_type_starts[seg] if meta.token_type_starts is not None else None
        if self.sep_token_id is None:
            found = torch.zeros_like(input_ids)
        else:
            sep = (input_ids == self.sep_token_id).long()
            before = sep.cumsum(0) - sep  # separators strictly before each position, over the flat batch
            found = (before - before[starts[:-1].long()][seg] > 0).long()
        if given is None:
            return found
        return torch.where(given >= 0, (meta.positions >= given).long(), found)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.config.architecture} is an encoder: it has no LM head and samples nothing")

    def checkpoint_name(self, name: str) -> str | None:
        for p in _PREFIXES:
            if name.startswith(p):
                name = name[len(p):]
                break
        if name.startswith(_UNUSED) or (self.score is None and name.startswith("pooler.")):
            return None
        return name

    renamed = DecoderForCausalLM.renamed  # the checkpoint's tensors under `checkpoint_name`, skipped ones left out

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """Copy the checkpoint's tensors in (names as `checkpoint_name` gives them); each parameter exactly once."""
        device = getattr(self, "load_device", None)
        if device is not None:
            self.to_empty(device=device)
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            if name.endswith(("LayerNorm.gamma", "LayerNorm.beta")):  # older BERT checkpoints' names
                name = name[:-5] + ("weight" if name.endswith("gamma") else "bias")
            param = params.get(name)
            if param is None:
                raise ConfigError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                  f"{tuple(param.shape)}")
            param.copy_(float_weight(tensor, name, source).to(param.dtype))
            filled.add(name)
        missing = sorted(set(params) - filled)
        if missing:
            raise ConfigError(f"{source}: missing tensor(s) for parameter {missing[0]!r}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
