"""Scored prompts, equal to the model's own log-softmax: `/v1/completions` with `echo` and `logprobs` (what
lm-evaluation-harness reads for log-likelihood tasks), streamed or not, and vLLM's `prompt_logprobs` on chat and
completions."""
from __future__ import annotations

import openai
import pytest
import torch


@pytest.fixture(scope="module")
def demo_hf(demo_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model_dir, torch_dtype=torch.float32).eval()


def test_echo_with_logprobs_scores_the_prompt(demo_server, demo_hf):
    client = demo_server.openai()
    text = "The capital of France is Paris"
    ids = demo_server.tokenizer.encode(text)
    r = client.completions.create(model=demo_server.model, prompt=text, max_tokens=1, temperature=0, logprobs=2,
                                  echo=True)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text.startswith(text) and len(lp.tokens) == len(ids) + 1 == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        logp = torch.log_softmax(demo_hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:len(ids)]), want, atol=1e-4)
    tb = demo_server.runtime.token_bytes.token_bytes
    for k in range(1, len(ids)):
        best = logp[k - 1].topk(2).indices.tolist()
        assert set(lp.top_logprobs[k]) == {tb(t).decode("utf-8", errors="replace") for t in [*best, ids[k]]}
    assert lp.text_offset[:len(ids)] == sorted(lp.text_offset[:len(ids)]) and lp.text_offset[len(ids)] == len(text)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    streamed = list(client.completions.create(model=demo_server.model, prompt=text, max_tokens=1, temperature=0,
                                              logprobs=2, echo=True, stream=True))
    tokens = [t for ch in streamed for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    scores = [s for ch in streamed for c in ch.choices if c.logprobs for s in c.logprobs.token_logprobs]
    assert tokens == lp.tokens and scores == lp.token_logprobs
    assert "".join(c.text for ch in streamed for c in ch.choices) == c.text


def _logp(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_vllm_shape(scored: list, ids: list[int], logp: torch.Tensor, top: int, tb) -> None:
    """vLLM's `prompt_logprobs`: None, then per token a map holding the token (its logprob and rank) and the best
    ``top`` (ranks 1..top)."""
    assert len(scored) == len(ids) and scored[0] is None
    for k in range(1, len(ids)):
        entry, row = scored[k], logp[k - 1]
        own = entry[str(ids[k])]
        assert abs(own["logprob"] - row[ids[k]].item()) < 1e-4
        assert own["rank"] == int((row > row[ids[k]]).sum()) + 1
        assert own["decoded_token"] == tb(ids[k]).decode("utf-8", errors="replace")
        best = row.topk(top).indices.tolist()
        assert set(entry) == {str(t) for t in best} | {str(ids[k])}
        assert sorted(entry[str(t)]["rank"] for t in best) == list(range(1, top + 1))


def test_vllm_prompt_logprobs_on_completions_and_chat(demo_server, demo_hf):
    client = demo_server.openai()
    tb = demo_server.runtime.token_bytes.token_bytes
    text = "Once upon a time there was"
    ids = demo_server.tokenizer.encode(text)
    r = client.completions.create(model=demo_server.model, prompt=text, max_tokens=2, temperature=0, n=2,
                                  extra_body={"prompt_logprobs": 3})
    for c in r.choices:
        _check_vllm_shape(c.model_extra["prompt_logprobs"], ids, _logp(demo_hf, ids), 3, tb)
    # with echo + logprobs=1 too: the echo keeps its one alternative while prompt_logprobs has three
    both = client.completions.create(model=demo_server.model, prompt=text, max_tokens=1, temperature=0, echo=True,
                                     logprobs=1, extra_body={"prompt_logprobs": 3})
    assert all(t is None or len(t) <= 2 for t in both.choices[0].logprobs.top_logprobs)  # its best and its own
    _check_vllm_shape(both.choices[0].model_extra["prompt_logprobs"], ids, _logp(demo_hf, ids), 3, tb)

    messages = [{"role": "user", "content": "Tell me a story."}]
    chat = client.chat.completions.create(model=demo_server.model, messages=messages, max_tokens=2, n=2,
                                          extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    prompt_ids = chat.model_extra["prompt_token_ids"]
    _check_vllm_shape(chat.model_extra["prompt_logprobs"], prompt_ids, _logp(demo_hf, prompt_ids), 0, tb)
    plain = client.chat.completions.create(model=demo_server.model, messages=messages, max_tokens=1)
    assert "prompt_logprobs" not in (plain.model_extra or {})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=demo_server.model, messages=messages, max_tokens=1, stream=True,
                                       extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=demo_server.model, prompt=text, max_tokens=1,
                                  extra_body={"prompt_logprobs": 21})
    assert e.value.body["param"] == "prompt_logprobs"
    for asked, said in ((-1, "--max-logprobs -1"), (-2, "greater than or equal to -1")):
        with pytest.raises(openai.BadRequestError, match=said) as e:  # -1, the whole vocabulary, needs the server's
            client.completions.create(model=demo_server.model, prompt=text, max_tokens=1,
                                      extra_body={"prompt_logprobs": asked})
        assert e.value.body["param"] == "prompt_logprobs"
    # a stream may ask for 0 (vLLM's rule is "more than 0, or -1"): served, with no prompt logprobs in its chunks
    chunks = list(client.chat.completions.create(model=demo_server.model, messages=messages, max_tokens=2,
                                                 stream=True, extra_body={"prompt_logprobs": 0}))
    assert chunks and all("prompt_logprobs" not in (c.model_extra or {}) for c in chunks)


def test_prompt_logprobs_minus_one_is_the_whole_vocabulary_under_max_logprobs_minus_one(demo_model_dir, demo_hf):
    from ember.server.config import ServeConfig
    from tests.server.conftest import served

    config = ServeConfig(model_dir=demo_model_dir, served_model_name="wide", max_logprobs=-1, kv_cache_blocks=64)
    with served(config) as srv:
        text = "Once upon a time"
        ids = srv.tokenizer.encode(text)
        r = srv.openai().completions.create(model="wide", prompt=text, max_tokens=1, extra_body={"prompt_logprobs": -1})
        vocab = srv.runtime.model_info.vocab_size
        _check_vllm_shape(r.choices[0].model_extra["prompt_logprobs"], ids, _logp(demo_hf, ids), vocab,
                          srv.runtime.token_bytes.token_bytes)


def test_max_logprobs_bounds_every_logprobs_field(demo_server, demo_model_dir):
    """vLLM's --max-logprobs: 20 by default (a larger request is a 400 naming its field on every route), raised to
    give more alternatives per token, or -1 for the whole vocabulary."""
    import dataclasses

    import httpx

    from tests.server.conftest import _serve

    messages = [{"role": "user", "content": "hi"}]
    for route, body, field in (
            ("/v1/chat/completions", {"messages": messages, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ("/v1/chat/completions", {"messages": messages, "prompt_logprobs": 21}, "prompt_logprobs"),
            ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
            ("/v1/responses", {"input": "hi", "top_logprobs": 21}, "top_logprobs")):
        r = httpx.post(demo_server.url + route, json={"model": demo_server.model, "max_tokens": 2, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (route, r.text)
        assert "--max-logprobs" in r.text
    wide_config = dataclasses.replace(demo_server.app.state.ember.config, max_logprobs=-1)
    srv, _ = _serve(demo_server.runtime, wide_config)  # the front end's bound (the engine's is its own setting)
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
            "messages": messages, "max_tokens": 1, "logprobs": True, "top_logprobs": 21})
        assert r.status_code == 400 and "max_logprobs" in r.text  # the demo engine still holds 20
    finally:
        srv.stop()


def test_an_engine_with_more_logprobs_returns_them(demo_model_dir):
    from ember.engine.engine import Engine
    from ember.engine.params import SamplingParams

    engine = Engine.from_pretrained(demo_model_dir, max_logprobs=50, num_kv_blocks=16, max_model_len=128)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=1, logprobs=40, prompt_logprobs=30))
    outs = [o for o in engine.step() if o.request_id == rid]
    assert len(outs[0].logprobs[0].top) == 40 and len(outs[0].prompt_logprobs[0].top) == 30
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        Engine.from_pretrained(demo_model_dir, num_kv_blocks=16, max_model_len=128).add_request(
            [5], SamplingParams(logprobs=21))
