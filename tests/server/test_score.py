"""vLLM's score and rerank routes over the demo model's embeddings: a score is the cosine similarity of the two
texts' embeddings (as `/v1/embeddings` returns them), rerank orders documents by it, best first. A cross-encoder's
score is its logit under the activation its config.json names (sigmoid where it names none)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from ember.engine.config import ConfigError
from ember.engine.models import classifier


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
    for every in (0, -1):  # vLLM's "all": rerank clients send -1 by default
        assert [x["index"] for x in _post(demo_server, path, {"query": q, "documents": DOCS,
                                                              "top_n": every}).json()["results"]] == want
    assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"]
    objects = _post(demo_server, path, {"query": q, "documents": [{"text": d} for d in DOCS]}).json()
    # Cohere's and Jina's {"text": ...} documents read as their text
    ranked = [(x["index"], x["document"]) for x in r["results"]]
    assert [(x["index"], x["document"]) for x in objects["results"]] == ranked
    assert np.allclose([x["relevance_score"] for x in objects["results"]], scores, atol=1e-5)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": "x " * 5000}, "text_2"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["ok", "x " * 5000]}, "documents[1]"),
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


@pytest.fixture(scope="module")
def identity_reranker(tmp_path_factory):
    """A tiny BERT cross-encoder whose config.json names sentence-transformers' Identity activation (as the ms-marco
    MiniLM rerankers do), served in-process; with its transformers model and tokenizer."""
    from tests.encoders import save_tiny_encoder, serve_encoder

    path = tmp_path_factory.mktemp("identity-reranker")
    model, tok = save_tiny_encoder(path, "BertForSequenceClassification", seed=14, num_labels=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity", "version": "4.0.1"}
    (path / "config.json").write_text(json.dumps(cfg))
    with serve_encoder(path, "ms-marco-like") as server:
        yield server, model, tok


def test_a_cross_encoder_with_an_identity_activation_scores_its_raw_logit(identity_reranker):
    from tests.encoders import reference

    server, model, tok = identity_reranker
    query, docs = "what is the capital of france", ["paris is the capital of france", "the cat sat on the mat"]
    logits = [float(reference(model, tok, query, d)[0]) for d in docs]
    s = _post(server, "/v1/score", {"text_1": query, "text_2": docs}).json()
    assert [d["score"] for d in s["data"]] == pytest.approx(logits, rel=1e-5)
    r = _post(server, "/rerank", {"query": query, "documents": docs}).json()
    assert [x["index"] for x in r["results"]] == sorted(range(len(docs)), key=lambda i: -logits[i])
    assert [x["relevance_score"] for x in r["results"]] == pytest.approx(sorted(logits, reverse=True), rel=1e-5)


@pytest.mark.parametrize("raw,want", [
    ({}, "sigmoid"),
    ({"is_original_qwen3_reranker": True}, "sigmoid"),
    ({"sentence_transformers": {"version": "4.0.1"}}, "sigmoid"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}, "tanh"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"},
      "sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"}, "identity"),
    ({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, "identity"),
    ({"sbert_ce_default_activation_function": None}, "sigmoid"),
])
def test_the_score_activation_is_the_one_config_json_names(raw, want):
    assert classifier.score_activation(SimpleNamespace(raw=raw)) == want


@pytest.mark.parametrize("raw,field", [
    ({"sentence_transformers": {"activation_fn": "os.system"}}, "sentence_transformers.activation_fn"),
    ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Softmax"},
     "sbert_ce_default_activation_function"),
])
def test_an_activation_ember_cannot_apply_is_refused_naming_the_field(raw, field):
    with pytest.raises(ConfigError, match=field):
        classifier.score_activation(SimpleNamespace(raw=raw))


@pytest.mark.parametrize("cls", list(classifier.SCORE_ACTIVATIONS))
def test_each_score_activation_is_the_torch_module_it_names(cls):
    import torch

    from ember.server.score_api import SCORE_ACTIVATIONS

    act = SCORE_ACTIVATIONS[classifier.SCORE_ACTIVATIONS[cls]]
    xs = [-40.0, -2.5, 0.0, 0.7, 3.0]
    want = getattr(torch.nn.modules, cls)()(torch.tensor(xs, dtype=torch.float64)).tolist()
    assert [act(x) for x in xs] == pytest.approx(want, rel=1e-12, abs=1e-15)
