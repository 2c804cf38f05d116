"""Chat logprobs cover every byte of the content, also a delimiter token the parser surfaced as ordinary text."""
from __future__ import annotations

import json

import httpx

SURFACED = {"model": "ember-demo", "messages": [{"role": "user", "content": "日本語 😀"}], "seed": 12,
            "chat_template_kwargs": {"enable_thinking": False}, "logprobs": True, "max_tokens": 64}


def _rebuilt(entries: list[dict]) -> str:
    return b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", "replace")


def test_a_surfaced_delimiter_keeps_its_logprob(demo_server):
    """With thinking off, the demo model writes `</think>` mid-answer: it is content, so its entry comes with it."""
    url = demo_server.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json={**SURFACED, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c for ch in chunks for c in ch["choices"]]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    entries = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
    assert "</think>" in content
    assert _rebuilt(entries) == content
    for c in choices:
        if c["delta"].get("content") == "</think>":
            assert [e["token"] for e in c["logprobs"]["content"]] == ["</think>"]
    whole = httpx.post(url, json=SURFACED, timeout=60).json()["choices"][0]
    assert whole["message"]["content"] == content and _rebuilt(whole["logprobs"]["content"]) == content
