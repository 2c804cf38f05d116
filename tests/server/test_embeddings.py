"""`POST /v1/embeddings` through the real `openai` SDK (which asks for base64 and decodes it) and httpx: the vectors
equal transformers' ``last_hidden_state`` pooled and normalized as the checkpoint says, errors name their field,
and a sentence-transformers checkpoint (mean pooling, Matryoshka sizes) is served as its files say."""
from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch

from ember.server.pooling_spec import load_pooling_spec
from tests.server.conftest import served


@pytest.fixture(scope="module")
def demo_hf(demo_model_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(demo_model_dir, torch_dtype=torch.float32).eval()


def _hidden(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).last_hidden_state[0].float()


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def _close(got, want: torch.Tensor, tol: float = 1e-5) -> bool:
    g = torch.tensor(np.asarray(got, dtype=np.float32))
    return g.shape == want.shape and bool((g - want).norm() / want.norm() < tol)


def test_the_sdk_gets_normalized_last_token_embeddings(demo_server, demo_hf):
    texts = ["The capital of France is Paris", "hello", "a much longer sentence about the weather in spring"]
    r = demo_server.openai().embeddings.create(model=demo_server.model, input=texts)  # the SDK sends base64
    tok = demo_server.tokenizer
    ids = [tok.encode(t) for t in texts]
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, i in zip(r.data, ids):
        assert _close(d.embedding, _unit(_hidden(demo_hf, i)[-1]))
        assert abs(float(np.linalg.norm(d.embedding)) - 1) < 1e-5
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    assert r.model == demo_server.model and r.object == "list"
    floats = httpx.post(demo_server.url + "/v1/embeddings", json={"input": texts[1], "encoding_format": "float"},
                        timeout=60).json()
    assert len(floats["data"]) == 1 and floats["data"][0]["object"] == "embedding"
    assert np.allclose(floats["data"][0]["embedding"], r.data[1].embedding, atol=1e-7)
    as_ids = demo_server.openai().embeddings.create(model=demo_server.model, input=ids[0], encoding_format="float")
    assert np.allclose(as_ids.data[0].embedding, r.data[0].embedding, atol=1e-6)
    for field in ("normalize", "use_activation"):  # vLLM's per-request switch: false is the raw pooled vector
        raw = demo_server.openai().embeddings.create(model=demo_server.model, input=texts[0], extra_body={field: False})
        assert _close(raw.data[0].embedding, _hidden(demo_hf, ids[0])[-1])


def test_truncation_and_special_tokens_change_what_is_embedded(demo_server, demo_hf):
    ids = demo_server.tokenizer.encode("one two three four five six seven eight nine ten")
    body = {"input": [ids], "truncate_prompt_tokens": 4, "encoding_format": "base64"}
    r = httpx.post(demo_server.url + "/v1/embeddings", json=body, timeout=60).json()
    vec = np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), dtype="<f4")
    assert _close(vec, _unit(_hidden(demo_hf, ids[-4:])[-1])) and r["usage"]["prompt_tokens"] == 4
    plain = httpx.post(demo_server.url + "/v1/embeddings", json={"input": "hi there", "add_special_tokens": False},
                       timeout=60).json()
    assert plain["usage"]["prompt_tokens"] == len(demo_server.tokenizer.encode("hi there", add_special_tokens=False))


@pytest.mark.parametrize("body,param,code", [
    ({"input": []}, "input", None),
    ({"input": ["ok", [1, 2]]}, "input[1]", None),  # the item that breaks the list of strings
    ({"input": [[1, 2], [5, 99999]]}, "input[1]", None),
    ({"input": [3, -1]}, "input", None),
    ({"input": "x " * 5000}, "input", "context_length_exceeded"),
    ({"input": "hi", "dimensions": 8}, "dimensions", None),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", None),
    ({"input": "hi", "normalize": "bogus"}, "normalize", None),
    ({"input": "hi", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens", None),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", None),
    ({"input": [True, False]}, "input[0]", None),  # JSON booleans are not token IDs
    ({"input": [[5, 6], [7, True]]}, "input[1][1]", None),
])
def test_bad_bodies_are_400s_naming_the_field(demo_server, body, param, code):
    r = httpx.post(demo_server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    if code:
        assert err["code"] == code
    with pytest.raises(openai.NotFoundError):
        demo_server.openai().embeddings.create(model="other", input="hi")


def test_invocations_routes_an_input_body_to_embeddings(demo_server):
    r = httpx.post(demo_server.url + "/invocations", json={"input": ["a", "b"], "encoding_format": "float"},
                   timeout=60)
    assert r.status_code == 200 and [d["index"] for d in r.json()["data"]] == [0, 1]


def _sentence_transformers_copy(src, dst, *, modules: list[str], pooling: dict, config: dict):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    kinds = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    (dst / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": kinds[m], "type": f"sentence_transformers.models.{m}"}
        for i, m in enumerate(modules)]))
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": cfg["hidden_size"],
                                                               **pooling}))
    return dst


def test_pooling_spec_reads_sentence_transformers_files(demo_model_dir, tmp_path):
    mean = _sentence_transformers_copy(demo_model_dir, tmp_path / "mean", modules=["Transformer", "Pooling"],
                                       pooling={"pooling_mode_mean_tokens": True}, config={"is_matryoshka": True})
    spec = load_pooling_spec(mean, None)
    assert (spec.kind, spec.normalize, spec.matryoshka, spec.refused) == ("mean", False, True, None)
    assert load_pooling_spec(mean, {"pooling_type": "CLS", "normalize": True}).kind == "cls"
    dense = _sentence_transformers_copy(demo_model_dir, tmp_path / "dense",
                                        modules=["Transformer", "Pooling", "Dense", "Normalize"],
                                        pooling={"pooling_mode_lasttoken": True}, config={})
    assert "Dense" in load_pooling_spec(dense, None).refused
    maxed = _sentence_transformers_copy(demo_model_dir, tmp_path / "max", modules=["Transformer", "Pooling"],
                                        pooling={"pooling_mode_max_tokens": True}, config={})
    assert load_pooling_spec(maxed, None).refused
    plain = load_pooling_spec(demo_model_dir, None)
    assert (plain.kind, plain.normalize, plain.matryoshka) == ("last", True, False)
    assert "one of [4, 8]" in load_pooling_spec(
        _sentence_transformers_copy(demo_model_dir, tmp_path / "dims", modules=["Transformer", "Pooling"],
                                    pooling={"pooling_mode_cls_token": True},
                                    config={"matryoshka_dimensions": [4, 8]}), None).check_dimensions(5)


@pytest.fixture(scope="module")
def mean_server(demo_model_dir, tmp_path_factory):
    from ember.server.config import ServeConfig

    path = _sentence_transformers_copy(demo_model_dir, tmp_path_factory.mktemp("st") / "m",
                                       modules=["Transformer", "Pooling", "Normalize"],
                                       pooling={"pooling_mode_mean_tokens": True},
                                       config={})
    # Matryoshka declared the way vLLM documents for a checkpoint whose config.json does not say it
    config = ServeConfig(model_dir=path, served_model_name="st", max_num_seqs=4, kv_cache_blocks=64,
                         in_process=True, hf_overrides=json.dumps({"matryoshka_dimensions": [16, 32]}))
    with served(config) as server:
        yield server


def test_a_mean_pooling_matryoshka_checkpoint_is_served_as_its_files_and_overrides_say(mean_server, demo_hf):
    runtime = mean_server.runtime
    client = mean_server.openai()
    text = "pooled over every position"
    ids = runtime.tokenizer.encode(text)
    mean = _hidden(demo_hf, ids).mean(dim=0)
    full = client.embeddings.create(model="st", input=text)
    assert _close(full.data[0].embedding, _unit(mean))
    short = client.embeddings.create(model="st", input=text, dimensions=16)
    assert _close(short.data[0].embedding, _unit(mean[:16]))  # cut, then normalized
    with pytest.raises(openai.BadRequestError, match="one of \\[16, 32\\]"):
        client.embeddings.create(model="st", input=text, dimensions=20)


def test_a_client_that_hangs_up_aborts_its_inputs(demo_server):
    """600 distinct inputs of about 250 tokens need more than 70 full steps: a client that hangs up once they run
    leaves the engine idle (slots and blocks free) long before they could all have run."""
    import socket
    import time
    from urllib.parse import urlparse

    start = demo_server.stats()
    texts = [f"{i} " + "the quick brown fox jumps over the lazy dog " * 28 for i in range(600)]  # no shared prefix
    body = json.dumps({"input": texts}).encode()
    url = urlparse(demo_server.url)
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 20
    while demo_server.stats().num_steps == start.num_steps and time.monotonic() < deadline:
        time.sleep(0.01)
    sock.close()  # hang up while the inputs run
    while time.monotonic() < deadline:
        s = demo_server.stats()
        if s.num_running == 0 and s.num_waiting == 0:
            break
        time.sleep(0.05)
    s = demo_server.stats()
    assert s.num_steps > start.num_steps and (s.num_running, s.num_waiting) == (0, 0)
    assert s.num_free_blocks == start.num_free_blocks
    assert s.num_steps - start.num_steps < 40  # most of the 70+ steps never ran


def test_each_pooled_input_is_a_finished_request_in_metrics(demo_server):
    """vLLM's dashboards count pooled inputs in `vllm:request_success_total{finished_reason="stop"}` and in its
    per-request latency and size histograms, as vLLM observes a pooling request."""
    import re

    histograms = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                  "request_prefill_time_seconds", "request_prompt_tokens", "request_params_n")

    def counts() -> tuple[float, ...]:
        text = httpx.get(demo_server.url + "/metrics", timeout=10).text
        found = [re.search(rf"^{pattern} (\S+)$", text, flags=re.M) for pattern in (
            r'vllm:request_success_total\{finished_reason="stop",model_name="[^"]*"\}',
            r'ember_request_finished_total\{reason="pooled"\}',
            *(rf'vllm:{h}_count\{{model_name="[^"]*"\}}' for h in histograms))]
        return tuple(float(m.group(1)) if m else 0.0 for m in found)

    before = counts()
    r = httpx.post(demo_server.url + "/v1/embeddings", json={"input": ["a", "b"]}, timeout=60)
    assert r.status_code == 200
    after = counts()  # (an earlier test's aborted inputs may still be ending: at least these two count)
    assert all(a - b >= 2 for a, b in zip(after, before)), (before, after)


def test_a_conversation_is_embedded_as_the_chat_template_renders_it(demo_server, demo_hf):
    messages = [{"role": "system", "content": "You embed."}, {"role": "user", "content": "Where is Paris?"}]
    tok = demo_server.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    ids = tok.encode(text, add_special_tokens=False)
    r = httpx.post(demo_server.url + "/v1/embeddings", json={"messages": messages, "encoding_format": "float"},
                   timeout=60).json()
    assert len(r["data"]) == 1 and r["usage"]["prompt_tokens"] == len(ids)
    assert _close(r["data"][0]["embedding"], _unit(_hidden(demo_hf, ids)[-1]))
    prompted = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    assert len(prompted) > len(ids)
    r2 = httpx.post(demo_server.url + "/v1/embeddings", json={"messages": messages, "add_generation_prompt": True,
                                                               "truncate_prompt_tokens": 5}, timeout=60).json()
    assert r2["usage"]["prompt_tokens"] == 5
    assert _close(r2["data"][0]["embedding"], _unit(_hidden(demo_hf, prompted[-5:])[-1]))


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "hi"}], "input": "hi"}, "input"),
    ({}, "input"),
    ({"input": "hi", "add_generation_prompt": True}, "add_generation_prompt"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True,
      "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
])
def test_bad_conversations_are_400s_naming_the_field(demo_server, body, param):
    r = httpx.post(demo_server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and err["message"], err


def test_a_conversation_gets_no_special_tokens_beyond_the_templates_unless_asked(demo_server):
    import dataclasses

    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from ember.server.embeddings_api import EmbeddingRequest, _conversation_ids

    demo = demo_server.tokenizer
    inner = Tokenizer.from_str(demo.backend_tokenizer.to_str())  # a BOS-adding copy of the demo tokenizer
    bos = demo.pad_token
    inner.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                         special_tokens=[(bos, inner.token_to_id(bos))])
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token=bos, chat_template=demo.chat_template)
    rt = dataclasses.replace(demo_server.runtime, tokenizer=tok, chat_template=None)
    body = {"messages": [{"role": "user", "content": "Where is Paris?"}]}
    plain = _conversation_ids(rt, EmbeddingRequest(**body))
    assert plain == demo.encode(tok.apply_chat_template(body["messages"], tokenize=False), add_special_tokens=False)
    assert _conversation_ids(rt, EmbeddingRequest(**body, add_special_tokens=True)) == [tok.bos_token_id, *plain]
