"""Encoder checkpoints (BERT, XLM-RoBERTa, their classifiers) in the engine: each prompt of a mixed batch gets what
transformers computes for it alone, pair token types included; nothing is generated, chunked or cached."""
from __future__ import annotations

import pytest
import torch

from ember.engine.config import ConfigError
from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from tests.encoders import ARCHITECTURES, reference, save_tiny_encoder

INPUTS = [("the cat sat on the mat", None), ("what is the capital of france", "paris is the capital of france"),
          ("hello", None), ("cats and dogs like to play in the park " * 3, "the weather is cold today")]


def _run(eng: Engine, prompts: list[list[int]], pooling: str) -> list[torch.Tensor]:
    rids = [eng.add_request(p, SamplingParams(pooling=pooling)) for p in prompts]
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                assert o.finish_reason == "stop", o.error
                done[o.request_id] = torch.tensor(o.embedding)
    return [done[r] for r in rids]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=ARCHITECTURES)
def encoder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model, tok = save_tiny_encoder(path, request.param, seed=3, num_labels=3 if "Roberta" in request.param else 1)
    return request.param, path, model, tok


def test_each_prompt_of_a_batch_gets_transformers_output(encoder):
    arch, path, model, tok = encoder
    # more tokens than one step takes (at least the model's length, 128): each prompt is still computed whole, in
    # one step, never chunked across two
    eng = Engine.from_pretrained(path, num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=16)
    inputs = INPUTS * 3
    prompts = [tok(a, b)["input_ids"] for a, b in inputs]
    assert sum(len(p) for p in prompts) > eng.scheduler.max_num_batched_tokens == 128
    refs = [reference(model, tok, a, b) for a, b in inputs]
    if arch.endswith("ForSequenceClassification"):
        for got, ref in zip(_run(eng, prompts, "cls"), refs):
            assert _rel(got, ref) < 1e-5
        return
    for kind, pool in (("cls", lambda h: h[0]), ("mean", lambda h: h.mean(0)), ("last", lambda h: h[-1])):
        for got, ref in zip(_run(eng, prompts, kind), refs):
            assert _rel(got, pool(ref)) < 1e-5, kind
    # the same prompts again: identical, as nothing is served from a cache
    again = _run(eng, prompts, "cls")
    assert all(torch.equal(a, b) for a, b in zip(again, _run(eng, prompts, "cls")))
    assert eng.kv.prefix_hits == 0


def test_token_types_matter_for_bert_pairs(tmp_path):
    """The second text of a pair reads segment 1: with the segment embeddings made to differ, a pair's output is
    transformers' with its token types, not with zeros."""
    model, tok = save_tiny_encoder(tmp_path, "BertModel", seed=4)
    eng = Engine.from_pretrained(tmp_path, num_kv_blocks=64)
    a, b = INPUTS[1]
    [got] = _run(eng, [tok(a, b)["input_ids"]], "mean")
    ref = reference(model, tok, a, b).mean(0)
    enc = tok(a, b, return_tensors="pt")
    with torch.no_grad():
        zeros = model(input_ids=enc["input_ids"]).last_hidden_state[0].mean(0)
    assert _rel(got, ref) < 1e-5 and _rel(got, zeros) > 1e-3


def test_an_encoder_generates_nothing_and_refuses_what_it_cannot_serve(encoder):
    arch, path, model, tok = encoder
    eng = Engine.from_pretrained(path, num_kv_blocks=64)
    with pytest.raises(ValueError, match="does not generate"):
        eng.add_request(tok("hello")["input_ids"], SamplingParams(max_tokens=4))
    if arch.startswith("XLMRoberta"):  # positions start after the padding index: 130 - 2 usable
        assert eng.max_model_len == 128
    with pytest.raises(ConfigError, match="is an encoder"):
        Engine.from_pretrained(path, num_kv_blocks=64, enable_lora=True)
