"""Classification checkpoints served over HTTP: vLLM's `/classify` answers transformers' class probabilities, a
one-class model (a cross-encoder reranker) scores text pairs on `/v1/score` and `/v1/rerank` as transformers reads
the pair, and routes a classifier cannot serve (generation, embeddings) are 400s naming ``model``."""
from __future__ import annotations

import json

import anthropic
import httpx
import numpy as np
import openai
import pytest
import torch

from tests.conftest import save_tiny_qwen3
from tests.server.conftest import served

LABELS = {"0": "negative", "1": "neutral", "2": "positive"}


def _serve(path, name, **config):
    from ember.server.config import ServeConfig

    return served(ServeConfig(model_dir=path, served_model_name=name, max_num_seqs=4, kv_cache_blocks=64,
                              in_process=True, **config))


@pytest.fixture(scope="module")
def sentiment(demo_model_dir, tmp_path_factory):
    path = save_tiny_qwen3(tmp_path_factory.mktemp("sentiment"), demo_model_dir, seed=5,
                           head="ForSequenceClassification", num_labels=3, id2label=LABELS,
                           label2id={v: int(k) for k, v in LABELS.items()}, pad_token_id=0)
    with _serve(path, "sentiment") as server:
        yield server, path


@pytest.fixture(scope="module")
def reranker(demo_model_dir, tmp_path_factory):
    path = save_tiny_qwen3(tmp_path_factory.mktemp("reranker"), demo_model_dir, seed=6,
                           head="ForSequenceClassification", num_labels=1, pad_token_id=0)
    with _serve(path, "reranker") as server:
        yield server, path


@pytest.fixture(scope="module")
def lm_reranker(demo_model_dir, tmp_path_factory):
    """A causal LM served as the original Qwen3-Reranker is, by vLLM's command line."""
    path = save_tiny_qwen3(tmp_path_factory.mktemp("lm-reranker"), demo_model_dir, seed=7)
    no_yes = _vocab_tokens(path, [61, 88])
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": no_yes,
                 "is_original_qwen3_reranker": True}
    with _serve(path, "qwen3-reranker", hf_overrides=json.dumps(overrides),
                classifier_flag="--task score") as server:
        yield server, path


def _vocab_tokens(path, ids: list[int]) -> list[str]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).convert_ids_to_tokens(ids)


def _hf_logits(path, prompts: list[list[int]]) -> list[np.ndarray]:
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0].numpy() for p in prompts]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_classify_answers_transformers_probabilities_and_labels(sentiment):
    server, path = sentiment
    texts = ["what a lovely day", "the train was late again", "ok"]
    r = httpx.post(server.url + "/classify", json={"model": "sentiment", "input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [server.tokenizer.encode(t) for t in texts]
    want = _hf_logits(path, ids)
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids)) and body["id"].startswith("classify-")
    for d, w in zip(body["data"], want):
        assert d["num_classes"] == 3 and d["label"] == LABELS[str(int(np.argmax(w)))]
        assert np.allclose(d["probs"], _softmax(w), rtol=1e-4, atol=1e-6)
    raw = httpx.post(server.url + "/v1/classify", json={"input": ids[0], "use_activation": False}, timeout=60).json()
    assert np.allclose(raw["data"][0]["probs"], want[0], rtol=1e-4, atol=1e-5)
    messages = [{"role": "user", "content": "what a lovely day"}]
    conv = httpx.post(server.url + "/classify", json={"messages": messages}, timeout=60).json()
    conv_ids = server.tokenizer.encode(server.tokenizer.apply_chat_template(messages, tokenize=False),
                                       add_special_tokens=False)
    assert np.allclose(conv["data"][0]["probs"], _softmax(_hf_logits(path, [conv_ids])[0]), rtol=1e-4, atol=1e-6)


def test_routes_a_classifier_cannot_serve_are_400s_naming_the_model(sentiment, demo_server):
    server, _ = sentiment
    client = server.openai()
    for stream in (False, True):  # refused before a stream starts
        with pytest.raises(openai.BadRequestError, match="classifier") as e:
            client.chat.completions.create(model="sentiment", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, stream=stream)
        assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="classifier"):
        client.completions.create(model="sentiment", prompt="hi", max_tokens=2)
    with pytest.raises(anthropic.BadRequestError, match="classifier"):
        server.anthropic().messages.create(model="sentiment", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="classifier") as e:
        client.embeddings.create(model="sentiment", input="hi")
    assert e.value.body["param"] == "model"
    r = httpx.post(server.url + "/v1/score", json={"text_1": "a", "text_2": "b"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "3 classes" in r.text
    r = httpx.post(demo_server.url + "/classify", json={"input": "hi"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "not a classifier" in r.text


def test_a_cross_encoder_scores_pairs_read_together(reranker):
    server, path = reranker
    tok = server.tokenizer
    query, docs = "where is paris", ["paris is in france", "bananas are yellow", "the eiffel tower"]
    want = [float(1 / (1 + np.exp(-w[0])))
            for w in _hf_logits(path, [tok(query, d)["input_ids"] for d in docs])]
    assert len({round(w, 6) for w in want}) == 3
    r = httpx.post(server.url + "/v1/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert np.allclose([d["score"] for d in r["data"]], want, rtol=1e-4)
    pairwise = httpx.post(server.url + "/score", json={"text_1": [query, docs[1]], "text_2": [docs[0], query]},
                          timeout=60).json()
    swapped = float(1 / (1 + np.exp(-_hf_logits(path, [tok(docs[1], query)["input_ids"]])[0][0])))
    assert np.allclose([d["score"] for d in pairwise["data"]], [want[0], swapped], rtol=1e-4)
    rr = httpx.post(server.url + "/v1/rerank", json={"query": query, "documents": docs, "top_n": 2},
                    timeout=60).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in rr["results"]] == order
    assert np.allclose([x["relevance_score"] for x in rr["results"]], [want[i] for i in order], rtol=1e-4)
    assert rr["results"][0]["document"] == {"text": docs[order[0]]}
    # vLLM's use_activation (activation, its older spelling) false: the raw logit, on both routes
    logits = [float(w[0]) for w in _hf_logits(path, [tok(query, d)["input_ids"] for d in docs])]
    for off in ({"use_activation": False}, {"activation": False}):
        raw = httpx.post(server.url + "/v1/score", json={"text_1": query, "text_2": docs, **off}, timeout=60).json()
        assert np.allclose([d["score"] for d in raw["data"]], logits, rtol=1e-4), raw
        rr = httpx.post(server.url + "/v1/rerank", json={"query": query, "documents": docs, **off}, timeout=60).json()
        assert np.allclose([x["relevance_score"] for x in rr["results"]], sorted(logits, reverse=True), rtol=1e-4)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/rerank", {"query": "x " * 1100, "documents": ["ok", "fine"]}, "query"),
    ("/v1/score", {"text_1": "x " * 1100, "text_2": ["ok"]}, "text_1"),
    ("/v1/score", {"text_1": ["a", "x " * 1100], "text_2": ["ok", "fine"]}, "text_1[1]"),
    ("/v1/rerank", {"query": "q", "documents": ["ok", "x " * 1100]}, "documents[1]"),
])
def test_a_pair_over_the_context_is_a_400_naming_the_text_that_is_too_long(reranker, path, body, param):
    r = httpx.post(reranker[0].url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_causal_lm_reranks_as_its_yes_over_no_with_the_texts_joined(lm_reranker):
    server, path = lm_reranker
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # the query ends inside a word, so the joined text tokenizes unlike the pair's two encodings
    query, docs = "<Query>: hello wor", ["ld is round", "ld of bananas"]
    want = []
    for d in docs:  # vLLM joins a converted LM's pair into one text; the score is P(yes) over {no, yes}
        with torch.no_grad():
            last = lm(torch.tensor([server.tokenizer(query + d)["input_ids"]])).logits[0, -1]
        want.append(float(torch.softmax(last[[61, 88]], 0)[1]))
    r = httpx.post(server.url + "/v1/rerank", json={"query": query, "documents": docs}, timeout=60)
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert np.allclose([got[0], got[1]], want, rtol=1e-4)
    c = httpx.post(server.url + "/classify", json={"input": query + docs[0]}, timeout=60).json()
    assert c["data"][0]["num_classes"] == 1 and np.isclose(c["data"][0]["probs"][0], want[0], rtol=1e-4)
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": [True, False]}, "input[0]"),
])
def test_bad_classify_bodies_are_400s_naming_the_field(sentiment, body, param):
    r = httpx.post(sentiment[0].url + "/classify", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_invocations_classify_on_a_classifier(sentiment):
    server, _ = sentiment
    for body in ({"input": ["good", "bad"]}, {"messages": [{"role": "user", "content": "good"}]}):
        r = httpx.post(server.url + "/invocations", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["id"].startswith("classify-"), r.text
