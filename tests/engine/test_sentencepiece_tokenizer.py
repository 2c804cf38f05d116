"""A checkpoint whose tokenizer is only a SentencePiece ``tokenizer.model`` (no tokenizer.json), as older Llama and
Mistral releases ship it, loads (sentencepiece and protobuf are dependencies, as in vLLM), and the output pipeline's
token bytes decode as the tokenizer does."""
from __future__ import annotations

import json

from ember.engine import checkpoint
from ember.parsers.tokens import TokenBytes

TEXT = "the quick brown fox jumps over the lazy dog. lorem ipsum dolor sit amet, 42 étés à Noël!\n" * 20


def test_a_tokenizer_model_alone_loads_and_decodes_as_the_tokenizer(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   minloglevel=2)
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.model").write_bytes((tmp_path / "sp.model").read_bytes())
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False}))
    tok = checkpoint.load_tokenizer(model)  # it was "tiktoken is required to read a tiktoken file"
    ids = tok.encode("the lazy fox, über étés", add_special_tokens=False)
    assert tok.decode(ids) == "the lazy fox, über étés"
    tb = TokenBytes.from_tokenizer(tok)
    assert b"".join(tb.token_bytes(i) for i in ids).decode().lstrip(" ") == tok.decode(ids)
