"""`--speculative-config` (vLLM's ngram JSON) served: greedy replies, structured output included, are the plain
server's, token for token, and /metrics counts the draft and accepted tokens as vLLM names them."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import served


def test_a_speculating_server_answers_as_the_plain_one(demo_server, demo_runtime):
    from ember.server.config import ServeConfig

    motif = list(range(300, 312))
    body = {"prompt": motif * 4, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    plain = httpx.post(demo_server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    want = plain["token_ids"]
    # a stop string completed inside a step that kept several tokens: the reply ends where plain decoding's does
    stopped = {**body, "stop": [plain["text"][len(plain["text"]) // 2:][:4]], "logprobs": 1}
    want_stopped = httpx.post(demo_server.url + "/v1/completions", json=stopped, timeout=60).json()
    assert want_stopped["choices"][0]["finish_reason"] == "stop"
    schema = {"type": "array", "minItems": 6, "maxItems": 6, "items": {"enum": ["red fox", "red hen"]}}
    chat = {"model": "ember-demo", "messages": [{"role": "user", "content": "Six animals, please."}],
            "max_tokens": 80, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False},
            "response_format": {"type": "json_schema", "json_schema": {"name": "animals", "schema": schema}}}
    want_json = httpx.post(demo_server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert len(json.loads(want_json["choices"][0]["message"]["content"])) == 6
    # a thought under a budget of 5 tokens, then the JSON: draft rows past the thought's end see the budget spent
    thinking = {**chat, "chat_template_kwargs": {"enable_thinking": True}, "max_thinking_tokens": 5}
    want_thought = httpx.post(demo_server.url + "/v1/chat/completions", json=thinking, timeout=60).json()
    assert len(json.loads(want_thought["choices"][0]["message"]["content"])) == 6
    assert want_thought["choices"][0]["message"]["reasoning_content"]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                       "prompt_lookup_min": 1})
    config = ServeConfig(model_dir=demo_runtime[1].model_dir, served_model_name="ember-demo", max_num_seqs=4,
                         kv_cache_blocks=128, speculative_config=spec,  # the engine in its own process
                         chat_template=demo_runtime[1].chat_template)
    with served(config) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        r = httpx.post(srv.url + "/v1/completions", json=stopped, timeout=60).json()
        got_lp, want_lp = r["choices"][0].pop("logprobs"), want_stopped["choices"][0].pop("logprobs")
        assert r["choices"] == want_stopped["choices"] and r["usage"] == want_stopped["usage"]
        assert got_lp["tokens"] == want_lp["tokens"] and got_lp["text_offset"] == want_lp["text_offset"]
        assert got_lp["token_logprobs"] == pytest.approx(want_lp["token_logprobs"], abs=1e-4)  # a row in a chunk
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == want_json["choices"][0]["message"]  # the grammar speculates too
        assert r.json()["usage"] == want_json["usage"]
        r = httpx.post(srv.url + "/v1/chat/completions", json=thinking, timeout=60).json()
        assert r["choices"][0]["message"] == want_thought["choices"][0]["message"] and r["usage"] == want_thought[
            "usage"]
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_")}
    assert counts["vllm:spec_decode_num_draft_tokens_total"] >= counts["vllm:spec_decode_num_accepted_tokens_total"] > 0
    drafts = counts["vllm:spec_decode_num_drafts_total"]
    assert counts["vllm:spec_decode_num_draft_tokens_total"] / 4 <= drafts <= counts[
        "vllm:spec_decode_num_draft_tokens_total"]
    per_pos = {int(line.split('position="')[1].split('"')[0]): float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines()
               if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")}
    assert sorted(per_pos) == [0, 1, 2, 3]  # num_speculative_tokens positions
    assert sum(per_pos.values()) == counts["vllm:spec_decode_num_accepted_tokens_total"]
    assert per_pos[0] >= per_pos[1] >= per_pos[2] >= per_pos[3]  # a draft is kept only after the ones before it
    # vLLM observes one inter-token interval per engine step (a step's accepted drafts arrive with it), Ember's own
    # histogram one per token: the step count is short of the token count by at most the accepted drafts
    itl = {line.split("_count")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
           if "inter_token_latency_seconds_count" in line}
    per_token, per_step = itl["ember_inter_token_latency_seconds"], itl["vllm:inter_token_latency_seconds"]
    assert 0 < per_token - per_step <= counts["vllm:spec_decode_num_accepted_tokens_total"], itl
