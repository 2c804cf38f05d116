"""Endpoints and fields tools expect, on the real server: /tokenize and /detokenize (vLLM's shapes), cached prompt
tokens in usage (OpenAI and Anthropic shapes), SSE keep-alive comments, `reasoning_effort` reaching the chat template,
CORS with --allowed-origins, client request IDs (X-Request-Id), and /health failing once the engine is gone."""
from __future__ import annotations

import dataclasses
import json
import secrets
import time

import httpx
import openai
import pytest

from tests.server.conftest import _serve


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_tokenize_a_prompt_or_chat_messages_and_detokenize(demo_server):
    tok = demo_server.tokenizer
    r = _post(demo_server, "/tokenize", {"model": "ember-demo", "prompt": "Hello world", "return_token_strs": True})
    ids = tok.encode("Hello world", add_special_tokens=True)
    assert r.status_code == 200
    assert r.json() == {"count": len(ids), "max_model_len": demo_server.runtime.max_model_len, "tokens": ids,
                        "token_strs": tok.convert_ids_to_tokens(ids)}
    plain = _post(demo_server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode("Hello world", add_special_tokens=False) and plain["token_strs"] is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = _post(demo_server, "/tokenize", {"messages": messages}).json()
    reply = _post(demo_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == len(chat["tokens"]) == reply["usage"]["prompt_tokens"]  # what chat would prefill
    text = _post(demo_server, "/detokenize", {"model": "ember-demo", "tokens": chat["tokens"]}).json()["prompt"]
    assert text == tok.decode(chat["tokens"]) and "Hi there" in text and "Be brief." in text


def test_tokenize_errors_name_the_field(demo_server):
    both = _post(demo_server, "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    assert both.status_code == 400 and "exactly one of prompt and messages" in both.json()["error"]["message"]
    assert both.json()["error"]["param"] == "prompt"
    neither = _post(demo_server, "/tokenize", {})
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt", neither.text
    bad = _post(demo_server, "/detokenize", {"tokens": [5, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    boolean = _post(demo_server, "/detokenize", {"tokens": [5, True]})
    assert boolean.status_code == 400 and boolean.json()["error"]["param"] == "tokens[1]"
    wrong = _post(demo_server, "/tokenize", {"model": "other", "prompt": "x"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


def test_an_empty_model_name_is_the_served_model(demo_server):
    """vLLM reads ``"model": ""`` (sent by some UIs) as the base model; the reply names the served model."""
    reply = _post(demo_server, "/v1/chat/completions",
                  {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert reply.status_code == 200 and reply.json()["model"] == "ember-demo", reply.text
    assert _post(demo_server, "/v1/completions", {"model": "", "prompt": "x", "max_tokens": 1}).status_code == 200
    assert _post(demo_server, "/tokenize", {"model": "", "prompt": "x"}).status_code == 200


def test_tokenize_refuses_the_tools_chat_refuses(demo_server):
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}] * 2
    chat = _post(demo_server, "/v1/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 1})
    tok = _post(demo_server, "/tokenize", {"messages": messages, "tools": tools})
    assert chat.status_code == tok.status_code == 400, tok.text
    assert tok.json()["error"] == chat.json()["error"] and tok.json()["error"]["param"] == "tools[1].function.name"
    assert _post(demo_server, "/tokenize", {"messages": messages, "tools": tools[:1]}).status_code == 200


def test_tokenize_a_prompt_ignores_the_chat_only_continue_final_message(demo_server):
    r = _post(demo_server, "/tokenize", {"prompt": "Hello world", "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == demo_server.tokenizer.encode("Hello world")
    both = _post(demo_server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                            "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_tokenize_needs_the_api_key_when_one_is_set(keyed_server):
    assert _post(keyed_server, "/tokenize", {"prompt": "x"}).status_code == 401
    ok = httpx.post(keyed_server.url + "/detokenize", json={"tokens": [5]}, headers={"x-api-key": "sekrit"})
    assert ok.status_code == 200


def _unique_prompt() -> str:
    return f"cache probe {secrets.token_hex(6)} " + "the quick brown fox jumps " * 12


def test_openai_usage_reports_prompt_tokens_served_from_the_prefix_cache(demo_server):
    client = demo_server.openai()
    messages = [{"role": "user", "content": _unique_prompt()}]
    first = client.chat.completions.create(model="ember-demo", messages=messages, max_tokens=2)
    second = client.chat.completions.create(model="ember-demo", messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0  # whole KV blocks
    stream = client.chat.completions.create(model="ember-demo", messages=messages, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True})
    last = list(stream)[-1]
    assert last.usage.prompt_tokens_details.cached_tokens == cached
    prompt = _unique_prompt()
    client.completions.create(model="ember-demo", prompt=prompt, max_tokens=1)
    again = client.completions.create(model="ember-demo", prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_anthropic_usage_reports_cache_read_input_tokens(demo_server):
    """Anthropic's buckets: `input_tokens` are the prompt tokens not read from the cache, so the two add up to the
    whole prompt (what count_tokens counts), streamed or not."""
    client = demo_server.anthropic()
    messages = [{"role": "user", "content": _unique_prompt()}]
    first = client.messages.create(model="ember-demo", max_tokens=2, messages=messages)
    second = client.messages.create(model="ember-demo", max_tokens=2, messages=messages)
    prompt = client.messages.count_tokens(model="ember-demo", messages=messages).input_tokens
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens == prompt
    assert 16 <= second.usage.cache_read_input_tokens < prompt
    assert second.usage.input_tokens == prompt - second.usage.cache_read_input_tokens
    with client.messages.stream(model="ember-demo", max_tokens=2, messages=messages) as s:
        final = s.get_final_message()
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (
        second.usage.input_tokens, second.usage.cache_read_input_tokens)


def test_a_silent_stream_gets_keepalive_comments(demo_runtime):
    runtime, config = demo_runtime
    srv, _ = _serve(runtime, dataclasses.replace(config, sse_keepalive_seconds=0.001))
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
            events = [e for e in r.read().decode().split("\n\n") if e]
        assert ": keep-alive" in events  # at least the wait for the first token was filled
        data = [e for e in events if e != ": keep-alive"]
        assert all(e.startswith("data: ") for e in data) and data[-1] == "data: [DONE]"
        assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] is not None
        sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        chunks = list(sdk.chat.completions.create(model="ember-demo", stream=True, **{
            k: v for k, v in body.items() if k != "stream"}))
        assert chunks[-1].choices[0].finish_reason is not None  # the SDK skips the comments
    finally:
        srv.stop()


def test_reasoning_effort_reaches_the_chat_template(demo_runtime):
    runtime, config = demo_runtime
    template = "{% for m in messages %}{{ m.content }}{% endfor %} effort={{ reasoning_effort | default('unset') }}"
    srv, _ = _serve(dataclasses.replace(runtime, chat_template=template), config)
    tok = runtime.tokenizer

    def prompt(**extra) -> str:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "return_token_ids": True, **extra}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return tok.decode(r.json()["prompt_token_ids"])

    try:
        assert prompt(reasoning_effort="high") == "Hi effort=high"
        assert prompt() == "Hi effort=unset"
        assert prompt(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}) == "Hi effort=low"
        bad = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "extreme"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    finally:
        srv.stop()


def test_allowed_origins_switch_cors_on(demo_runtime):
    runtime, config = demo_runtime
    srv, _ = _serve(runtime, dataclasses.replace(config, allowed_origins=("http://localhost:3000",)))
    try:
        pre = httpx.options(srv.url + "/v1/chat/completions", timeout=10, headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://evil.example"}, timeout=10)
        assert "access-control-allow-origin" not in other.headers
        ok = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://localhost:3000"}, timeout=10)
        assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    finally:
        srv.stop()


def test_cors_credentials_methods_and_headers_are_as_configured(demo_runtime):
    """--allow-credentials, --allowed-methods and --allowed-headers shape the preflight answer, as vLLM's do."""
    runtime, config = demo_runtime
    srv, _ = _serve(runtime, dataclasses.replace(config, allowed_origins=("*",), allow_credentials=True,
                                                  allowed_methods=("POST",), allowed_headers=("content-type",)))
    try:
        def preflight(method: str, headers: str) -> httpx.Response:
            return httpx.options(srv.url + "/v1/chat/completions", timeout=10, headers={
                "Origin": "http://app.example", "Access-Control-Request-Method": method,
                "Access-Control-Request-Headers": headers})

        ok = preflight("POST", "content-type")
        assert ok.status_code == 200 and ok.headers["access-control-allow-credentials"] == "true"
        assert ok.headers["access-control-allow-origin"] == "http://app.example"  # with credentials, not "*"
        assert preflight("DELETE", "content-type").status_code == 400
        assert preflight("POST", "x-secret").status_code == 400
    finally:
        srv.stop()


def test_load_counts_the_requests_being_served_with_load_tracking(demo_runtime):
    """GET /load is vLLM's {"server_load": N}: the generation requests in flight with
    --enable-server-load-tracking (a stream counts until it ends), 0 without the flag; it needs no API key."""
    runtime, config = demo_runtime
    srv, _ = _serve(runtime, dataclasses.replace(config, enable_server_load_tracking=True, api_key=("k",)))
    try:
        load = lambda: httpx.get(srv.url + "/load", timeout=10).json()  # noqa: E731
        assert load() == {"server_load": 0}
        body = {"prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer k"}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            assert load() == {"server_load": 1}
            assert [line for line in lines if line == "data: [DONE]"]
        deadline = time.monotonic() + 10  # the count drops once the server has finished the response, just after
        while load() != {"server_load": 0} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert load() == {"server_load": 0}
    finally:
        srv.stop()
    srv, _ = _serve(runtime, config)
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: {"))
            assert httpx.get(srv.url + "/load", timeout=10).json() == {"server_load": 0}
    finally:
        srv.stop()


def test_client_request_ids_name_the_response(demo_server):
    """vLLM's rule: a chat or text completion's id is its prefix and the request's X-Request-Id header, else its
    body's request_id; two requests running at once may share one."""
    url, chat = demo_server.url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "trace-7"}) as a, \
                c.stream("POST", url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "trace-7"}) as b:
            events = [[json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")] for r in (a, b)]
    for ev in events:
        assert ev and {e["id"] for e in ev} == {"chatcmpl-trace-7"} and ev[-1]["choices"][0]["finish_reason"]
    body = {"prompt": "Once", "max_tokens": 2, "request_id": "mine"}
    assert _post(demo_server, "/v1/completions", body).json()["id"] == "cmpl-mine"
    headed = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "hdr"}, timeout=60)
    assert headed.json()["id"] == "cmpl-hdr" and "x-request-id" not in headed.headers


def test_request_id_headers_flag_echoes_or_makes_one(demo_runtime):
    runtime, config = demo_runtime
    srv, _ = _serve(runtime, dataclasses.replace(config, enable_request_id_headers=True))
    try:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "abc"},
                          timeout=60) as r:
            assert r.headers["x-request-id"] == "abc" and "data: [DONE]" in r.read().decode()
        made = httpx.get(srv.url + "/v1/models/nope", timeout=10)
        assert made.status_code == 404 and len(made.headers["x-request-id"]) == 32
    finally:
        srv.stop()


def test_health_fails_once_the_engine_is_gone(demo_model_dir):
    from ember.server.app import BackgroundServer, create_app, load_runtime
    from ember.server.config import ServeConfig

    config = ServeConfig(model_dir=demo_model_dir, kv_cache_blocks=16, max_num_seqs=2, in_process=True)
    runtime = load_runtime(config)
    srv = BackgroundServer(create_app(runtime, config)).start()
    try:
        assert httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok"
        runtime.engine.shutdown()
        r = httpx.get(srv.url + "/health", timeout=10)
        assert r.status_code == 503
    finally:
        srv.stop()


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_new_routes_are_counted_in_metrics(demo_server, path):
    body = {"prompt": "x"} if path == "/tokenize" else {"tokens": [5]}
    assert _post(demo_server, path, body).status_code == 200
    text = httpx.get(demo_server.url + "/metrics", timeout=10).text
    assert f'ember_requests_total{{endpoint="{path}",status="200"}}' in text


def test_every_route_is_counted_under_its_path_template(demo_server):
    """Each served route has its own label (a model id does not make a new one); unknown paths share `other`."""
    assert _post(demo_server, "/v1/embeddings", {"input": "x"}).status_code == 200
    assert httpx.get(f"{demo_server.url}/v1/models/{demo_server.model}", timeout=10).status_code == 200
    assert httpx.get(demo_server.url + "/version", timeout=10).status_code == 200
    assert httpx.get(demo_server.url + "/no/such/route", timeout=10).status_code == 404
    text = httpx.get(demo_server.url + "/metrics", timeout=10).text
    for label in ('endpoint="/v1/embeddings",status="200"', 'endpoint="/v1/models/{model_id}",status="200"',
                  'endpoint="/version",status="200"', 'endpoint="other",status="404"'):
        assert "ember_requests_total{" + label + "}" in text, label


def test_vllm_http_metrics_leave_out_probes_and_scrapes(demo_server):
    """vLLM's http_requests_total / http_request_duration_seconds count API traffic only: /metrics, /health, /load,
    /ping and /version are left out (a scrape or a liveness probe adds no request rate), and a path no route serves
    is handler "none", as vLLM's instrumentator groups it."""
    def http_series() -> set[str]:
        text = httpx.get(demo_server.url + "/metrics", timeout=10).text
        return {line.split("{")[1].split("}")[0] for line in text.splitlines()
                if line.startswith("http_requests_total{")}

    for path in ("/health", "/ping", "/version", "/load", "/metrics", "/no/such/route"):
        httpx.get(demo_server.url + path, timeout=10)
    handlers = {series.split('handler="')[1].split('"')[0] for series in http_series()}
    assert not handlers & {"/health", "/ping", "/version", "/load", "/metrics", "other"}, handlers
    assert 'handler="none",method="GET",status="4xx"' in http_series()


def test_response_role_names_the_reply_and_a_continuation_keeps_the_last_role(demo_runtime):
    """`--response-role` is the reply's role after a generation prompt (streamed and whole); without a generation
    prompt the model continues the last message, whose role the reply keeps (vLLM's rule)."""
    runtime, config = demo_runtime
    srv, _ = _serve(runtime, dataclasses.replace(config, response_role="narrator"))
    hi = [{"role": "user", "content": "Hi"}]

    def roles(messages=hi, **extra) -> tuple[str, str]:
        whole = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                           json={"messages": messages, "max_tokens": 2, **extra})
        assert whole.status_code == 200, whole.text
        sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        first = next(iter(sdk.chat.completions.create(model="ember-demo", messages=messages, max_tokens=2,
                                                      stream=True, extra_body=extra)))
        return whole.json()["choices"][0]["message"]["role"], first.choices[0].delta.role

    try:
        assert roles() == ("narrator", "narrator")
        assert roles(add_generation_prompt=False) == ("user", "user")
        assert roles(messages=[*hi, {"role": "assistant", "content": "Hello"}], add_generation_prompt=False,
                     continue_final_message=True) == ("assistant", "assistant")
    finally:
        srv.stop()


def test_disable_fastapi_docs_hides_the_generated_docs(demo_server, rebuilt_server):
    assert httpx.get(demo_server.url + "/openapi.json", timeout=30).status_code == 200
    srv = rebuilt_server(disable_fastapi_docs=True)
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(srv.url + path, timeout=30).status_code == 404
    assert httpx.get(srv.url + "/v1/models", timeout=30).status_code == 200
