"""The Anthropic Messages endpoints, driven through the real `anthropic` SDK (its stream accumulator included)."""
from __future__ import annotations

import json
import re
from typing import Literal

import anthropic
import httpx
import pytest

HI = [{"role": "user", "content": "Say hello."}]
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                      "hourly": {"type": "boolean"}},
                     "required": ["unit", "hourly"], "additionalProperties": False},
}


def _prompt_tokens(usage) -> int:
    """The whole prompt of a reply: Anthropic counts cache reads apart from `input_tokens`."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def _raw_events(server, body):
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: ")
        data = json.loads(lines[1][6:])
        assert data["type"] == lines[0][7:]
        events.append(data)
    return events


def test_message_and_stream_agree_greedy(any_server):
    client = any_server.anthropic()
    kw = dict(model=any_server.model, max_tokens=12, messages=HI, extra_body={"temperature": 0})
    msg = client.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens <= 12
    count = client.messages.count_tokens(model=any_server.model, messages=HI)
    assert count.input_tokens == _prompt_tokens(msg.usage)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == msg.usage.output_tokens


def test_stream_event_order(demo_server):
    events = _raw_events(demo_server, {"model": demo_server.model, "max_tokens": 8, "messages": HI, "stream": True,
                                       "thinking": {"type": "enabled", "budget_tokens": 3}, "seed": 7})
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["output_tokens"] == 0 and events[0]["message"]["content"] == []
    # blocks open and close in order, each delta inside its open block
    open_index = None
    kinds = []
    for e in events[2:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None
            open_index = e["index"]
            kinds.append(e["content_block"]["type"])
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index
            open_index = None
    assert open_index is None
    assert kinds == ["thinking", "text"]
    sig = [e for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "signature_delta"]
    assert len(sig) == 1 and sig[0]["index"] == 0
    assert events[-2]["usage"]["output_tokens"] == 8 and events[-2]["delta"]["stop_reason"] == "max_tokens"


@pytest.mark.parametrize("which", ["demo_server", "qwen3_thinking_server"])
def test_thinking_blocks_with_budget(request, which):
    demo_server = request.getfixturevalue(which)
    client = demo_server.anthropic()
    kw = dict(model=demo_server.model, max_tokens=10, messages=HI, extra_body={"temperature": 1.0, "seed": 3},
              thinking={"type": "enabled", "budget_tokens": 4})
    msg = client.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking and msg.content[0].signature
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == msg.content[0].thinking
    assert final.content[0].signature == msg.content[0].signature
    assert final.content[1].text == msg.content[1].text
    # the thought goes back into the prompt as the assistant's reasoning
    follow = client.messages.create(model=demo_server.model, max_tokens=2, messages=[
        *HI, {"role": "assistant", "content": [c.model_dump() for c in msg.content]},
        {"role": "user", "content": "Again."}])
    assert _prompt_tokens(follow.usage) > _prompt_tokens(msg.usage)


def test_thinking_display_omitted_keeps_only_the_signature(demo_server):
    """`thinking.display: "omitted"` returns thinking blocks with empty text and the signature the shown thought
    gets, streamed and not; the rest of the reply is unchanged."""
    client = demo_server.anthropic()
    kw = dict(model=demo_server.model, max_tokens=6, messages=HI, extra_body={"temperature": 1.0, "seed": 3})
    shown = client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 3})
    omitted_kw = dict(kw, thinking={"type": "enabled", "budget_tokens": 3, "display": "omitted"})
    omitted = client.messages.create(**omitted_kw)
    assert shown.content[0].type == "thinking" and shown.content[0].thinking
    assert omitted.content[0].model_dump() == {**shown.content[0].model_dump(), "thinking": ""}
    assert omitted.content[1:] == shown.content[1:]
    with client.messages.stream(**omitted_kw) as stream:
        final = stream.get_final_message()
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in omitted.content]


def test_forced_tool_use(any_server):
    client = any_server.anthropic()
    kw = dict(model=any_server.model, max_tokens=40, extra_body={"temperature": 0}, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    msg = client.messages.create(**kw)
    tool = next(b for b in msg.content if b.type == "tool_use")
    assert tool.name == "get_weather" and tool.id.startswith("call_")
    assert tool.input["unit"] in ("celsius", "fahrenheit") and isinstance(tool.input["hourly"], bool)
    # random weights may pad after the call until max_tokens; with EOS it is tool_use
    assert msg.stop_reason in ("tool_use", "max_tokens")
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == [
        (b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in msg.content]
    # the call and its result go back into the conversation
    follow = client.messages.create(model=any_server.model, max_tokens=2, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in msg.content if b.type == "tool_use"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "18C"},
                                     {"type": "text", "text": "And tomorrow?"}]}])
    assert _prompt_tokens(follow.usage) > _prompt_tokens(msg.usage)


def test_a_forced_call_cut_by_max_tokens_is_never_text(demo_server):
    """However early max_tokens cuts a forced call, the message holds no text block of call syntax: before the name is
    complete it holds nothing, after it a tool_use with the arguments so far; stream and body agree."""
    client = demo_server.anthropic()
    for k in range(1, 9):
        kw = dict(model=demo_server.model, max_tokens=k, extra_body={"temperature": 0}, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"}, messages=HI)
        msg = client.messages.create(**kw)
        assert msg.stop_reason == "max_tokens"
        assert [b.type for b in msg.content] in ([], ["tool_use"]), (k, msg.content)
        with client.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert [(b.type, b.name) for b in final.content] == [(b.type, b.name) for b in msg.content], k


def test_stop_sequence(demo_server):
    client = demo_server.anthropic()
    base = client.messages.create(model=demo_server.model, max_tokens=20, messages=HI, extra_body={"temperature": 0})
    text = base.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    msg = client.messages.create(model=demo_server.model, max_tokens=20, messages=HI, extra_body={"temperature": 0},
                                 stop_sequences=[stop, "\u2603never"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]


def test_errors_are_typed(demo_server, keyed_server):
    client = demo_server.anthropic()
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=demo_server.model, max_tokens=0, messages=HI)
    assert "max_tokens" in e.value.message
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=demo_server.model, max_tokens=5, messages=[])
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=5, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        keyed_server.anthropic(api_key="wrong").messages.create(model=demo_server.model, max_tokens=1, messages=HI)
    ok = keyed_server.anthropic(api_key="sekrit").messages.create(model=demo_server.model, max_tokens=1,
                                                                  messages=HI)
    assert ok.usage.output_tokens == 1
    r = httpx.post(demo_server.url + "/v1/messages", content=b"[1, 2", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_every_anthropic_response_has_a_request_id_and_errors_carry_it(demo_server):
    """Anthropic gives every response a `request-id` header and every error body a `request_id`; the SDK exposes
    them as `_request_id` and `APIStatusError.request_id`. OpenAI routes get no such header."""
    client = demo_server.anthropic()
    raw = client.messages.with_raw_response.create(model=demo_server.model, max_tokens=2, messages=HI)
    first = raw.parse()._request_id
    assert re.fullmatch(r"req_[0-9a-f]{32}", first or "")
    assert client.messages.create(model=demo_server.model, max_tokens=2, messages=HI)._request_id != first
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=5, messages=HI)
    assert e.value.request_id == e.value.body["request_id"] and e.value.request_id.startswith("req_")
    with client.messages.stream(model=demo_server.model, max_tokens=2, messages=HI) as stream:
        assert stream.response.headers["request-id"].startswith("req_")
    assert client.models.list()._request_id.startswith("req_")
    assert "request-id" not in httpx.get(demo_server.url + "/v1/models", timeout=30).headers


def test_models_list_and_retrieve_in_anthropic_shape(demo_server):
    client = demo_server.anthropic()
    page = client.models.list()
    assert [m.id for m in page.data] == [demo_server.model]
    one = client.models.retrieve(demo_server.model)
    assert (one.id, one.type, one.display_name) == (demo_server.model, "model", demo_server.model)
    assert one.created_at == page.data[0].created_at
    with pytest.raises(anthropic.NotFoundError) as missing:  # Anthropic's error shape, as the SDK asked
        client.models.retrieve("no-such-model")
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="limit"):
        client.models.list(limit=0)
    superscript = httpx.get(demo_server.url + "/v1/models", params={"limit": "\u00b2"}, timeout=30,
                            headers={"anthropic-version": "2023-06-01"})
    assert superscript.status_code == 400 and superscript.json()["error"]["type"] == "invalid_request_error"
    assert client.models.list(limit=1, after_id=demo_server.model).data == []


def test_the_anthropic_model_list_pages_by_limit_and_ids():
    from ember.server.app import _anthropic_page

    names = ["m", "a1", "a2", "a3"]
    assert _anthropic_page(names, {"limit": "2"}) == (["m", "a1"], True)
    assert _anthropic_page(names, {"limit": "2", "after_id": "a1"}) == (["a2", "a3"], False)
    assert _anthropic_page(names, {"limit": "2", "before_id": "a3"}) == (["a1", "a2"], True)
    assert _anthropic_page(names, {"before_id": "a1"}) == (["m"], False)


def test_a_non_finite_number_is_named_as_such(demo_server):
    r = httpx.post(demo_server.url + "/v1/messages", timeout=30, headers={"content-type": "application/json"},
                   content='{"model": "%s", "max_tokens": 4, "temperature": NaN, "messages": [{"role": "user", '
                           '"content": "hi"}]}' % demo_server.model)
    assert r.status_code == 400 and "'temperature'" in r.json()["error"]["message"]
    assert "finite" in r.json()["error"]["message"], r.text


def test_a_message_that_fails_mid_stream_ends_with_the_error_event_only(demo_server):
    """A pattern whose lexer gives up only after its forced 40-character prefix fails mid-generation: the stream ends
    with an `error` event and no message_delta / message_stop before it, so the SDK raises instead of yielding an
    empty end_turn message; the non-streaming reply is a 400 (the request's schema failed it)."""
    body = {"model": demo_server.model, "max_tokens": 60, "messages": HI,
            "output_config": {"format": {"type": "json_schema", "schema": {
                "type": "string", "pattern": "^x{40}[ ]{0,8}b{100002}$"}}}}
    with httpx.stream("POST", demo_server.url + "/v1/messages", json={**body, "stream": True}, timeout=60) as s:
        kinds = [line.removeprefix("event: ") for line in s.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and "content_block_delta" in kinds and kinds[-1] == "error", kinds
    assert "message_delta" not in kinds and "message_stop" not in kinds
    with pytest.raises(anthropic.APIStatusError):
        with demo_server.anthropic().messages.stream(**body) as stream:
            for _ in stream:
                pass
    r = httpx.post(demo_server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


@pytest.mark.parametrize("extra,names", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, ["messages[0].content[0].text"]),
    ({"messages": [{"role": "user", "content": [{"type": "txt", "text": "hi"}]}]}, ["messages[0].content[0]", "'txt'"]),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "source": {}}]}]},
     ["messages[0].content[1].type", "'image'"]),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     ["messages[0].content[0].type", "'tool_use' is not allowed in a user message"]),  # on any model
    ({"tools": [{**WEATHER, "name": "bad name"}], "tool_choice": {"type": "any"}}, ["tools[0].name"]),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
     ["output_config.format.schema"]),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, ["server tool type 'web_search_20250305'"]),
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example/sse", "name": "x"}]}, ["mcp_servers", "MCP"]),
    ({"tools": [{"name": "f"}]}, ["tools[0].input_schema"]),
    ({"tools": [{**WEATHER, "strict": True, "input_schema": {"type": "object", "properties": {"a": {
        "type": "array", "uniqueItems": True}}}}]}, ["tools[0].input_schema", "uniqueItems"]),  # strict is read
    ({"tools": [{"name": "f", "input_schema": {}}]}, ["tools[0].input_schema.type"]),
    ({"tools": [WEATHER, {"name": "f", "input_schema": {"type": "string"}}], "tool_choice": {"type": "any"}},
     ["tools[1].input_schema.type", "'object'"]),
    ({"thinking": {"type": "enabled", "budget_tokens": True}}, ["thinking.budget_tokens"]),
    ({"thinking": {"type": "enabled", "budget_tokens": "3"}}, ["thinking.budget_tokens"]),
    ({"thinking": {"type": "enabled", "budget_tokens": 3, "display": "hidden"}}, ["thinking.display"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     ["tool_choice.disable_parallel_tool_use"]),
    ({"seed": "7"}, ["'seed'"]),
    ({"metadata": {"user_id": 123}}, ["metadata.user_id", "string"]),
    ({"service_tier": "bogus"}, ["service_tier", "'auto'"]),
    ({"messages": [*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                       {"type": "browser_state"}]}]}]}, ["messages[2].content[0].content[0].type", "'browser_state'"]),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}]},
     ["messages[0].content[0].is_error"]),
    ({"messages": [{"role": "user", "content": ""}]}, ["messages[0].content", "non-empty"]),
    ({"messages": [*HI, {"role": "assistant", "content": []}, *HI]}, ["messages[1].content", "non-empty"]),
    ({"max_tokens": "3"}, ["'max_tokens'", "integer"]),
    ({"max_tokens": True}, ["'max_tokens'"]),
    ({"stream": "yes"}, ["'stream'", "boolean"]),
    ({"messages": [*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                          "input": {}}]}]}, ["messages[1].content", "tool_result"]),
])
def test_bad_requests_name_the_anthropic_field(demo_server, extra, names):
    """Anthropic errors carry no `param`: the message itself names the field, in the Messages API's own terms."""
    body = {"model": demo_server.model, "max_tokens": 4, "messages": HI, **extra}
    r = httpx.post(demo_server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    message = r.json()["error"]["message"]
    assert all(n in message for n in names), message
    assert "function." not in message and "response_format" not in message


def test_an_empty_system_or_final_assistant_message_is_as_absent(demo_server):
    """An empty system (``""``, ``[]``, empty text blocks) renders no system turn, so the template's default system
    prompt stays; a final assistant message may be empty (the only message that may)."""
    def count(**extra) -> int:
        r = httpx.post(demo_server.url + "/v1/messages/count_tokens", json={"model": demo_server.model, **extra},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    plain = count(messages=HI)
    assert [count(messages=HI, system=s) for s in ("", [], [{"type": "text", "text": ""}])] == [plain] * 3
    assert count(messages=HI, system="Be brief.") > plain
    assert count(messages=[*HI, {"role": "assistant", "content": ""}]) > 0


def test_an_empty_final_assistant_message_leaves_thinking_on(qwen3_thinking_server):
    """A final assistant message of nothing (``""``, ``[]``, an empty text block) is no prefill: the prompt is the
    one without it, so the model still thinks (Qwen3's template rendered it as a finished turn, a closed empty
    thought, which turned thinking off and counted 4 tokens more)."""
    srv = qwen3_thinking_server
    thinking = {"type": "enabled", "budget_tokens": 4}

    def count(messages) -> int:
        r = httpx.post(srv.url + "/v1/messages/count_tokens", timeout=60,
                       json={"model": srv.model, "messages": messages, "thinking": thinking})
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    empties = ("", [], [{"type": "text", "text": ""}])
    assert [count([*HI, {"role": "assistant", "content": e}]) for e in empties] == [count(HI)] * 3
    msg = srv.anthropic().messages.create(model=srv.model, max_tokens=10, thinking=thinking,
                                          messages=[*HI, {"role": "assistant", "content": ""}],
                                          extra_body={"temperature": 1.0, "seed": 3})
    assert msg.content[0].type == "thinking", msg.content


@pytest.mark.parametrize("tools,choice", [
    ([{**WEATHER, "name": "bad name"}], None), ([WEATHER, WEATHER], None), ([{"name": "f", "input_schema": {}}], None),
    ([{"name": "f", "strict": True, "input_schema": {"type": "object", "properties": {"a": {"type": "string",
                                                                                       "pattern": "(?<=a)b"}}}}],
     {"type": "any"})], ids=["name", "repeated", "schema-type", "forced-schema"])
def test_count_tokens_refuses_the_tools_messages_refuses(demo_server, tools, choice):
    """A client that counts a prompt before sending it learns of a bad tool list from either endpoint, in the same
    words (a forced call's schema that the grammar cannot compile too)."""
    body = {"model": demo_server.model, "messages": HI, "tools": tools} | ({"tool_choice": choice} if choice else {})
    answers = [httpx.post(demo_server.url + path, json=extra | body, timeout=60)
               for path, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {}))]
    assert [r.status_code for r in answers] == [400, 400], [r.text for r in answers]
    messages = [r.json()["error"]["message"] for r in answers]
    assert messages[0] == messages[1] and "tools[" in messages[0] and "function." not in messages[0]


def test_the_sdk_tool_runner_falls_back_from_threads_to_the_whole_conversation(demo_server):
    """The SDK's tool runner asks for a server-kept thread (`thread`); Ember keeps none and says so with Anthropic's
    `thread_unsupported_request`, so the runner resends the whole conversation: its second turn has the history
    (before, `thread` was ignored and that turn lost it)."""
    sent: list[dict] = []
    import httpx2  # the anthropic SDK's own HTTP client

    http = httpx2.Client(event_hooks={"request": [
        lambda r: sent.append(json.loads(r.content)) if r.url.path.endswith("/messages") else None]})
    client = anthropic.Anthropic(base_url=demo_server.url, api_key="x", max_retries=0, http_client=http)

    @anthropic.beta_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone (an enum, so the forced call always closes within max_tokens)."""
        return "12:00"

    runner = client.beta.messages.tool_runner(
        model=demo_server.model, max_tokens=40, tools=[get_time], messages=[{"role": "user", "content": "time?"}],
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}, max_iterations=2)
    replies = list(runner)
    assert len(replies) == 2 and replies[0].stop_reason == "tool_use", replies
    unthreaded = [b for b in sent if "thread" not in b]
    assert [len(b["messages"]) for b in unthreaded] == [1, 3]  # the question; then it, the call and its result
    r = httpx.post(demo_server.url + "/v1/messages", timeout=30, json={
        "model": demo_server.model, "max_tokens": 4, "thread": {"type": "create"}, "messages": HI})
    assert r.status_code == 400 and r.json()["error"]["details"]["error_code"] == "thread_unsupported_request"


def test_a_reply_that_fills_the_context_window_says_so(demo_server):
    """Anthropic's ``model_context_window_exceeded``: a max_tokens larger than the room the prompt leaves is cut to
    it, and a reply that reaches it stopped for the window (it said max_tokens, which the client had not reached);
    a reply that reaches a max_tokens within the room is max_tokens."""
    n = demo_server.runtime.max_model_len

    def count(k: int) -> int:
        return httpx.post(demo_server.url + "/v1/messages/count_tokens", timeout=60, json={
            "model": demo_server.model, "messages": [{"role": "user", "content": "hi " * k}]}).json()["input_tokens"]

    per = (count(200) - count(100)) / 100  # tokens per "hi "
    k = int((n - 5 - count(100)) / per) + 100
    assert n - 8 <= count(k) <= n - 3  # a few tokens of room, more than the 2 below
    body = {"model": demo_server.model, "temperature": 0, "messages": [{"role": "user", "content": "hi " * k}]}
    for max_tokens, want in ((100, "model_context_window_exceeded"), (2, "max_tokens")):
        r = httpx.post(demo_server.url + "/v1/messages", timeout=60, json={**body, "max_tokens": max_tokens}).json()
        assert r["stop_reason"] == want, r
        with demo_server.anthropic().messages.stream(model=body["model"], messages=body["messages"],
                                                     max_tokens=max_tokens, extra_body={"temperature": 0}) as stream:
            assert stream.get_final_message().stop_reason == want


def test_a_prompt_too_long_is_worded_as_anthropic_words_it(demo_server):
    """Claude Code compacts its conversation when it reads Anthropic's wording of this 400."""
    n = demo_server.runtime.max_model_len
    r = httpx.post(demo_server.url + "/v1/messages", timeout=60, json={
        "model": demo_server.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi " * n}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt is too long: "), r.text
    assert r.json()["error"]["message"].endswith(f" tokens > {n - 1} maximum")
    # text too long to tokenize: the same form, two integers, the same maximum; the tokens are a lower bound that
    # grows with the text (it was max_model_len + 1 for any size: a client trimming by it trimmed too little)
    limit = demo_server.runtime.max_prompt_chars
    said = []
    for size in (limit + 1, 4 * limit):
        r = httpx.post(demo_server.url + "/v1/messages", timeout=60, json={
            "model": demo_server.model, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * size}]})
        m = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", r.json()["error"]["message"])
        assert r.status_code == 400 and m and int(m[2]) == n - 1, r.text
        said.append(int(m[1]))
    assert n < said[0] and 4 * n <= said[1]
    # counting is what count_tokens is for: a conversation longer than the context is counted, not refused
    counted = httpx.post(demo_server.url + "/v1/messages/count_tokens", timeout=60, json={
        "model": demo_server.model, "messages": [{"role": "user", "content": "x" * (limit + 1)}]})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > n, counted.text


def test_the_beta_output_format_spelling_constrains_the_answer_as_output_config_does(demo_server):
    """The SDKs still send the structured-outputs beta's `output_format` (before, it was ignored and the answer was
    free text); given beside a different `output_config.format` it is a 400 naming it."""
    fmt = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"enum": ["yes", "no"]}},
                                             "required": ["a"], "additionalProperties": False}}
    body = {"model": demo_server.model, "max_tokens": 30, "messages": HI, "output_format": fmt}
    for extra in ({}, {"output_config": {"format": fmt, "effort": "low"}}):
        r = httpx.post(demo_server.url + "/v1/messages", timeout=60, json={**body, **extra})
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["content"][0]["text"])["a"] in ("yes", "no")
    other = {"type": "json_schema", "schema": {"type": "object"}}
    r = httpx.post(demo_server.url + "/v1/messages", timeout=60, json={**body, "output_config": {"format": other}})
    assert r.status_code == 400 and "output_format" in r.json()["error"]["message"], r.text


def test_tool_names_up_to_anthropics_128_characters_are_served(demo_server):
    """Claude Code names MCP tools `mcp__<server>__<tool>`, often past OpenAI's 64 characters (before, every request
    holding one was a 400); Anthropic's limit, 128, still holds."""
    name = "mcp__claude_ai_Atlassian_Rovo__getConfluencePageDescendantsWithAncestors"
    body = {"model": demo_server.model, "messages": HI, "tools": [{**WEATHER, "name": name}],
            "tool_choice": {"type": "tool", "name": name}}
    r = httpx.post(demo_server.url + "/v1/messages", timeout=60, json={**body, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert httpx.post(demo_server.url + "/v1/messages/count_tokens", timeout=60, json=body).status_code == 200
    body["tools"][0]["name"] = body["tool_choice"]["name"] = "x" * 129
    r = httpx.post(demo_server.url + "/v1/messages", timeout=60, json={**body, "max_tokens": 2})
    assert r.status_code == 400 and "tools[0].name" in r.json()["error"]["message"], r.text


def test_a_path_no_route_serves_answers_an_anthropic_client_in_its_shape(demo_server):
    """A base URL ending in /v1 (a common slip) sends the SDK to /v1/v1/messages: its 404 is Anthropic's, while a
    request without the header, or a served route's own 404, keeps the OpenAI shape."""
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic.Anthropic(base_url=demo_server.url + "/v1", api_key="x", max_retries=0).messages.create(
            model=demo_server.model, max_tokens=1, messages=HI)
    assert e.value.body == {"type": "error", "error": {"type": "not_found_error", "message": "Not Found"},
                            "request_id": e.value.request_id}
    plain = httpx.post(demo_server.url + "/v1/v1/messages", json={}, timeout=10)
    assert plain.status_code == 404 and plain.json()["error"]["type"] == "invalid_request_error"
    served = httpx.post(demo_server.url + "/v1/chat/completions", timeout=10, headers={"anthropic-version": "x"},
                        json={"model": "nope", "messages": HI})
    assert served.status_code == 404 and "param" in served.json()["error"], served.text
