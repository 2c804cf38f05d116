"""A thinking budget under a grammar: a budget spent on a token that begins a UTF-8 character lets the character end
(the grammar cannot close the thought inside it) and then closes, so a valid request never fails there."""
from __future__ import annotations

import pytest
import torch

from ember.grammar import compile_request
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import ParserSetup
from ember.parsers.tokens import gpt2_byte_decoder


def _allowed(backend, c) -> set[int]:
    bm = torch.zeros(1, (backend.vocab_size + 31) // 32, dtype=torch.int32)
    c.fill_bitmask(bm, 0)
    bits = ((bm[0].unsqueeze(1) >> torch.arange(32)) & 1).reshape(-1)[: backend.vocab_size]
    return set(bits.nonzero().flatten().tolist())


def test_a_budget_spent_inside_a_character_closes_once_the_character_ends(hf_tok, backend):
    """Forcing the close at once made the grammar refuse it, and 3 seeds in 40 of a valid json_object request with
    max_thinking_tokens failed with a 400 ("token ... rejected by the grammar")."""
    setup = ParserSetup.from_tokenizer(hf_tok, "qwen3")
    close = setup.delimiter_ids["</think>"]
    byte_token = {b: c for c, b in gpt2_byte_decoder().items()}
    lead, tail = (hf_tok.convert_tokens_to_ids(byte_token[b]) for b in "é".encode())  # 0xC3, 0xA9
    if hf_tok.unk_token_id in (lead, tail) or None in (lead, tail):
        pytest.skip("this vocabulary has no byte tokens")
    plan = compile_request(setup.profile, InitialState.REASONING, setup.delimiter_ids,
                           response_format={"type": "json_object"}, thinking_budget=2)
    c = backend.constraint(plan)
    assert c.accept_token(hf_tok.encode("a", add_special_tokens=False)[0]) and c.accept_token(lead)
    allowed = _allowed(backend, c)
    assert close not in allowed and tail in allowed  # the character first, one token past the budget
    assert c.accept_token(tail)
    assert _allowed(backend, c) == {close}
    assert c.accept_token(close)
    assert all(c.accept_token(t) for t in hf_tok.encode('{"a": 1}', add_special_tokens=False))


def test_a_budget_for_a_model_that_opens_no_thought_on_a_token_is_nothing_to_bound(tmp_path):
    """DeepSeek-V3's vocabulary has no <think> / </think> tokens: its replies open no thought, so a budget (Anthropic
    ``thinking: enabled``, as agents send it) is ignored, as for a family without reasoning; it was a 400 naming no
    field. A reply that starts inside a thought it cannot close on a token is still refused, naming the field."""
    from transformers import AutoTokenizer

    from ember.grammar import GrammarError
    from tests.conftest import write_shared_tokenizer

    tok = AutoTokenizer.from_pretrained(write_shared_tokenizer("deepseek-v3", tmp_path / "ds"))
    setup = ParserSetup.from_tokenizer(tok, "deepseek_v3")
    assert "</think>" not in setup.delimiter_ids
    plan = compile_request(setup.profile, InitialState.CONTENT, setup.delimiter_ids, thinking_budget=1024)
    assert plan is None or plan.budget is None
    with pytest.raises(GrammarError, match="^max_thinking_tokens: "):
        compile_request(setup.profile, InitialState.REASONING, setup.delimiter_ids, thinking_budget=1024)
