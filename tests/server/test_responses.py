"""`/v1/responses` through the real `openai` SDK (its `responses.stream` state machine checks every event's item and
part indices) against the live demo server, cross-checked against `/v1/chat/completions` on the same prompts."""
from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from tests.server.test_concurrency import _cancelled

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                           "hourly": {"type": "boolean"}},
                          "required": ["unit", "hourly"], "additionalProperties": False},
           "strict": True}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def _stream(client, **kw):
    """Every event of a streamed response, passed through the SDK's own accumulator."""
    with client.responses.stream(**kw) as s:
        return list(s)


def _check_stream(events, final_status: str):
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    end = {"completed": "response.completed", "incomplete": "response.incomplete"}[final_status]
    assert events[-1].type == end and events[-1].response.status == final_status
    return events[-1].response


def _items(response):
    """Output items without what differs from run to run (IDs) or what the SDK's stream helper adds."""
    return [(o.type, o.model_dump(exclude={"id", "call_id", "parsed_arguments"})) for o in response.output]


def test_text_reply_equals_chat_and_its_stream(demo_server):
    client = demo_server.openai()
    r = client.responses.create(model=demo_server.model, instructions="You are terse.", input="Say hello.",
                                max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(
        model=demo_server.model, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == demo_server.model
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == ("max_output_tokens" if cut else None)
    assert [o.type for o in r.output] == ["message"] and r.output[0].status == r.status
    events = _stream(client, model=demo_server.model, instructions="You are terse.", input="Say hello.",
                     max_output_tokens=12, temperature=0)
    final = _check_stream(events, r.status)
    assert _items(final) == _items(r)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [d.item.id for d in done] == [o.id for o in final.output]


def test_reasoning_is_its_own_item(demo_server):
    client = demo_server.openai()
    kw = dict(model=demo_server.model, max_output_tokens=10,
              extra_body={"seed": 5, "chat_template_kwargs": {"enable_thinking": True}})
    r = client.responses.create(input="Say hello.", **kw)
    chat = client.chat.completions.create(model=demo_server.model, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=10, extra_body=kw["extra_body"])
    reasoning = chat.choices[0].message.model_extra["reasoning_content"]
    assert r.output[0].type == "reasoning" and r.output[0].content[0].type == "reasoning_text"
    assert r.output[0].content[0].text == reasoning and reasoning
    assert r.output_text == (chat.choices[0].message.content or "")
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    if len(r.output) == 1:  # the whole reply was thought
        assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens
    events = _stream(client, input="Say hello.", **kw)
    final = _check_stream(events, r.status)
    assert _items(final) == _items(r)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning


def test_thinking_budget_closes_the_reasoning_item(demo_server):
    r = demo_server.openai().responses.create(
        model=demo_server.model, input="Say hello.", max_output_tokens=10,
        extra_body={"seed": 2, "max_thinking_tokens": 3, "chat_template_kwargs": {"enable_thinking": True}})
    assert [o.type for o in r.output][:2] == ["reasoning", "message"]
    assert r.usage.output_tokens_details.reasoning_tokens == 3


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_function_call_streams_to_the_same_item(any_server, choice):
    server = any_server
    client = server.openai()
    tool_choice = {"type": "function", "name": "get_weather"} if choice == "named" else "required"
    kw = dict(model=server.model, input="Weather in Paris?", tools=[WEATHER], tool_choice=tool_choice,
              parallel_tool_calls=False, max_output_tokens=60, extra_body={"seed": 9, **NO_THINK})
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    args = json.loads(calls[0].arguments)
    assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["hourly"], bool)
    assert r.status == "completed" and r.tool_choice is not None and r.tools[0].name == "get_weather"
    events = _stream(client, **kw)
    final = _check_stream(events, "completed")
    assert _items(final) == _items(r)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == calls[0].arguments
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == calls[0].arguments


def test_previous_response_id_continues_with_a_function_result(any_server):
    """The follow-up's prompt is exactly the chat prompt of [user, assistant(tool call), tool result], on the demo
    template and on the real Qwen3 one."""
    server = any_server
    client = server.openai()
    first = client.responses.create(model=server.model, input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                    extra_body={"seed": 3, **NO_THINK})
    [call] = [o for o in first.output if o.type == "function_call"]
    follow = client.responses.create(
        model=server.model, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=3,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}], extra_body=NO_THINK)
    chat = client.chat.completions.create(
        model=server.model, tools=[CHAT_WEATHER], max_tokens=1, extra_body=NO_THINK, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": first.output_text or None, "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18C"}])
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    # the same conversation sent whole, as input items, renders the same prompt
    whole = client.responses.create(model=server.model, tools=[WEATHER], max_output_tokens=1,
                                    extra_body=NO_THINK, input=[
                                        {"role": "user",
                                         "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                                        *[o.model_dump(exclude_none=True) for o in first.output],
                                        {"type": "function_call_output", "call_id": call.call_id, "output": "18C"}])
    assert whole.usage.input_tokens == chat.usage.prompt_tokens


def test_reasoning_and_calls_render_as_one_assistant_turn(demo_server):
    """A reasoning item, an assistant message and its function call are one assistant turn (reasoning_content,
    content, tool_calls), as chat would send it; `developer` is `system`."""
    client = demo_server.openai()
    args = '{"unit": "celsius", "hourly": false}'
    r = client.responses.create(model=demo_server.model, max_output_tokens=1, tools=[WEATHER], input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"}])
    chat = client.chat.completions.create(model=demo_server.model, max_tokens=1, tools=[CHAT_WEATHER], messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    turn = httpx.post(demo_server.url + "/tokenize", timeout=30, json={"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]}).json()["tokens"]
    text = demo_server.tokenizer.decode(turn)
    assert "Call." in text  # the template renders this turn's reasoning, so the count above covers it


def test_store_retrieve_delete(demo_server):
    client = demo_server.openai()
    r = client.responses.create(model=demo_server.model, input="Say hello.", max_output_tokens=4, temperature=0,
                                metadata={"k": "v"}, text={"verbosity": "low"}, prompt_cache_key="pck")
    assert r.store is True and r.metadata == {"k": "v"}
    assert r.tool_choice == "auto"  # the default, as OpenAI echoes it, though there are no tools
    assert r.text.verbosity == "low" and r.text.format.type == "text" and r.prompt_cache_key == "pck"
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    follow = client.responses.create(model=demo_server.model, previous_response_id=r.id, input="More.",
                                     max_output_tokens=2)
    chat = client.chat.completions.create(model=demo_server.model, max_tokens=1, messages=[
        {"role": "user", "content": "Say hello."}, {"role": "assistant", "content": r.output_text},
        {"role": "user", "content": "More."}])
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=demo_server.model, previous_response_id=r.id, input="x")
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=demo_server.model, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_streamed_responses_are_stored(demo_server):
    client = demo_server.openai()
    events = list(client.responses.create(model=demo_server.model, input="Hi", max_output_tokens=3, stream=True))
    final = events[-1].response
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_json_schema_text_format(demo_server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = demo_server.openai().responses.create(
        model=demo_server.model, input="Answer.", max_output_tokens=30, extra_body={"seed": 1, **NO_THINK},
        text={"format": {"type": "json_schema", "name": "r", "schema": schema, "strict": True}})
    assert isinstance(json.loads(r.output_text)["ok"], bool)
    assert r.text.format.type == "json_schema"


def test_logprobs_match_chat_and_stream(demo_server):
    client = demo_server.openai()
    kw = dict(model=demo_server.model, input="Say hello.", max_output_tokens=6, temperature=0,
              include=["message.output_text.logprobs"], top_logprobs=2)
    r = client.responses.create(**kw)
    chat = client.chat.completions.create(model=demo_server.model, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    got = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(x.token, x.bytes) for x in got] == [(x.token, x.bytes) for x in want] and len(got) == 6
    assert all(abs(a.logprob - b.logprob) < 1e-4 and len(a.top_logprobs) == 2 for a, b in zip(got, want))
    events = _stream(client, **kw)
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [x.token for x in got]


def test_cut_call_is_incomplete_and_still_replays(demo_server):
    """max_output_tokens inside a call: the item and the response are incomplete; the stored conversation still
    continues (its cut arguments are replayed as text, not refused)."""
    client = demo_server.openai()
    r = client.responses.create(model=demo_server.model, input="Weather?", tools=[WEATHER], tool_choice="required",
                                max_output_tokens=16, extra_body=NO_THINK)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [call] = r.output
    assert call.type == "function_call" and call.status == "incomplete"
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.arguments)
    follow = client.responses.create(model=demo_server.model, previous_response_id=r.id, input="Go on.",
                                     max_output_tokens=1)
    assert follow.status in ("completed", "incomplete")


def test_a_thought_closed_before_the_cut_is_complete(qwen3_thinking_server):
    """max_output_tokens falls after `</think>` but before the tool call has its name: the reasoning item ended
    normally, so only the response is incomplete (streamed, its `output_item.done` says the same)."""
    server = qwen3_thinking_server
    kw = dict(model=server.model, input="hi", tools=[WEATHER], tool_choice="required", temperature=0,
              max_output_tokens=7, extra_body={"max_thinking_tokens": 1})
    r = server.openai().responses.create(**kw)
    assert r.status == "incomplete" and [(o.type, o.status) for o in r.output] == [("reasoning", "completed")]
    events = _stream(server.openai(), **kw)
    final = _check_stream(events, "incomplete")
    assert _items(final) == _items(r)
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["completed"]


@pytest.mark.parametrize("extra,param", [
    ({"background": True, "store": False}, "store"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "message", "role": ["user"], "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": {"a": 1}, "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": {"a": 1}, "role": "user", "content": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": {"x": 1}, "text": "r"}]}]},
     "input[0].output[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),  # a built-in tool's
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},  # chat's form
     "tool_choice.name"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"verbosity": "loud"}}, "text.verbosity"),
])
def test_bad_requests_name_the_field(demo_server, extra, param):
    body = {"model": demo_server.model, "input": "Hi", "max_output_tokens": 2, **extra}
    r = httpx.post(demo_server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert "function." not in err["message"]  # Responses tools are flat: no chat-style field names


def test_unknown_model_is_404(demo_server):
    with pytest.raises(openai.NotFoundError):
        demo_server.openai().responses.create(model="nope", input="Hi")


def test_the_store_keeps_the_most_recently_used():
    from ember.server.response_store import ResponseStore, StoredResponse

    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, []))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    off = ResponseStore(0)
    off.put("a", StoredResponse({"id": "a"}, []))
    assert off.get("a") is None


def test_a_function_result_after_previous_response_id_keeps_its_call_name():
    """Templates that print a tool message's ``name`` (Step-3.5-Flash's) see a function result sent after
    ``previous_response_id`` exactly as in the whole conversation sent at once: the stored chain, then the new
    items, render the same messages."""
    from ember.server.responses_input import responses_messages

    user = [{"role": "user", "content": "Time?"}]
    call = [{"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}"}]
    result = [{"type": "function_call_output", "call_id": "call_1", "output": "12:00"}]
    stored = responses_messages(user) + responses_messages(call, own_output=True)
    chained = stored + responses_messages(result, history=stored)
    assert chained == responses_messages(user + call + result)
    assert chained[-1]["name"] == "get_time"


def test_input_tokens_counts_the_prompt_a_response_would_read(demo_server):
    """`client.responses.input_tokens.count` (POST /v1/responses/input_tokens) answers what the response's usage
    says; it was a 405 naming GET and DELETE. `safety_identifier` is echoed, as `user` is."""
    client = demo_server.openai()
    ask = dict(model=demo_server.model, input="Weather in Paris?", instructions="Be brief.", tools=[WEATHER])
    counted = client.responses.input_tokens.count(**ask)
    made = client.responses.create(**ask, max_output_tokens=1, safety_identifier="s1")
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", made.usage.input_tokens)
    assert made.safety_identifier == "s1"


def test_a_completed_call_keeps_its_array_arguments_however_the_conversation_comes_back(demo_server):
    """A tool whose parameters are an array: its completed call replayed through previous_response_id rendered
    `{}`, while the same items sent whole kept the array (a cut call still replays with `{}`)."""
    client = demo_server.openai()
    pick = {"type": "function", "name": "pick", "strict": True,
            "parameters": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}
    first = client.responses.create(model=demo_server.model, input="Pick.", tools=[pick], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=40, extra_body={"seed": 1, **NO_THINK})
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.status == "completed" and isinstance(json.loads(call.arguments), list), call
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}
    chained = client.responses.input_tokens.count(model=demo_server.model, previous_response_id=first.id,
                                                  input=[result], tools=[pick], extra_body=NO_THINK)
    whole = client.responses.input_tokens.count(model=demo_server.model, tools=[pick], extra_body=NO_THINK, input=[
        {"role": "user", "content": "Pick."}, *[o.model_dump(exclude_none=True) for o in first.output], result])
    assert chained.input_tokens == whole.input_tokens


def test_a_call_cut_short_replays_with_empty_arguments():
    """A stored response whose call `max_output_tokens` cut (arguments not a JSON object) continues through
    `previous_response_id`: its call replays with `{}`, which every template can iterate (raw text failed in
    Qwen3-Coder's `arguments|items`)."""
    from ember.server.responses_input import responses_messages

    for raw in ('{"city": "Par', '"x"'):
        cut = [{"type": "function_call", "call_id": "c", "name": "f", "arguments": raw, "status": "incomplete"}]
        [msg] = responses_messages(cut, own_output=True)
        assert msg["tool_calls"][0]["function"]["arguments"] == {}


def test_a_thought_whose_turn_ended_without_output_joins_no_later_turn():
    """A reasoning item followed by the user speaking again (a turn cut short) is not rendered into the next
    assistant turn's thought."""
    from ember.server.responses_input import responses_messages

    messages = responses_messages([
        {"role": "user", "content": "Q1"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "thought for Q1"}]},
        {"role": "user", "content": "Q2"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "thought for Q2"}]},
        {"role": "assistant", "content": "done"}])
    assert "thought for Q1" not in json.dumps(messages)
    assert [m.get("reasoning_content") for m in messages if m["role"] == "assistant"] == [None, "thought for Q2"]


def _settled(server, free_blocks: int) -> None:
    deadline = time.monotonic() + 5
    while (server.stats().num_running or server.stats().num_waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    s = server.stats()
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, free_blocks)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_aborts_its_response(demo_server, stream):
    """3000 tokens asked (EOS ignored): only an abort on disconnect frees the slot and blocks within seconds."""
    before = _cancelled(demo_server)
    free = demo_server.stats().num_free_blocks
    body = {"model": demo_server.model, "input": "Tell me about the weather.", "max_output_tokens": 3000,
            "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", demo_server.url + "/v1/responses", json=body, timeout=60) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) == 6:
                        break
        assert [e["type"] for e in events][-1] == "response.output_text.delta"
    else:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(demo_server.url + "/v1/responses", json=body, timeout=0.5)
    _settled(demo_server, free)
    assert _cancelled(demo_server) - before == 1


def test_input_items_are_listed_back_a_page_at_a_time(demo_server):
    """Every item gets an id and a status, also one sent with them null (the SDK's model_dump() writes null): a
    null id left in the list ended the SDK's paging, which had no cursor to go on from."""
    client = demo_server.openai()
    r = client.responses.create(model=demo_server.model, max_output_tokens=1, input=[
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}", "id": "fc_given"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C", "id": None, "status": None}])
    asc = list(client.responses.input_items.list(r.id, order="asc", limit=1))  # the SDK follows `after` pages
    assert [i.type for i in asc] == ["message", "function_call", "function_call_output"]
    assert asc[0].content[0].type == "input_text" and asc[0].content[0].text == "Weather?"
    assert asc[1].id == "fc_given" and asc[1].arguments == "{}" and asc[2].output == "18C"
    assert len({i.id for i in asc}) == 3 and {i.status for i in asc} == {"completed"}
    page = client.responses.input_items.list(r.id, limit=2)  # default order: newest first
    assert [i.id for i in page.data] == [asc[2].id, asc[1].id] and page.has_more
    text = client.responses.create(model=demo_server.model, input="Hi", max_output_tokens=1)
    [only] = client.responses.input_items.list(text.id).data
    assert only.role == "user" and only.content[0].text == "Hi"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_missing")
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.input_items.list(text.id, limit=0)
    assert bad.value.body["param"] == "limit"  # the query parameter, not "query.limit"


def test_input_items_page_backwards_with_before_and_ids_are_unique(demo_server):
    """`before` (a cursor of OpenAI's list endpoints, sent by clients other than Python's) gives the page just before
    an item; it was ignored (every item came back). Two input items with one id are refused, as OpenAI refuses them:
    the SDK's paging by `after` then went round the same items for ever."""
    client = demo_server.openai()
    r = client.responses.create(model=demo_server.model, max_output_tokens=1, input=[
        {"role": "user", "content": f"m{k}", "id": f"msg_{k}"} for k in range(7)])
    url = f"{demo_server.url}/v1/responses/{r.id}/input_items"
    page = httpx.get(url, params={"order": "asc", "before": "msg_4", "limit": 2}, timeout=30).json()
    assert [i["id"] for i in page["data"]] == ["msg_2", "msg_3"] and page["has_more"]
    first = httpx.get(url, params={"order": "asc", "before": "msg_2", "limit": 5}, timeout=30).json()
    assert [i["id"] for i in first["data"]] == ["msg_0", "msg_1"] and not first["has_more"]
    between = httpx.get(url, params={"order": "asc", "after": "msg_1", "before": "msg_5", "limit": 2}, timeout=30)
    assert [i["id"] for i in between.json()["data"]] == ["msg_2", "msg_3"] and between.json()["has_more"]
    missing = httpx.get(url, params={"before": "msg_x"}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "before"
    with pytest.raises(openai.BadRequestError) as dup:
        client.responses.create(model=demo_server.model, max_output_tokens=1, input=[
            {"role": "user", "content": "a", "id": "msg_X"}, {"role": "user", "content": "b", "id": "msg_B"},
            {"role": "user", "content": "c", "id": "msg_X"}])
    assert dup.value.body["param"] == "input[2].id" and "Duplicate item found with id msg_X" in dup.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_a_non_finite_number_in_a_tool_is_a_400_naming_it(demo_server, stream):
    """Python's JSON reader takes NaN and 1e309; the response echoes its tools, which JSON cannot write (it was a
    500, or a stream holding `NaN`)."""
    body = ('{"input": "hi", "max_output_tokens": 1, "stream": %s, "tools": [{"type": "function", "name": "f", '
            '"parameters": {"type": "object", "x": 1e309}}]}' % str(stream).lower())
    r = httpx.post(demo_server.url + "/v1/responses", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].parameters.x", r.text



def test_background_without_a_store_is_refused_before_it_is_admitted(rebuilt_server):
    """With --responses-store-size 0 a background response is a 400 naming `background`, refused before its prompt is
    rendered: it counts no prompt tokens."""
    srv = rebuilt_server(responses_store_size=0)

    def prompt_tokens() -> float:
        text = httpx.get(srv.url + "/metrics", timeout=30).text
        return float(re.search(r'^vllm:prompt_tokens_total\{[^}]*\} (\S+)$', text, flags=re.M).group(1))

    before = prompt_tokens()
    r = httpx.post(srv.url + "/v1/responses", json={"model": "ember-demo", "input": "Hi", "background": True},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"
    assert prompt_tokens() == before


def test_a_json_schema_format_without_a_name_is_echoed_with_the_name_it_was_compiled_under(demo_server):
    """The reference's typed `Response` requires `text.format.name`: strict clients refused the echo without it."""
    from openai.types.responses import Response

    r = httpx.post(demo_server.url + "/v1/responses", timeout=30, json={
        "model": demo_server.model, "input": "Hi", "max_output_tokens": 3,
        "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    assert r.status_code == 200, r.text
    assert r.json()["text"]["format"] == {"type": "json_schema", "name": "response", "schema": {"type": "object"}}
    Response.model_validate(r.json())


def test_max_output_tokens_is_echoed_as_the_limit_in_effect(demo_server):
    """As vLLM: the limit the reply ran under (clamped to the context's room, or the model's default), not the
    request's value, so an `incomplete` response says which limit cut it."""
    client = demo_server.openai()
    r = client.responses.create(model=demo_server.model, input="Hi", max_output_tokens=3)
    assert r.max_output_tokens == 3 and r.status == "incomplete" and r.max_tool_calls is None
    bounded = client.responses.create(model=demo_server.model, input="Hi", max_output_tokens=1, max_tool_calls=2)
    assert bounded.max_tool_calls == 2  # echoed, as OpenAI's Response object carries it
    huge = client.responses.create(model=demo_server.model, input="Hi", max_output_tokens=10**9,
                                   extra_body={"seed": 1}, temperature=0)
    unset = client.responses.create(model=demo_server.model, input="Hi", extra_body={"seed": 1}, temperature=0)
    assert 0 < huge.max_output_tokens < 10**9 and unset.max_output_tokens == huge.max_output_tokens
