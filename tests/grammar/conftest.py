"""Shared fixtures: the real Qwen3 tokenizer (the demo model's where ../shared is absent) and its grammar backend."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SHARED_DATA, write_shared_tokenizer

QWEN3 = SHARED_DATA / "tokenizers" / "qwen3"


@pytest.fixture(scope="session")
def vocab_dir(tmp_path_factory) -> Path:
    """A folder with a tokenizer: the real Qwen3 one, else the built-in demo model's."""
    if (QWEN3 / "tokenizer.json.gz").exists():
        return write_shared_tokenizer("qwen3", tmp_path_factory.mktemp("qwen3-tok"))
    from ember.engine import demo

    return demo.build(tmp_path_factory.mktemp("demo-tok"))


@pytest.fixture(scope="session")
def hf_tok(vocab_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(vocab_dir))


@pytest.fixture(scope="session")
def backend(hf_tok):
    from ember.grammar import GrammarBackend

    eos = [hf_tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    return GrammarBackend.from_tokenizer(hf_tok, eos_ids=eos)

