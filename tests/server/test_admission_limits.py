"""Limits that are checked at admission, before a stream starts: the KV cache's total size, one step's tokens with
chunked prefill off, and min_tokens."""
from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from ember.server.app import BackgroundServer, create_app, load_runtime
from ember.server.config import ServeConfig

CACHE_BLOCKS = 6  # 96 tokens in all: far less than the demo model's context
STEP_TOKENS = 48  # with chunked prefill off, the longest prompt


@pytest.fixture(scope="module")
def small_cache_server(demo_model_dir):
    config = ServeConfig(model_dir=demo_model_dir, max_num_seqs=4, kv_cache_blocks=CACHE_BLOCKS,
                         enable_chunked_prefill=False, max_num_batched_tokens=STEP_TOKENS)
    runtime = load_runtime(config)
    server = BackgroundServer(create_app(runtime, config)).start()
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    yield server, model
    server.stop()


def test_reply_without_max_tokens_is_clamped_to_the_cache(small_cache_server):
    server, model = small_cache_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "seed": 1})
    chunks = list(stream)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert usage.total_tokens == CACHE_BLOCKS * 16


def test_prompt_larger_than_the_cache_is_a_400(small_cache_server):
    server, model = small_cache_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "word " * 200}],
                                       stream=True)
    assert "KV cache" in str(e.value)


def test_prompt_longer_than_a_step_without_chunked_prefill_is_a_400(small_cache_server):
    """The engine would refuse it; the front end does before a stream opens, so the SDK raises BadRequestError."""
    server, model = small_cache_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    prompt = "word " * 35
    count = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=10).json()["count"]
    assert STEP_TOKENS < count < CACHE_BLOCKS * 16
    with pytest.raises(openai.BadRequestError) as e:
        list(client.completions.create(model=model, prompt=prompt, max_tokens=2, stream=True))
    assert "--max-num-batched-tokens" in str(e.value) and e.value.body["param"] == "prompt"


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_above_max_tokens_is_a_400_naming_the_field(small_cache_server, stream):
    server, model = small_cache_server
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "min_tokens": 9,
        "stream": stream})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "min_tokens" and "min_tokens" in err["message"]


def test_a_burst_beyond_max_waiting_is_refused_before_the_engine_reports_it(demo_model_dir):
    """8 requests at once for 2 slots with max_waiting 1: the front end counts what it admitted (the engine's counts
    come with its steps, which a burst outruns), so the burst gets 503s, OpenAI-shaped; once every request ended, or
    its client left mid-stream, nothing stays counted."""
    import asyncio

    config = ServeConfig(model_dir=demo_model_dir, max_num_seqs=2, max_waiting=1, kv_cache_blocks=64)
    runtime = load_runtime(config)
    app = create_app(runtime, config)
    server = BackgroundServer(app).start()
    body = {"model": runtime.model_name, "prompt": "Once", "max_tokens": 300, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(8)))

    try:
        replies = asyncio.run(burst())
        codes = [r.status_code for r in replies]
        assert codes.count(503) >= 4 and codes.count(200) >= 2, codes
        refused = next(r for r in replies if r.status_code == 503).json()["error"]
        assert refused["code"] == "overloaded" and refused["type"] == "server_error"
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            next(s.iter_lines())
        deadline = time.monotonic() + 10
        while app.state.ember.admitted.count and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.state.ember.admitted.count == 0
    finally:
        server.stop()


def test_preemptions_are_counted_in_metrics(small_cache_server):
    """Four replies that together outgrow the 6-block cache: the engine preempts, and /metrics counts it under
    vLLM's name; every reply still finishes."""
    import concurrent.futures

    server, model = small_cache_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")

    def reply(i: int) -> str:
        return client.completions.create(model=model, prompt=f"Story {i}", max_tokens=30, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(reply, range(4))) == ["length"] * 4
    text = httpx.get(server.url + "/metrics", timeout=10).text
    [count] = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_preemptions_total{")]
    assert count >= 1


def test_a_prompt_text_too_long_for_any_tokenization_is_refused_before_tokenizing(demo_server):
    """More characters than the context's tokens can spell: a 400 naming the field, without tokenizing (a 50 MB
    prompt took the server's memory), on every route that tokenizes; a prompt that asks for truncation is still
    tokenized and cut."""
    huge = "x" * (demo_server.runtime.max_prompt_chars + 1)
    cases = [("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 1}, "messages"),
             ("/v1/completions", {"prompt": huge, "max_tokens": 1}, "prompt"),
             ("/v1/messages", {"model": "ember-demo", "max_tokens": 1,
                               "messages": [{"role": "user", "content": huge}]}, None),
             ("/v1/responses", {"input": huge, "max_output_tokens": 1}, "input"),
             ("/v1/embeddings", {"input": ["ok", huge]}, "input[1]"),
             ("/tokenize", {"prompt": huge}, "prompt")]
    n = demo_server.runtime.max_model_len
    for path, body, param in cases:
        r = httpx.post(demo_server.url + path, json=body, timeout=60)
        # Anthropic's own wording, with the least count the text can have (past the context's tokens by the few the
        # template's own text adds)
        least = re.search(r"prompt is too long: (\d+) tokens > (\d+) maximum", r.text)
        refused_before_tokenizing = (least is not None and n < int(least[1]) <= n + 4 and int(least[2]) == n - 1) \
            if param is None else "characters" in r.text
        assert r.status_code == 400 and refused_before_tokenizing, (path, r.text)
        if param is not None:
            assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "context_length_exceeded"
    cut = httpx.post(demo_server.url + "/v1/completions", timeout=60,
                     json={"prompt": huge, "max_tokens": 1, "truncate_prompt_tokens": 8})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 8


def test_an_input_longer_than_the_cache_names_the_cache_not_the_context(small_cache_server):
    """Pooling routes, as chat: a limit set by the KV cache is named as the cache's, not the model's context."""
    server, model = small_cache_server
    r = httpx.post(server.url + "/v1/embeddings", json={"model": model, "input": "word " * 60}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert f"KV cache holds {CACHE_BLOCKS * 16} tokens" in r.json()["error"]["message"], r.text
