"""The grammar backend of a checkpoint folder (the built-in demo model: a small vocabulary, quick to load)."""
from __future__ import annotations

import json

import torch

from ember.engine.eos import end_of_turn_ids
from ember.grammar import GrammarBackend, compile_request
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import ParserSetup


def test_from_pretrained_takes_every_eos_and_the_model_vocab(demo_model_dir):
    backend = GrammarBackend.from_pretrained(demo_model_dir, eos_ids=end_of_turn_ids(None, demo_model_dir))
    gen = json.loads((demo_model_dir / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) <= set(backend.eos_ids)
    assert backend.vocab_size == json.loads((demo_model_dir / "config.json").read_text())["vocab_size"]


def test_rows_beyond_the_tokenizer_are_never_allowed(demo_model_dir):
    """A model whose embedding has padding rows past the tokenizer's last token: those ids are masked out."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model_dir))
    n_tok = len(tok)
    backend = GrammarBackend.from_tokenizer(tok, vocab_size=n_tok + 40, eos_ids=[tok.eos_token_id])
    assert backend.vocab_size == n_tok + 40
    setup = ParserSetup.from_tokenizer(tok, "qwen3")
    plan = compile_request(setup.profile, InitialState.REASONING, setup.delimiter_ids,
                           response_format={"type": "json_object"})
    c = backend.constraint(plan)
    words = (backend.vocab_size + 31) // 32
    for step in (tok.encode("hi", add_special_tokens=False) + [setup.delimiter_ids["</think>"]] +
                 tok.encode('{"a', add_special_tokens=False)):
        bm = torch.zeros(1, words, dtype=torch.int32)
        backend.bitmask_filler()([c], bm)
        bits = ((bm.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)
        assert bits[:n_tok].any() and not bits[n_tok:].any()
        assert c.accept_token(step)
