"""Speculative decoding under a grammar: a draft row's mask is the mask the constraint gives once the drafts before
it are accepted (thinking budget included), the constraint is left as it was, and constrained requests emit exactly
what they emit without speculation."""
from __future__ import annotations

import json

import torch

from ember.engine.engine import Engine
from ember.engine.eos import end_of_turn_ids
from ember.engine.params import SamplingParams
from ember.engine.speculative import speculates
from ember.grammar import GrammarBackend, compile_request
from ember.grammar.compiler import GrammarPlan
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import ParserSetup
from tests.grammar.test_engine import run as run_requests

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SCHEMA = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red fox", "red hen"]},
                                                    "minItems": 6, "maxItems": 6}},
          "required": ["tags"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


def _mask(backend: GrammarBackend, fill) -> torch.Tensor:
    bm = torch.zeros(1, (backend.vocab_size + 31) // 32, dtype=torch.int32)
    fill(bm)
    return bm


def test_a_draft_rows_mask_is_the_mask_after_its_drafts_and_the_constraint_stays_put(demo_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model_dir))
    backend = GrammarBackend.from_pretrained(demo_model_dir, eos_ids=end_of_turn_ids(None, demo_model_dir))
    setup = ParserSetup.from_tokenizer(tok, "qwen3")
    close = setup.delimiter_ids["</think>"]
    plan = compile_request(setup.profile, InitialState.REASONING, setup.delimiter_ids,
                           response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
                           thinking_budget=3)
    text = tok.encode("ab cd", add_special_tokens=False)[:3] + [close] + tok.encode('{"tags": ["red fox", "red',
                                                                                    add_special_tokens=False)
    c = backend.constraint(plan)
    assert speculates(SamplingParams(), c)
    for start in range(len(text)):  # from each point of the text, drafts of every length (past the budget's end too)
        for n in range(0, 5):
            draft = text[start:start + n]
            want = backend.constraint(plan)
            for t in text[:start] + draft:
                assert want.accept_token(t)
            before = _mask(backend, lambda bm: c.fill_bitmask(bm, 0))
            got = _mask(backend, lambda bm: c.fill_bitmask_after(draft, bm, 0))
            assert torch.equal(got, _mask(backend, lambda bm: want.fill_bitmask(bm, 0)))
            assert torch.equal(_mask(backend, lambda bm: c.fill_bitmask(bm, 0)), before)  # nothing moved
        assert c.accept_token(text[start])
    c = backend.constraint(plan)
    spent = text[:3] + text[:1]  # a fourth thought token once the budget of 3 is spent: the row is never kept
    assert _mask(backend, lambda bm: c.fill_bitmask_after(spent, bm, 0)).eq(-1).all()
    assert c.accept_token(text[0]) and c.reasoning_tokens == 1


def _run(model_dir, backend: GrammarBackend, grammar: str, requests, speculative_config):
    """(per request: token ids, finish_reason, error; the engine) for ``requests`` under ``grammar``."""
    eng = Engine.from_pretrained(model_dir, num_kv_blocks=128, speculative_config=speculative_config,
                                 bitmask_filler=backend.bitmask_filler())
    return run_requests(eng, [(p, params, backend.constraint(GrammarPlan(grammar=grammar, budget=None)))
                              for p, params in requests]), eng


def test_constrained_requests_emit_what_they_emit_without_speculation(demo_model_dir):
    backend = GrammarBackend.from_pretrained(demo_model_dir, eos_ids=end_of_turn_ids(None, demo_model_dir))
    grammar = json.dumps({"grammars": [{"json_schema": SCHEMA}]})
    requests = [([10, 11, 12], SamplingParams(max_tokens=60, temperature=0.0)),
                ([20, 21], SamplingParams(max_tokens=60, temperature=0.0, repetition_penalty=1.05)),
                ([30, 31, 32], SamplingParams(max_tokens=60, temperature=0.8, seed=4))]
    want, plain = _run(demo_model_dir, backend, grammar, requests, None)
    got, eng = _run(demo_model_dir, backend, grammar, requests, NGRAM)
    assert got == want
    assert all(r[1:] == ("stop", None) for r in want), want  # each reply is the whole document
    assert eng.stats().spec_accepted_tokens > 0 and eng.num_steps < plain.num_steps


def test_eos_drafted_past_a_complete_grammar_is_kept_as_plain_decoding_keeps_it(demo_model_dir):
    """With ``ignore_eos`` a finished grammar allows only EOS, over and over; a stopped llguidance matcher consumes
    EOS yet refuses it in ``validate_tokens``, so the rows after a drafted EOS must still be its EOS-only mask."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model_dir))
    eos = end_of_turn_ids(None, demo_model_dir)
    backend = GrammarBackend.from_pretrained(demo_model_dir, eos_ids=eos)
    plan = GrammarPlan(grammar=json.dumps({"grammars": [{"lark_grammar": 'start: ("red" | " fox")+'}]}), budget=None)
    text = tok.encode("red fox", add_special_tokens=False)
    end = min(eos)
    c = backend.constraint(plan)
    for t in text:
        assert c.accept_token(t)
    want = backend.constraint(plan)
    for t in text + [end, end]:
        assert want.accept_token(t)
    only_eos = _mask(backend, lambda bm: want.fill_bitmask(bm, 0))
    assert not only_eos.eq(-1).all()
    for n in range(1, 4):
        assert torch.equal(_mask(backend, lambda bm: c.fill_bitmask_after([end] * n, bm, 0)), only_eos)
    assert c.accept_token(end) and c.accept_token(end)  # the drafts rolled back nothing the constraint had
    assert torch.equal(_mask(backend, lambda bm: c.fill_bitmask(bm, 0)), only_eos)

    prompt = tok.encode("red fox red fox red fox red fox red fox", add_special_tokens=False)
    requests = [(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))]
    want_out, _ = _run(demo_model_dir, backend, plan.grammar, requests, None)
    got, eng = _run(demo_model_dir, backend, plan.grammar, requests, NGRAM)
    assert got == want_out
    assert want_out[0][1] == "length" and eng.stats().spec_accepted_tokens > 0, want_out
