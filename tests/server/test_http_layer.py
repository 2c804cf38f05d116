"""The HTTP layer as a client or an operator sees it: what is checked first (the API key), error shapes and codes for
bodies the server cannot read, headers RFC 9110 asks for, log IDs, metrics labels, the OpenAPI document, and an
event loop that keeps serving while a long prompt is tokenized."""
from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import re
import socket
import threading
import time
import warnings
import zlib

import httpx
import pytest

from tests.server.conftest import _serve

HI = [{"role": "user", "content": "hi"}]
KEY = {"authorization": "Bearer sekrit"}
JSON = {"content-type": "application/json"}


def _metric(server, series: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _count(server, endpoint: str, status: int) -> float:
    return _metric(server, f'ember_requests_total{{endpoint="{endpoint}",status="{status}"}}')


class _SlowTokenizer:
    """The demo tokenizer, taking a second over any text that starts with ``slow:``."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, text, **kw):
        if text.startswith("slow:"):
            time.sleep(1.5)
        return self._tokenizer.encode(text, **kw)


def test_a_completion_prompt_is_tokenized_off_the_event_loop(demo_runtime):
    runtime, config = demo_runtime
    srv, _ = _serve(dataclasses.replace(runtime, tokenizer=_SlowTokenizer(runtime.tokenizer)), config)
    try:
        for path, body in [("/v1/completions", {"prompt": "slow: hi", "max_tokens": 1}),
                           ("/invocations", {"prompt": "slow: hi", "max_tokens": 1})]:
            slow = threading.Thread(target=httpx.post, args=(srv.url + path,), kwargs={"json": body, "timeout": 60})
            slow.start()
            time.sleep(0.3)
            t0 = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
            assert time.monotonic() - t0 < 1.0, path  # a blocked loop answers after the 1.5 s encode (>= 1.2 s)
            slow.join()
    finally:
        srv.stop()


def test_anthropic_routes_answer_in_anthropics_shape_under_a_root_path(demo_runtime):
    import dataclasses

    from ember.server.app import BackgroundServer, create_app

    runtime, config = demo_runtime
    app = create_app(runtime, dataclasses.replace(config, root_path="/ember"), shutdown_engine=False)
    srv = BackgroundServer(app).start()
    try:
        for prefix in ("", "/ember"):  # a proxy that strips the prefix, and one that forwards it
            r = httpx.post(srv.url + prefix + "/v1/messages", json={"messages": HI, "max_tokens": 2}, timeout=30)
            assert r.status_code == 400 and r.json()["type"] == "error", r.text
            assert "model" in r.json()["error"]["message"]
            r = httpx.get(srv.url + prefix + "/v1/messages", timeout=30)
            assert r.status_code == 405 and r.json()["type"] == "error", r.text
            r = httpx.post(srv.url + prefix + "/v1/chat/completions", json={"messages": 5}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    finally:
        srv.stop()


def test_a_client_that_hangs_up_while_sending_its_body_is_a_quiet_499(demo_server, caplog):
    caplog.set_level(logging.WARNING)
    before = {s: _count(demo_server, "/v1/chat/completions", s) for s in (499, 500)}
    port = int(demo_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"messages\": [")
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while _count(demo_server, "/v1/chat/completions", 499) == before[499] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _count(demo_server, "/v1/chat/completions", 499) == before[499] + 1
    assert _count(demo_server, "/v1/chat/completions", 500) == before[500]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_wrong_method_is_a_405_with_an_allow_header(demo_server):
    for method, path, allowed in [("DELETE", "/v1/models", "GET"), ("GET", "/v1/chat/completions", "POST"),
                                  ("PUT", "/health", "GET"), ("GET", "/v1/messages", "POST"),
                                  ("PUT", "/ping", "GET, POST"), ("PUT", "/v1/responses/x", "GET, DELETE")]:
        r = httpx.request(method, demo_server.url + path, timeout=30)
        assert r.status_code == 405 and r.headers.get("allow") == allowed, (method, path, r.headers)


def test_the_logged_request_id_is_the_id_the_client_got(rebuilt_server, caplog):
    srv = rebuilt_server(enable_log_requests=True)
    caplog.set_level(logging.INFO, logger="ember.requests")
    for path, body in [("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
                       ("/v1/messages", {"model": "ember-demo", "messages": HI, "max_tokens": 2}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 16})]:
        r = httpx.post(srv.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        lines = [x.getMessage() for x in caplog.records if x.name == "ember.requests"]
        assert any(x.startswith(f"Received request {rid}-0: ") for x in lines), (rid, lines)
        assert any(x.startswith(f"Finished request {rid}-0: ") for x in lines), (rid, lines)


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_body_that_is_not_sent_as_json_is_refused_naming_the_content_type(demo_server, content_type):
    """A browser page on another origin may POST text/plain or a form without a preflight: none generates."""
    tokens = _metric(demo_server, "ember_generation_tokens_total")
    body = json.dumps({"messages": HI, "max_tokens": 2}).encode()
    headers = {"content-type": content_type} if content_type else {}
    for path in ("/v1/chat/completions", "/invocations", "/v1/messages"):
        r = httpx.post(demo_server.url + path, content=body, headers=headers, timeout=30)
        assert r.status_code == 400, (path, r.text)
        message = r.json()["error"]["message"]
        assert message.startswith("Content-Type must be application/json"), (path, message)
        assert (content_type or "has none") in message, message
    assert _metric(demo_server, "ember_generation_tokens_total") == tokens
    r = httpx.post(demo_server.url + "/invocations", content=body,
                   headers={"content-type": "application/json; charset=utf-8"}, timeout=30)
    assert r.status_code == 200, r.text


def test_either_key_header_holding_a_valid_key_is_enough(keyed_server):
    body = {"model": "ember-demo", "messages": HI, "max_tokens": 1}
    for headers, status in [({"authorization": "Bearer sekrit", "x-api-key": "sk-ant-else"}, 200),
                            ({"authorization": "Bearer sk-else", "x-api-key": "sekrit"}, 200),
                            ({"authorization": "Bearer sk-else", "x-api-key": "sk-ant-else"}, 401)]:
        r = httpx.post(keyed_server.url + "/v1/messages", json=body, headers=headers, timeout=60)
        assert r.status_code == status, (headers, r.text)


def test_the_api_key_is_checked_before_the_body(keyed_server):
    for body in (b'{"model":', b'{"messages":[{"role":"user","content":"\\ud800"}]}', b'{"messages":5}',
                 gzip.compress(b"{}")):
        r = httpx.post(keyed_server.url + "/v1/chat/completions", content=body, headers=JSON, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (body, r.text)
        r = httpx.post(keyed_server.url + "/v1/messages", content=body, headers=JSON, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (body, r.text)
        r = httpx.post(keyed_server.url + "/invocations", content=body, headers=JSON, timeout=30)
        assert r.status_code == 401, (body, r.text)
    for method, path in [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version"),
                         ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs")]:
        assert httpx.request(method, keyed_server.url + path, timeout=30).status_code == 200, path


def test_a_v1_path_without_a_route_needs_the_key_too(keyed_server):
    """vLLM guards every /v1 path: without a key, a path no route serves (or a method it does not take) is a 401,
    so which routes exist is not told; with the key it is the 404 / 405."""
    for method, path in [("GET", "/v1/nonexistent"), ("POST", "/v1/admin/drain"), ("DELETE", "/v1/models")]:
        r = httpx.request(method, keyed_server.url + path, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    key = {"authorization": "Bearer sekrit"}
    assert httpx.get(keyed_server.url + "/v1/nonexistent", headers=key, timeout=30).status_code == 404
    assert httpx.delete(keyed_server.url + "/v1/models", headers=key, timeout=30).status_code == 405
    assert httpx.get(keyed_server.url + "/nonexistent", timeout=30).status_code == 404


def test_a_body_the_json_decoder_never_sees_is_json_invalid_naming_the_problem(demo_server):
    ok = json.dumps({"messages": HI, "max_tokens": 2}).encode()
    deep = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    cases = [(b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', {}, "not UTF-8"),
             (gzip.compress(ok), {"content-encoding": "gzip"}, "Content-Encoding gzip is not supported"),
             (zlib.compress(ok), {"content-encoding": "deflate"}, "Content-Encoding deflate is not supported"),
             (deep, {}, "nested too deeply"),
             (ok.decode().encode("utf-16"), {}, "not UTF-8"),  # json.loads would read it: its \ud800 unchecked
             (b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"9" * 5000 + b"}", {},
              "integer string conversion")]
    for body, headers, says in cases:
        for path in ("/v1/chat/completions", "/invocations"):
            r = httpx.post(demo_server.url + path, content=body, headers={**JSON, **headers}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid", (path, says, r.text)
            assert says in r.json()["error"]["message"], (path, r.text)


def test_the_openapi_document_has_unique_operation_ids_and_builds_without_warnings(demo_runtime):
    from ember.server.app import create_app

    runtime, config = demo_runtime
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        doc = create_app(runtime, config, shutdown_engine=False).openapi()
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert {"get", "post"} <= set(doc["paths"]["/ping"])


def test_fastapis_pages_are_counted_under_their_own_paths(demo_server):
    for path in ("/docs", "/openapi.json", "/redoc"):
        before = _count(demo_server, path, 200)
        assert httpx.get(demo_server.url + path, timeout=30).status_code == 200
        assert _count(demo_server, path, 200) == before + 1, path


def test_a_bug_is_one_logged_500_and_the_connection_stays_usable(demo_server, caplog, monkeypatch):
    """An unexpected exception in a handler: an OpenAI-shaped 500 naming the exception type, one ERROR log line with
    the traceback, and the same keep-alive connection still answers the client's next request."""
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(demo_server.runtime, "render", broken)
    caplog.set_level(logging.ERROR)
    before = _count(demo_server, "/tokenize", 500)
    port = int(demo_server.url.rsplit(":", 1)[1])

    def post(sock: socket.socket, body: dict) -> tuple[int, dict]:
        data = json.dumps(body).encode()
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < int(
                re.search(rb"content-length: (\d+)", reply.lower()).group(1)):
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection"
            reply += chunk
        head, payload = reply.split(b"\r\n\r\n", 1)
        return int(head.split()[1]), json.loads(payload)

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        status, body = post(sock, {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 500 and body["error"]["message"] == "internal error: RuntimeError", body
        assert post(sock, {"prompt": "hi"})[0] == 200
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None, [rec.getMessage() for rec in errors]
    assert _count(demo_server, "/tokenize", 500) == before + 1
