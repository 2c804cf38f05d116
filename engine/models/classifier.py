"""Sequence-classification checkpoints (``Qwen3ForSequenceClassification``, ``LlamaForSequenceClassification``, the
``*-seq-cls`` conversions of Qwen3-Reranker, ...): the decoder of the matching causal LM with a ``score`` head
``[num_labels, hidden]`` (no bias) in place of the LM head. The engine applies the head to a pooling request's pooled
hidden state (the last token's, as transformers and vLLM read a decoder classifier), so such a model answers pooling
requests with ``num_labels`` logits and generates nothing.

A causal LM becomes such a classifier the way vLLM converts one online (``--hf-overrides`` naming the
``...ForSequenceClassification`` architecture): ``classifier_from_token`` names vocabulary tokens whose LM-head rows
make the head, by ``method``:

- ``from_2_way_softmax`` (two tokens, ``[false, true]``; implied by ``is_original_qwen3_reranker``): one class whose
  logit is the true token's logit minus the false one's, so its sigmoid is the LM's softmax over the two (the original
  Qwen3-Reranker's ``["no", "yes"]``, mxbai-rerank-v2's ``["0", "1"]``);
- ``no_post_processing``: one class per token, its logit the LM's (bge-reranker-v2-gemma's ``["Yes"]``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ember.engine import loader
from ember.engine.config import ConfigError, ModelConfig

SUFFIX = "ForSequenceClassification"


def causal_architecture(architecture: str) -> str | None:
    """The causal LM whose decoder a classification architecture uses (None: ``architecture`` does not classify)."""
    return architecture[:-len(SUFFIX)] + "ForCausalLM" if architecture.endswith(SUFFIX) else None


METHODS = ("from_2_way_softmax", "no_post_processing")


@dataclass(frozen=True)
class TokenHead:
    """A head made of LM-head rows (vLLM's online conversion): the tokens and how their rows combine."""

    tokens: tuple[str, ...]
    method: str

    @property
    def num_labels(self) -> int:
        return 1 if self.method == "from_2_way_softmax" else len(self.tokens)


def token_head(cfg: ModelConfig) -> TokenHead | None:
    """The conversion config.json (with ``--hf-overrides``) asks for, or None for a checkpoint with its own ``score``
    head; ConfigError naming the field when the request is incomplete or contradictory."""
    raw = cfg.raw
    tokens, method = raw.get("classifier_from_token"), raw.get("method")
    if raw.get("is_original_qwen3_reranker"):
        method = method or "from_2_way_softmax"
    if tokens is None and not raw.get("is_original_qwen3_reranker"):
        return None
    where = "config.json (or --hf-overrides)"
    if not causal_architecture(cfg.architecture):
        raise ConfigError(f"{where}: classifier_from_token turns a causal LM into a classifier; also set "
                          f"\"architectures\" to its ...{SUFFIX} form (got {cfg.architecture})")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ConfigError(f"{where}: classifier_from_token must be a non-empty list of vocabulary tokens, "
                          f"got {tokens!r}")
    if method not in METHODS:
        raise ConfigError(f"{where}: method must be one of {', '.join(METHODS)} (or is_original_qwen3_reranker: "
                          f"true) with classifier_from_token, got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ConfigError(f"{where}: from_2_way_softmax needs two classifier_from_token entries [false, true], "
                          f"got {tokens!r}")
    return TokenHead(tuple(tokens), method)


def labels(cfg: ModelConfig) -> tuple[str, ...]:
    """The class names in head-row order: config.json's ``id2label``, else ``LABEL_i`` for ``num_labels`` classes
    (transformers' default of 2 when neither is written; a converted causal LM's count is its `TokenHead`'s)."""
    raw = cfg.raw
    head = token_head(cfg)
    n = head.num_labels if head is not None else None
    id2label = raw.get("id2label")
    if isinstance(id2label, dict) and id2label and n in (None, len(id2label)):
        return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(len(id2label)))
    return tuple(f"LABEL_{i}" for i in range(n or int(raw.get("num_labels") or 2)))


def joins_pairs(cfg: ModelConfig) -> bool:
    """Whether a cross-encoder reads a (query, document) pair as the two texts joined into one (vLLM's
    ``use_pad_token: false``, the default for a converted causal LM and written by vLLM's ``-seq-cls`` converter)
    rather than as the tokenizer's pair encoding."""
    return not cfg.raw.get("use_pad_token", token_head(cfg) is None)


def activation(cfg: ModelConfig) -> str:
    """How logits become probabilities: ``sigmoid`` per class for one class or a ``multi_label_classification``
    ``problem_type`` (as transformers trains those), else ``softmax`` over the classes."""
    multi = cfg.raw.get("problem_type") == "multi_label_classification"
    return "sigmoid" if multi or len(labels(cfg)) == 1 else "softmax"


SCORE_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "sigmoid", "Tanh": "tanh", "ReLU": "relu"}
"""The ``torch.nn.modules`` classes Ember applies to a cross-encoder's logit, by class name, with the name
`score_activation` gives each."""


def score_activation(cfg: ModelConfig) -> str:
    """How a cross-encoder's class logit becomes its score, as vLLM's ``get_cross_encoder_activation_function`` reads
    config.json: the ``torch.nn.modules`` class named by ``sentence_transformers.activation_fn`` (as
    sentence-transformers' CrossEncoder saves it), else by ``sbert_ce_default_activation_function``, else
    ``sigmoid``. ConfigError naming the field for a class outside ``torch.nn.modules`` (which vLLM refuses to load)
    or one not in `SCORE_ACTIVATIONS`."""
    raw = cfg.raw
    st = raw.get("sentence_transformers")
    if isinstance(st, dict) and "activation_fn" in st:
        field, name = "sentence_transformers.activation_fn", st["activation_fn"]
    else:
        field, name = "sbert_ce_default_activation_function", raw.get("sbert_ce_default_activation_function")
    if name is None:
        return "sigmoid"
    where = f"config.json (or --hf-overrides): {field}"
    if not isinstance(name, str) or not name.startswith("torch.nn.modules."):
        raise ConfigError(f"{where} must name a torch.nn.modules class (as vLLM, Ember loads a cross-encoder's "
                          f"activation from nowhere else), got {name!r}")
    cls = name.rsplit(".", 1)[1]
    if cls not in SCORE_ACTIVATIONS:
        raise ConfigError(f"{where}: {name!r} is not supported; Ember applies torch.nn.modules "
                          f"{', '.join(SCORE_ACTIVATIONS)}")
    return SCORE_ACTIVATIONS[cls]


def attach_head(model: nn.Module, cfg: ModelConfig) -> None:
    """Give ``model`` (built, not yet loaded) the ``score`` head the checkpoint holds, and no LM head."""
    ref = model.model.embed_tokens.weight
    model.lm_head = None
    model.score = nn.Linear(cfg.hidden_size, len(labels(cfg)), bias=False, device=ref.device, dtype=ref.dtype)


def _token_ids(tokenizer_dir: str | Path, head: TokenHead) -> list[int]:
    from ember.engine.checkpoint import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    ids = []
    for t in head.tokens:
        i = tok.convert_tokens_to_ids(t)
        if not isinstance(i, int) or tok.convert_ids_to_tokens(i) != t:
            raise ConfigError(f"classifier_from_token: {t!r} is not one token of {tokenizer_dir}'s vocabulary")
        ids.append(i)
    return ids


def converted_head_weight(model: nn.Module, files: list[Path], tokenizer_dir: str | Path,
                          head: TokenHead) -> torch.Tensor:
    """The ``score`` weight of a converted causal LM, computed in fp32 from the LM head's rows of ``head``'s tokens
    (their IDs in the tokenizer of ``tokenizer_dir``; the input embedding's rows when the checkpoint ties them), read
    straight from the safetensors ``files`` so every tensor-parallel rank builds the same replicated head."""
    ids = _token_ids(tokenizer_dir, head)
    wanted = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    for f in files:
        with loader.open_safetensors(f) as sf:
            name = next((k for k in sf.keys() if model.checkpoint_name(k) == wanted), None)
            if name is None:
                continue
            table = sf.get_slice(name)
            if table.get_dtype() not in ("F32", "F16", "BF16"):
                raise ConfigError(f"{f}: classifier_from_token reads {name!r}, which is stored as "
                                  f"{table.get_dtype()}; Ember converts an unquantized LM head only")
            rows = torch.cat([table[i:i + 1] for i in ids]).float()
            break
    else:
        raise ConfigError(f"classifier_from_token needs the LM head's rows, but no {wanted!r} tensor was found in "
                          f"{', '.join(str(f) for f in files)}")
    if head.method == "from_2_way_softmax":
        return rows[1:2] - rows[0:1]
    return rows
