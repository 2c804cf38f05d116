"""Sequence-classification checkpoints (``Qwen3ForSequenceClassification``, ``LlamaForSequenceClassification``, the
``*-seq-cls`` conversions of Qwen3-Reranker, ...): the decoder of the matching causal LM with a ``score`` head
``[num_labels, hidden]`` (no bias) in place of the LM head. The engine applies the head to a pooling request's pooled
hidden state (the last token's, as transformers and vLLM read a decoder classifier), so such a model answers pooling
requests with ``num_labels`` logits and generates nothing.
"""
from __future__ import annotations

from torch import nn

from ember.engine.config import ModelConfig

SUFFIX = "ForSequenceClassification"


def causal_architecture(architecture: str) -> str | None:
    """The causal LM whose decoder a classification architecture uses (None: ``architecture`` does not classify)."""
    return architecture[:-len(SUFFIX)] + "ForCausalLM" if architecture.endswith(SUFFIX) else None


def labels(cfg: ModelConfig) -> tuple[str, ...]:
    """The class names in head-row order: config.json's ``id2label``, else ``LABEL_i`` for ``num_labels`` classes
    (transformers' default of 2 when neither is written)."""
    raw = cfg.raw
    id2label = raw.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(len(id2label)))
    return tuple(f"LABEL_{i}" for i in range(int(raw.get("num_labels") or 2)))


def activation(cfg: ModelConfig) -> str:
    """How logits become probabilities: ``sigmoid`` per class for one class or a ``multi_label_classification``
    ``problem_type`` (as transformers trains those), else ``softmax`` over the classes."""
    multi = cfg.raw.get("problem_type") == "multi_label_classification"
    return "sigmoid" if multi or len(labels(cfg)) == 1 else "softmax"


def attach_head(model: nn.Module, cfg: ModelConfig) -> None:
    """Give ``model`` (built, not yet loaded) the ``score`` head the checkpoint holds, and no LM head."""
    ref = model.model.embed_tokens.weight
    model.lm_head = None
    model.score = nn.Linear(cfg.hidden_size, len(labels(cfg)), bias=False, device=ref.device, dtype=ref.dtype)
