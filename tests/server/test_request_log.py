"""--enable-log-requests / --max-log-len: one log line as each request reaches the engine, one as it ends."""
from __future__ import annotations

import logging

import httpx


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ember.requests"]


def test_each_request_logs_what_it_received_and_how_it_ended(rebuilt_server, caplog):
    srv = rebuilt_server(enable_log_requests=True)
    caplog.set_level(logging.INFO, logger="ember.requests")
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    received, finished = _lines(caplog)
    assert received.startswith(f"Received request {rid}-0: prompt: 'Once upon a time', params: {{")
    assert "max_tokens=3" in received and "temperature=0" in received and "ignore_eos=True" in received
    assert "top_p=" not in received  # settings left at their defaults are not listed
    assert finished.startswith(f"Finished request {rid}-0: length, prompt_tokens=") and "output_tokens=3" in finished

    caplog.clear()
    r = httpx.post(srv.url + "/v1/embeddings", timeout=60, json={"input": ["a b c", "d"]})
    assert r.status_code == 200, r.text
    lines = _lines(caplog)
    assert sum(x.startswith("Received request ") for x in lines) == 2
    assert sum(x.startswith("Finished request ") and ": pooled," in x for x in lines) == 2


def test_max_log_len_cuts_the_prompt_and_its_ids(rebuilt_server, caplog):
    srv = rebuilt_server(enable_log_requests=True, max_log_len=5)
    caplog.set_level(logging.INFO, logger="ember.requests")
    prompt = "a long prompt that goes on and on " * 4
    ids = httpx.post(srv.url + "/tokenize", timeout=60, json={"prompt": prompt}).json()["tokens"]
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    received = _lines(caplog)[0]
    assert f"prompt_token_ids: {str(ids[:5])[:-1]}, ...] ({len(ids)} tokens)" in received
    assert prompt not in received and prompt[:20] not in received


def test_nothing_is_logged_by_default(rebuilt_server, caplog):
    srv = rebuilt_server()
    caplog.set_level(logging.INFO, logger="ember.requests")
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "secret"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert _lines(caplog) == []
