"""A lone UTF-16 surrogate escape in a request body (valid JSON, not valid Unicode) gets a 400 naming the field on
every route, in the API's own error shape, and the connection stays usable; paired surrogates (an emoji written as
two escapes) and the escaped text ``\\ud800`` are ordinary input."""
from __future__ import annotations

import httpx
import pytest

LONE = '"hi \\ud83d"'  # the first half of an emoji, as a JavaScript client that cut a string mid-emoji sends it


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", '{"model": "ember-demo", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]}',
     "messages[0].content"),
    ("/v1/completions", '{"model": "ember-demo", "max_tokens": 2, "prompt": %s}', "prompt"),
    ("/v1/completions", '{"model": %s, "max_tokens": 2, "prompt": "a"}', "model"),
    ("/v1/responses", '{"model": "ember-demo", "max_output_tokens": 2, "input": "a", "stream": true, '
                      '"metadata": {"k": %s}}', "metadata.k"),
    ("/v1/embeddings", '{"model": "ember-demo", "input": [%s]}', "input[0]"),
    ("/tokenize", '{"model": "ember-demo", "prompt": %s}', "prompt"),
])
def test_openai_routes_refuse_a_lone_surrogate_naming_the_field(demo_server, path, body, field):
    with httpx.Client(base_url=demo_server.url, timeout=60) as client:
        r = client.post(path, content=body % LONE, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == field
        assert f"'{field}'" in err["message"] and "surrogate" in err["message"]
        # the same pooled connection still serves the next request
        ok = client.post("/v1/completions", json={"model": "ember-demo", "prompt": "a", "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_a_lone_surrogate_written_as_its_raw_bytes_is_refused_as_escaped(demo_server):
    """The bytes of a lone surrogate (ED A0 80: not UTF-8, but Python's JSON reader takes them) reached the tokenizer
    as a 500."""
    body = b'{"model": "ember-demo", "max_tokens": 2, "messages": [{"role": "user", "content": "a\xed\xa0\x80b"}]}'
    r = httpx.post(demo_server.url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text


def test_a_schema_sent_as_text_nested_too_deeply_is_a_400_naming_it(demo_server):
    body = {"model": "ember-demo", "max_tokens": 2, "messages": [{"role": "user", "content": "a"}],
            "guided_json": "[" * 100_000 + "]" * 100_000}
    r = httpx.post(demo_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text
    assert "nested too deeply" in r.json()["error"]["message"]


def test_messages_refuse_a_lone_surrogate_in_the_anthropic_shape(demo_server):
    body = ('{"model": "ember-demo", "max_tokens": 2, "system": [{"type": "text", "text": %s}], '
            '"messages": [{"role": "user", "content": "a"}]}') % LONE
    r = httpx.post(demo_server.url + "/v1/messages", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "'system[0].text'" in r.json()["error"]["message"]


def test_paired_surrogates_and_escaped_backslashes_are_ordinary_text(demo_server):
    for text in ('"smile \\ud83d\\ude00"', '"the text \\\\ud800"'):
        body = '{"model": "ember-demo", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]}' % text
        r = httpx.post(demo_server.url + "/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 200, r.text
