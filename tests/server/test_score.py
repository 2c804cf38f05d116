"""vLLM's score and rerank routes over the demo model's embeddings: a score is the cosine similarity of the two
texts' embeddings (as `/v1/embeddings` returns them), rerank orders documents by it, best first."""
from __future__ import annotations

import httpx
import numpy as np
import pytest


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _embeddings(server, texts: list[str]) -> list[np.ndarray]:
    data = _post(server, "/v1/embeddings", {"input": texts}).json()["data"]
    return [np.asarray(d["embedding"]) for d in data]


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The capital of Italy is Rome.", "hello"]


def test_score_is_the_cosine_of_the_embeddings_one_to_many_and_pairwise(demo_server):
    q = "What is the capital of France?"
    vecs = _embeddings(demo_server, [q, *DOCS])
    r = _post(demo_server, "/v1/score", {"model": demo_server.model, "text_1": q, "text_2": DOCS}).json()
    assert [d["index"] for d in r["data"]] == [0, 1, 2, 3] and r["object"] == "list"
    assert np.allclose([d["score"] for d in r["data"]], [_cos(vecs[0], v) for v in vecs[1:]], atol=1e-5)
    pairwise = _post(demo_server, "/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    assert np.allclose([d["score"] for d in pairwise["data"]],
                       [_cos(vecs[1], vecs[3]), _cos(vecs[2], vecs[4])], atol=1e-5)
    assert pairwise["usage"]["prompt_tokens"] == sum(len(demo_server.tokenizer.encode(t)) for t in DOCS)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_score_best_first(demo_server, path):
    q = "What is the capital of France?"
    vecs = _embeddings(demo_server, [q, *DOCS])
    want = sorted(range(len(DOCS)), key=lambda i: -_cos(vecs[0], vecs[i + 1]))
    r = _post(demo_server, path, {"query": q, "documents": DOCS}).json()
    assert [x["index"] for x in r["results"]] == want
    assert [x["document"]["text"] for x in r["results"]] == [DOCS[i] for i in want]
    scores = [x["relevance_score"] for x in r["results"]]
    assert scores == sorted(scores, reverse=True) and r["usage"]["total_tokens"] > 0
    top = _post(demo_server, path, {"query": q, "documents": DOCS, "top_n": 2, "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == want[:2] and "document" not in top["results"][0]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": "x " * 5000}, "text_2"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["ok", "x " * 5000]}, "documents[1]"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_bodies_are_400s_naming_the_field(demo_server, path, body, param):
    r = _post(demo_server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_pair_with_an_empty_second_text_is_its_first_text_alone_in_any_batch():
    """As ``tokenizer(query, "")`` encodes it (what a cross-encoder scoring one pair reads): no empty second segment,
    whether the pair is scored alone or next to others."""
    from types import SimpleNamespace

    from ember.server.score_api import _pair_ids
    from tests.encoders import tokenizer

    tok = tokenizer()
    rt = SimpleNamespace(tokenizer=tok, model_info=SimpleNamespace(joins_pairs=False))
    query, doc = "what is the capital of france", "paris is the capital of france"
    alone = tok(query, "")["input_ids"]
    assert _pair_ids(rt, [query], [""], None) == ([alone], [len(alone)])
    ids, starts = _pair_ids(rt, [query, query], ["", doc], None)
    assert ids == [alone, tok(query, doc)["input_ids"]] and starts == [len(alone), len(alone)]
    cut = tok(query, "", truncation="longest_first", max_length=5)["input_ids"]
    assert _pair_ids(rt, [query, query], ["", doc], 5)[0][0] == cut
