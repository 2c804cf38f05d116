"""`truncate_prompt_tokens` on the pooling routes of encoder checkpoints: a text keeps the special tokens its
tokenizer adds and its last tokens (as transformers' left truncation cuts it), token IDs are the last N as sent, a
cross-encoder pair keeps both texts (transformers' ``truncation="longest_first"``), and the score routes' limits
name the field the client sent."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from tests.encoders import save_tiny_encoder, serve_encoder

LONG = ("the weather is cold today and the cat sat on the mat while a dog ran in the park and cats and dogs like "
        "to play in paris which is the capital of france")


@pytest.fixture(scope="module")
def cls_embedder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cls-bert")
    model, tok = save_tiny_encoder(path, "BertModel", seed=21, sentence_transformers="cls")
    with serve_encoder(path, "cls-bert") as server:
        yield server, model, tok


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cross-encoder")
    model, tok = save_tiny_encoder(path, "BertForSequenceClassification", seed=22, num_labels=1,
                                   initializer_range=0.5)
    with serve_encoder(path, "reranker") as server:
        yield server, model, tok


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _cls_vector(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        v = model(torch.tensor([ids])).last_hidden_state[0, 0].numpy().astype(np.float64)
    return v / np.linalg.norm(v)


def test_a_truncated_text_keeps_its_cls_and_sep_and_token_ids_are_cut_as_sent(cls_embedder):
    server, model, tok = cls_embedder
    content = tok(LONG, add_special_tokens=False)["input_ids"]
    keep = 8
    r = _post(server, "/v1/embeddings", {"input": [LONG, "hello world"], "truncate_prompt_tokens": keep})
    assert r.status_code == 200, r.text
    want = [tok.cls_token_id, *content[-(keep - 2):], tok.sep_token_id]
    assert np.allclose(r.json()["data"][0]["embedding"], _cls_vector(model, want), atol=1e-5)
    assert np.allclose(r.json()["data"][1]["embedding"], _cls_vector(model, tok("hello world")["input_ids"]),
                       atol=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == keep + len(tok("hello world")["input_ids"])
    ids = tok(LONG)["input_ids"]
    r = _post(server, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": keep})
    assert np.allclose(r.json()["data"][0]["embedding"], _cls_vector(model, ids[-keep:]), atol=1e-5)


def _hf_scores(model, tok, query: str, docs: list[str], keep: int) -> list[float]:
    out = []
    for doc in docs:
        enc = tok(query, doc, truncation="longest_first", max_length=keep, return_tensors="pt")
        with torch.no_grad():
            out.append(float(torch.sigmoid(model(**enc).logits[0, 0])))
    return out


def test_a_truncated_cross_encoder_pair_keeps_both_texts_as_longest_first_does(cross_encoder):
    server, model, tok = cross_encoder
    docs = [LONG, "paris is the capital of france"]
    keep = 12
    scores = {}
    for query in ("what is the capital of france", "hello world"):
        r = _post(server, "/v1/rerank", {"query": query, "documents": docs, "truncate_prompt_tokens": keep})
        assert r.status_code == 200, r.text
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        assert [got[0], got[1]] == pytest.approx(_hf_scores(model, tok, query, docs, keep), abs=1e-5)
        assert r.json()["usage"]["total_tokens"] == sum(min(keep, len(tok(query, d)["input_ids"])) for d in docs)
        s = _post(server, "/v1/score", {"text_1": query, "text_2": docs, "truncate_prompt_tokens": keep})
        assert [d["score"] for d in s.json()["data"]] == pytest.approx([got[0], got[1]], abs=1e-6)
        scores[query] = got[0]
    assert abs(scores["what is the capital of france"] - scores["hello world"]) > 1e-4


@pytest.mark.parametrize("path,body,param", [
    ("/v1/rerank", {"query": "q", "documents": ["d " * 40], "truncate_prompt_tokens": 10**6},
     "truncate_prompt_tokens"),
    ("/v1/rerank", {"query": "q", "documents": ["d " * 40], "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
    ("/v1/score", {"text_1": "q", "text_2": ["d " * 40], "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
])
def test_a_keep_the_pair_cannot_have_is_a_400_naming_it(cross_encoder, path, body, param):
    r = _post(cross_encoder[0], path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path,body,param,what", [
    ("/v1/rerank", {"query": "q", "documents": ["d"] * 2048}, "documents", "at most 2047 documents"),
    ("/v1/score", {"text_1": "q", "text_2": ["d"] * 2048}, "text_2", "at most 2047 texts in text_2"),
    ("/v1/score", {"text_1": ["q"] * 2048, "text_2": ["d"] * 2048}, "text_2", "at most 2047 texts in text_2"),
])
def test_too_many_texts_to_score_is_a_400_naming_the_field_sent(demo_server, cross_encoder, path, body, param,
                                                                 what):
    for server in (demo_server, cross_encoder[0]):
        r = _post(server, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"] == f"{what} per request, got 2048"
