"""`--async-scheduling` served: streamed and whole replies, stop strings, logprobs, structured output and concurrent
requests answer as the in-order server does, token for token."""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from tests.server.conftest import served


def test_an_async_scheduling_server_answers_as_the_in_order_one(demo_server, demo_runtime):
    from ember.server.config import ServeConfig

    bodies = [{"prompt": list(range(200 + 7 * i, 230 + 7 * i)), "max_tokens": 24 + i, "temperature": 0,
               "ignore_eos": True, "return_token_ids": True} for i in range(6)]
    bodies.append({"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0.8, "seed": 11, "logprobs": 2})

    def complete(url: str) -> list[dict]:
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: httpx.post(url + "/v1/completions", json=b, timeout=60), bodies))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json()["choices"][0] | {"usage": r.json()["usage"]} for r in replies]

    want = complete(demo_server.url)
    text = want[0]["text"]
    stopped = {**bodies[0], "stop": [text[len(text) // 2:][:3]]}
    want_stopped = httpx.post(demo_server.url + "/v1/completions", json=stopped, timeout=60).json()
    assert want_stopped["choices"][0]["finish_reason"] == "stop"
    schema = {"type": "array", "minItems": 3, "maxItems": 3, "items": {"enum": ["red fox", "red hen"]}}
    chat = {"model": "ember-demo", "messages": [{"role": "user", "content": "Three animals, please."}],
            "max_tokens": 60, "temperature": 0, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
            "response_format": {"type": "json_schema", "json_schema": {"name": "animals", "schema": schema}}}
    want_json = demo_server.openai().chat.completions.create(**chat)
    plain_chat = {k: v for k, v in chat.items() if k != "response_format"} | {"max_tokens": 40}
    want_stream = "".join(c.choices[0].delta.content or "" for c in demo_server.openai().chat.completions.create(
        **plain_chat, stream=True) if c.choices)

    config = ServeConfig(model_dir=demo_runtime[1].model_dir, served_model_name="ember-demo", max_num_seqs=8,
                         kv_cache_blocks=256, async_scheduling=True, chat_template=demo_runtime[1].chat_template)
    with served(config) as srv:
        got = complete(srv.url)
        got_lp, want_lp = got[-1].pop("logprobs"), want[-1].pop("logprobs")
        assert got == want  # a row computed beside other rows than before may round differently in its logprobs
        assert got_lp["tokens"] == want_lp["tokens"] and got_lp["text_offset"] == want_lp["text_offset"]
        assert got_lp["token_logprobs"] == pytest.approx(want_lp["token_logprobs"], abs=1e-4)
        r = httpx.post(srv.url + "/v1/completions", json=stopped, timeout=60).json()
        assert r["choices"] == want_stopped["choices"] and r["usage"] == want_stopped["usage"]
        got_json = srv.openai().chat.completions.create(**chat)
        assert got_json.choices[0].message.content == want_json.choices[0].message.content
        assert len(json.loads(got_json.choices[0].message.content)) == 3
        got_stream = "".join(c.choices[0].delta.content or "" for c in srv.openai().chat.completions.create(
            **plain_chat, stream=True) if c.choices)
        assert got_stream == want_stream and got_stream

