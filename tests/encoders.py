"""Tiny random encoder checkpoints (BERT, XLM-RoBERTa and their classifiers) with a WordPiece tokenizer trained here,
saved as transformers saves them, for the engine and server tests of `ember.engine.models.bert`."""
from __future__ import annotations

import json
import pathlib

import torch

CORPUS = ["the cat sat on the mat", "a dog ran in the park", "hello world", "what is the capital of france",
          "paris is the capital of france", "the weather is cold today", "cats and dogs like to play"]

ARCHITECTURES = ("BertModel", "BertForSequenceClassification", "XLMRobertaModel",
                 "XLMRobertaForSequenceClassification")


def tokenizer():
    """A BERT WordPiece tokenizer (``[CLS] a [SEP] b [SEP]`` pairs with token types) over `CORPUS`."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    wp = BertWordPieceTokenizer()
    wp.train_from_iterator(CORPUS * 10, vocab_size=300, min_frequency=1)
    return BertTokenizerFast(tokenizer_object=wp._tokenizer, unk_token="[UNK]", sep_token="[SEP]",
                             cls_token="[CLS]", pad_token="[PAD]", mask_token="[MASK]")


def save_tiny_encoder(path: pathlib.Path, architecture: str, seed: int = 0, sentence_transformers: str | None = None,
                      **config):
    """A 2-layer random ``architecture`` (hidden 32, 4 heads) with the `tokenizer`; returns the transformers model
    (eval mode) and the tokenizer. ``sentence_transformers`` ("mean", "cls", ...) also writes modules.json with that
    pooling and a Normalize module, as sentence-transformers saves bge / e5 models."""
    import transformers

    tok = tokenizer()
    family = "XLMRoberta" if architecture.startswith("XLMRoberta") else "Bert"
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=130 if family == "XLMRoberta" else 128,
        **({"pad_token_id": 1, "type_vocab_size": 1} if family == "XLMRoberta" else {}), **config)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(cfg).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    if sentence_transformers:
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, f"pooling_mode_{sentence_transformers}_token"
             if sentence_transformers == "cls" else f"pooling_mode_{sentence_transformers}_tokens": True}))
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    return model, tok


def reference(model, tok, text: str, pair: str | None = None) -> torch.Tensor:
    """transformers' output for one input as the tokenizer encodes it (token types included where it writes
    them): ``last_hidden_state[0]`` ``[T, H]``, or a classifier's logits ``[num_labels]``."""
    enc = tok(text, pair, return_tensors="pt")
    if "XLMRoberta" in type(model).__name__:
        enc.pop("token_type_ids", None)
    with torch.no_grad():
        out = model(**enc)
    return out.logits[0] if hasattr(out, "logits") else out.last_hidden_state[0]


def serve_encoder(path, name: str):
    """The encoder saved at ``path`` served in-process as ``name`` (a `served` context: a `LiveServer`)."""
    from ember.server.config import ServeConfig
    from tests.server.conftest import served

    return served(ServeConfig(model_dir=path, served_model_name=name, max_num_seqs=4, kv_cache_blocks=64,
                              in_process=True))
