"""Encoder checkpoints served over HTTP: a sentence-transformers BERT embeds as its modules.json says (else by its
[CLS] position, normalized), a BERT cross-encoder reranks by transformers' scores of the tokenizer's pair encoding,
and every generation route is a 400 naming ``model``."""
from __future__ import annotations

import anthropic
import httpx
import numpy as np
import openai
import pytest
import torch

from tests.encoders import reference, save_tiny_encoder, serve_encoder


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = tmp_path_factory.mktemp("bge-like")
    model, tok = save_tiny_encoder(path, "BertModel", seed=11, sentence_transformers="mean")
    with serve_encoder(path, "bge-like") as server:
        yield server, model, tok


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("minilm-reranker")
    model, tok = save_tiny_encoder(path, "BertForSequenceClassification", seed=12, num_labels=1)
    with serve_encoder(path, "reranker") as server:
        yield server, model, tok


def _unit(v: torch.Tensor) -> np.ndarray:
    v = v.numpy().astype(np.float64)
    return v / np.linalg.norm(v)


def test_embeddings_follow_the_sentence_transformers_pooling(embedder):
    server, model, tok = embedder
    texts = ["the cat sat on the mat", "hello world", "paris is the capital of france"]
    got = server.openai().embeddings.create(model="bge-like", input=texts)
    for item, text in zip(got.data, texts):
        assert np.allclose(item.embedding, _unit(reference(model, tok, text).mean(0)), atol=1e-5)
    assert got.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in texts)


def test_a_long_text_of_few_word_pieces_is_embedded(embedder):
    """WordPiece drops whitespace and makes a word of any length one [UNK]: a text of 26,000 characters and five tokens
    fits the 128-token context (it was refused as too long by its character count)."""
    server, model, tok = embedder
    text = "hello " + "a" * 13000 + " " * 13000 + " world"
    got = server.openai().embeddings.create(model="bge-like", input=[text])
    assert got.usage.prompt_tokens == len(tok(text)["input_ids"]) == 5
    assert np.allclose(got.data[0].embedding, _unit(reference(model, tok, text).mean(0)), atol=1e-5)


def test_a_text_holding_a_separator_is_still_one_segment(embedder, cross_encoder):
    """A literal ``[SEP]`` inside a text is the separator token, but the text's token types stay 0 (as the tokenizer
    writes them), as they do for the same tokens sent as IDs; a pair whose first text holds one starts type 1 at the
    pair's own separator."""
    server, model, tok = embedder
    text = "first part [SEP] second part"
    assert tok(text)["input_ids"].count(tok.sep_token_id) == 2
    got = server.openai().embeddings.create(model="bge-like", input=[text])
    assert np.allclose(got.data[0].embedding, _unit(reference(model, tok, text).mean(0)), atol=1e-5)
    as_ids = server.openai().embeddings.create(model="bge-like", input=[tok(text)["input_ids"]])  # the same tokens
    assert np.allclose(as_ids.data[0].embedding, got.data[0].embedding, atol=1e-6)
    server, model, tok = cross_encoder
    query, doc = "capital [SEP] of france", "paris is the capital of france"
    s = httpx.post(server.url + "/v1/score", json={"model": "reranker", "text_1": query, "text_2": doc}, timeout=60)
    assert s.json()["data"][0]["score"] == pytest.approx(float(torch.sigmoid(reference(model, tok, query, doc))[0]),
                                                         abs=1e-5)


def test_without_modules_json_an_encoder_embeds_its_cls_position(tmp_path, caplog):
    model, tok = save_tiny_encoder(tmp_path, "XLMRobertaModel", seed=13)
    with caplog.at_level("INFO", logger="ember"), serve_encoder(tmp_path, "xlmr") as server:
        # llguidance cannot read this tokenizer, which matters only to a model that generates: no warning at start
        assert not [r for r in caplog.records if r.levelname == "WARNING" and "structured output" in r.getMessage()]
        r = httpx.post(server.url + "/v1/embeddings", json={"input": "the weather is cold today"}, timeout=60)
    assert r.status_code == 200, r.text
    expected = _unit(reference(model, tok, "the weather is cold today")[0])
    assert np.allclose(r.json()["data"][0]["embedding"], expected, atol=1e-5)


def test_a_cross_encoder_reranks_by_the_pair_encoding(cross_encoder):
    server, model, tok = cross_encoder
    query = "what is the capital of france"
    docs = ["the cat sat on the mat", "paris is the capital of france", "a dog ran in the park"]
    r = httpx.post(server.url + "/v1/rerank", json={"model": "reranker", "query": query, "documents": docs},
                   timeout=60)
    assert r.status_code == 200, r.text
    expected = [float(torch.sigmoid(reference(model, tok, query, d))[0]) for d in docs]
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -expected[i])
    for x in results:
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-5)
    s = httpx.post(server.url + "/v1/score", json={"model": "reranker", "text_1": query, "text_2": docs}, timeout=60)
    assert [d["score"] for d in s.json()["data"]] == pytest.approx(expected, abs=1e-5)


def test_generation_routes_are_refused_naming_model(embedder):
    server, _, _ = embedder
    with pytest.raises(openai.BadRequestError) as e:
        server.openai().chat.completions.create(model="bge-like", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "model" and "encoder" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        server.openai().completions.create(model="bge-like", prompt="hi")
    with pytest.raises(anthropic.BadRequestError):
        server.anthropic().messages.create(model="bge-like", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    r = httpx.post(server.url + "/v1/responses", json={"model": "bge-like", "input": "hi"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    # a conversation needs a chat template this encoder lacks: named, with what to send instead
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "bge-like", "messages": [
        {"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "chat template" in r.json()["error"]["message"] and "completions" not in r.json()["error"]["message"]
