"""--enable-log-requests / --max-log-len: one log line as each request reaches the engine, one as it ends."""
from __future__ import annotations

import ast
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


def test_a_cut_prompt_is_marked_as_cut_whatever_its_script(demo_model_dir, caplog):
    """The logged prompt is the first --max-log-len characters of what its first --max-log-len tokens spell, marked
    as cut with the prompt's token count (never a character count of the cut itself, nor a half character), also
    when each character takes several tokens, and at --max-log-len 0."""
    from transformers import AutoTokenizer

    from ember.engine.params import SamplingParams
    from ember.server.request_log import RequestLog

    demo_tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    caplog.set_level(logging.INFO, logger="ember.requests")
    for prompt, limit, text in (("one two three four five six seven", 5, "'one t'... "),
                                ("日本語のテキストはここにあります。" * 3, 4, None),
                                ("one two three", 0, "''... ")):
        ids = demo_tokenizer.encode(prompt, add_special_tokens=False)
        caplog.clear()
        RequestLog(limit).received("r-0", ids, SamplingParams(), demo_tokenizer.decode)
        [line] = _lines(caplog)
        shown = line.split("prompt: ", 1)[1].split(", params: ")[0]
        assert shown.endswith(f"... ({len(ids)} tokens)"), line
        assert "\ufffd" not in shown and "�" not in shown
        if text is not None:
            assert shown.startswith(text), line
        else:
            head_text = ast.literal_eval(shown.split("... (")[0])
            assert 0 < len(head_text) <= limit and prompt.startswith(head_text), line
        head = "".join(f"{i}, " for i in ids[:limit])
        assert line.endswith(f"prompt_token_ids: [{head}...] ({len(ids)} tokens)"), line


def test_nothing_is_logged_by_default(rebuilt_server, caplog):
    srv = rebuilt_server()
    caplog.set_level(logging.INFO, logger="ember.requests")
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "secret"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert _lines(caplog) == []
