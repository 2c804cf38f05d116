"""vLLM's extra sampling fields on chat and text completions: allowed_token_ids, bad_words, cache_salt and
truncate_prompt_tokens act; use_beam_search and priority are refused by name rather than ignored."""
from __future__ import annotations

import httpx
import pytest


def _post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_allowed_token_ids_confine_the_reply(demo_server):
    allowed = [300, 301, 302, 303]
    chat = demo_server.openai().chat.completions.create(
        model="ember-demo", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=8, temperature=1.0,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True})
    assert chat.choices[0].token_ids and set(chat.choices[0].token_ids) <= set(allowed)
    r = _post(demo_server, "/v1/completions", prompt="Once", max_tokens=6, allowed_token_ids=allowed,
              return_token_ids=True, ignore_eos=True)
    assert set(r.json()["choices"][0]["token_ids"]) <= set(allowed)
    bad = _post(demo_server, "/v1/completions", prompt="Once", allowed_token_ids=[10**8])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_never_appear(demo_server):
    tok = demo_server.tokenizer
    greedy = dict(prompt="Once upon a time", max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True)
    free = _post(demo_server, "/v1/completions", **greedy).json()["choices"][0]["token_ids"]
    # a generated token that is a word of its own: its text encodes back to it alone
    word = next(tok.decode([t]).strip() for t in free if tok.encode(tok.decode([t]).strip(),
                                                                     add_special_tokens=False) == [t])
    [word_id] = tok.encode(word, add_special_tokens=False)
    banned = _post(demo_server, "/v1/completions", bad_words=[word], **greedy).json()["choices"][0]["token_ids"]
    assert word_id in free and word_id not in banned


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "x"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_bad_words_are_tokenized_while_the_server_answers_others(demo_server, monkeypatch, path, body):
    """A long bad_words list (100k words took 7 s to tokenize) must not stall /health or other clients' streams:
    while its tokenization is held, /health still answers."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    tok = demo_server.runtime.tokenizer
    entered, answered, real = threading.Event(), threading.Event(), tok.encode

    def held(text, **kw):
        if text.strip() == "zzheld":
            entered.set()
            answered.wait(10)
        return real(text, **kw)

    monkeypatch.setattr(tok, "encode", held)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(_post, demo_server, path, max_tokens=1, bad_words=["zzheld"], **body)
        assert entered.wait(10)
        try:
            assert httpx.get(demo_server.url + "/health", timeout=3).status_code == 200
        finally:
            answered.set()
        assert reply.result().status_code == 200


def test_settings_that_ban_every_token_are_a_client_error(demo_server):
    """allowed_token_ids whose one token is a stop token banned until min_tokens: no token may be sampled. The
    reply is a 400 naming the settings (a stream ends with an invalid_request_error event), never a token outside
    allowed_token_ids."""
    body = dict(prompt="Once", max_tokens=4, allowed_token_ids=[300], stop_token_ids=[300], min_tokens=2)
    r = _post(demo_server, "/v1/completions", **body)
    assert r.status_code == 400, r.text
    assert "allowed_token_ids, bad_words and min_tokens" in r.json()["error"]["message"]
    with httpx.stream("POST", demo_server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert '"invalid_request_error"' in events[-1] and "min_tokens" in events[-1]
    chat = _post(demo_server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
                 **{k: v for k, v in body.items() if k != "prompt"})
    assert chat.status_code == 400 and chat.json()["error"]["type"] == "invalid_request_error", chat.text


def test_a_grammar_that_allowed_token_ids_leave_nothing_to_is_a_client_error(demo_server):
    """json_object with allowed_token_ids that hold no token JSON can start with: a 400 naming both, not a 500."""
    body = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=5, allowed_token_ids=[5],
                response_format={"type": "json_object"}, chat_template_kwargs={"enable_thinking": False})
    r = _post(demo_server, "/v1/chat/completions", **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "structured-output constraint with allowed_token_ids" in err["message"]
    with httpx.stream("POST", demo_server.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert '"invalid_request_error"' in events[-1] and "allowed_token_ids" in events[-1]


def test_min_tokens_beyond_a_finished_grammar_is_a_client_error(demo_server):
    """guided_choice answers in a token or two; min_tokens 20 asks for more than the grammar lets the reply be: a
    400 naming min_tokens, never a short reply that ignores it."""
    body = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=40, min_tokens=20,
                guided_choice=["yes", "no"], chat_template_kwargs={"enable_thinking": False})
    r = _post(demo_server, "/v1/chat/completions", **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "min_tokens" in r.json()["error"]["message"]


def test_cache_salt_keeps_cached_prefixes_apart(demo_server):
    client = demo_server.openai()
    long = "Once upon a time there was a little robot who loved to read. " * 6

    def cached(salt: str) -> int:
        c = client.chat.completions.create(model="ember-demo", messages=[{"role": "user", "content": long}],
                                           max_tokens=1, extra_body={"cache_salt": salt})
        return c.usage.prompt_tokens_details.cached_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    empty = _post(demo_server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], cache_salt="")
    assert empty.status_code == 400 and "cache_salt" in str(empty.json()["error"]["param"])


def test_cache_salt_keeps_cached_prefixes_apart_on_the_responses_api(demo_server):
    """vLLM's Responses requests take cache_salt too: it was dropped there, and tenants shared cached blocks."""
    client = demo_server.openai()
    long = "A responses tenant reads the same long story about a cat, a dog and a bird. " * 6

    def cached(salt: str | None) -> int:
        r = client.responses.create(model="ember-demo", input=long, max_output_tokens=1,
                                    extra_body={"cache_salt": salt} if salt else None)
        return r.usage.input_tokens_details.cached_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0 and cached(None) == 0
    empty = _post(demo_server, "/v1/responses", input="hi", cache_salt="")
    assert empty.status_code == 400 and "cache_salt" in str(empty.json()["error"]["param"])


def test_truncate_prompt_tokens_keeps_the_last_tokens(demo_server):
    ids = list(range(300, 340))
    r = _post(demo_server, "/v1/completions", prompt=ids, max_tokens=1, truncate_prompt_tokens=5, echo=True,
              return_token_ids=True)
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 5 and body["choices"][0]["prompt_token_ids"] == ids[-5:]
    chat = _post(demo_server, "/v1/chat/completions", messages=[{"role": "user", "content": "Hello there"}],
                 max_tokens=1, truncate_prompt_tokens=3)
    assert chat.json()["usage"]["prompt_tokens"] == 3
    whole = _post(demo_server, "/v1/completions", prompt=ids, max_tokens=1, truncate_prompt_tokens=-1)
    assert whole.json()["usage"]["prompt_tokens"] == len(ids)
    for value in (0, 10**7):
        bad = _post(demo_server, "/v1/completions", prompt=ids, truncate_prompt_tokens=value)
        assert bad.status_code == 400 and "truncate_prompt_tokens" in str(bad.json()["error"]["param"])


def test_truncation_side_right_keeps_the_first_tokens(demo_server):
    """vLLM's `truncation_side`: "right" keeps the prompt's first N tokens (it was ignored: the last N were kept)."""
    ids = list(range(300, 340))
    for side, kept in (("right", ids[:5]), ("left", ids[-5:])):
        r = _post(demo_server, "/v1/completions", prompt=ids, max_tokens=1, truncate_prompt_tokens=5,
                  truncation_side=side, return_token_ids=True)
        assert r.json()["choices"][0]["prompt_token_ids"] == kept, r.text
    assert _post(demo_server, "/v1/completions", prompt=ids, truncation_side="middle").status_code == 400


def test_thinking_token_budget_is_vllms_name_for_the_thinking_budget(demo_server):
    """vLLM's `thinking_token_budget` was ignored: the thought ran to max_tokens."""
    hello = [{"role": "user", "content": "Hello there"}]
    kw = dict(messages=hello, max_tokens=12, seed=2, return_token_ids=True,
              chat_template_kwargs={"enable_thinking": True})
    close = demo_server.runtime.parser.delimiter_ids["</think>"]
    budgeted = _post(demo_server, "/v1/chat/completions", **kw, thinking_token_budget=3).json()
    assert budgeted["choices"][0]["token_ids"][3] == close, budgeted
    assert budgeted["choices"][0] == _post(demo_server, "/v1/chat/completions", **kw,
                                           max_thinking_tokens=3).json()["choices"][0]
    unlimited = _post(demo_server, "/v1/chat/completions", **kw, thinking_token_budget=-1).json()
    assert unlimited["choices"][0] == _post(demo_server, "/v1/chat/completions", **kw).json()["choices"][0]
    both = _post(demo_server, "/v1/chat/completions", **kw, thinking_token_budget=3, max_thinking_tokens=4)
    assert both.status_code == 400 and both.json()["error"]["param"] == "thinking_token_budget"


def test_seeds_are_int64_and_each_has_its_own_stream(demo_server):
    """A seed past int64 is a 400, as in vLLM (2**63 was folded onto seed 0); the int64 seeds stay apart, and
    choice 1 of seed 2**63 - 1 samples as seed -2**63 (int64's wrap), not as seed 0."""
    kw = dict(prompt="Once upon a time", max_tokens=8, temperature=1.0)

    def text(seed: int, n: int = 1) -> list[str]:
        r = _post(demo_server, "/v1/completions", **kw, seed=seed, n=n)
        assert r.status_code == 200, r.text
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    assert _post(demo_server, "/v1/completions", **kw, seed=2**63).json()["error"]["param"] == "seed"
    top = text(2**63 - 1, n=2)
    assert top[1] == text(-(2**63))[0] and top[1] != text(0)[0]
    assert text(-1) != text(2**63 - 1)


@pytest.mark.parametrize(("field", "value"), [("use_beam_search", True), ("priority", 3)])
def test_unserved_settings_are_refused_by_name(demo_server, field, value):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = _post(demo_server, path, **body, **{field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    ok = _post(demo_server, "/v1/completions", prompt="hi", max_tokens=1, use_beam_search=False, priority=0)
    assert ok.status_code == 200


def test_a_chat_template_per_request_is_refused_by_name(demo_server):
    """vLLM refuses a request's own chat_template unless told to trust it; ignoring it would render another
    prompt than the client asked for."""
    r = _post(demo_server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
              chat_template="{{ messages[0].content }}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text


def test_priority_is_served_under_the_priority_policy(demo_runtime):
    """With --scheduling-policy priority a request's priority reaches the engine's queue: one running slot, a
    low-priority request queued first and a high-priority one after it; the engine schedules the high one first.
    (The order is read from the engine's own first-scheduling times, not from when replies reach client threads.)"""
    import threading
    import time

    from ember.server.config import ServeConfig
    from tests.server.conftest import served

    config = ServeConfig(model_dir=demo_runtime[1].model_dir, served_model_name="prio", max_num_seqs=1,
                         kv_cache_blocks=64, in_process=True, scheduling_policy="priority")
    with served(config) as srv:
        engine = srv.runtime.engine
        stats, generate = engine.stats, engine.generate
        scheduled: dict[str, float] = {}
        done: list[str] = []

        async def observed(prompt_ids, params=None, request_id=None, constraint=None):
            async for out in generate(prompt_ids, params, request_id, constraint):
                if out.scheduled_at is not None:
                    scheduled.setdefault(request_id.split("-")[1], out.scheduled_at)
                yield out

        engine.generate = observed

        def ask(name: str, priority: int, max_tokens: int) -> None:
            r = _post(srv, "/v1/completions", prompt=name, max_tokens=max_tokens, ignore_eos=True, priority=priority,
                      request_id=name)
            assert r.status_code == 200, r.text
            done.append(name)

        def until(condition) -> None:
            while not condition():
                time.sleep(0.002)

        threads = [threading.Thread(target=ask, args=("first", 0, 400))]
        threads[0].start()
        until(lambda: stats().num_running == 1)
        for name, priority, waiting in (("low", 9, 1), ("high", -3, 2)):
            threads.append(threading.Thread(target=ask, args=(name, priority, 4)))
            threads[-1].start()
            until(lambda: stats().num_waiting == waiting or done)
        assert not done, "the first request ended before both others queued behind it"
        for t in threads:
            t.join(timeout=60)
        assert sorted(done) == ["first", "high", "low"]
        assert sorted(scheduled, key=scheduled.__getitem__) == ["first", "high", "low"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stop_token_ends_the_reply_without_its_text(demo_server, path):
    """stop_token_ids end the reply like EOS: the stop token's text is left out (kept with
    include_stop_str_in_output), as vLLM does."""
    body = dict(max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True)
    body |= {"prompt": "Once upon"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}}

    def text(r: httpx.Response) -> str:
        choice = r.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]

    free = _post(demo_server, path, **body).json()["choices"][0]["token_ids"]
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # a token that first appears at k
    tok = httpx.post(demo_server.url + "/detokenize", json={"tokens": [free[k]]}, timeout=30).json()["prompt"]
    before = httpx.post(demo_server.url + "/detokenize", json={"tokens": free[:k]}, timeout=30).json()["prompt"]
    stopped = _post(demo_server, path, **body, stop_token_ids=[free[k]])
    assert stopped.json()["choices"][0]["finish_reason"] == "stop" and text(stopped) == before
    kept = _post(demo_server, path, **body, stop_token_ids=[free[k]], include_stop_str_in_output=True)
    assert text(kept) == before + tok


def test_a_stop_string_in_the_first_min_tokens_does_not_end_the_reply(demo_server):
    """vLLM's rule: stop strings count only past ``min_tokens``; one in the first tokens is text, a later one stops."""
    greedy = dict(prompt="Once upon a time", temperature=0, ignore_eos=True)
    full = _post(demo_server, "/v1/completions", max_tokens=16, **greedy).json()["choices"][0]["text"]
    head = _post(demo_server, "/v1/completions", max_tokens=4, **greedy).json()["choices"][0]["text"]
    stop = next(c for c in head if c.strip())
    early = _post(demo_server, "/v1/completions", max_tokens=16, stop=[stop], **greedy).json()["choices"][0]
    late = _post(demo_server, "/v1/completions", max_tokens=16, stop=[stop], min_tokens=4, **greedy).json()
    cut = full.find(stop, len(head) - len(stop) + 1)
    assert early["text"] == full[:full.index(stop)] and len(early["text"]) < len(head)
    assert late["choices"][0]["text"] == (full[:cut] if cut >= 0 else full)
    assert late["choices"][0]["finish_reason"] == ("stop" if cut >= 0 else "length")
