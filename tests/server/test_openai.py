"""The OpenAI-compatible endpoints, driven through the real `openai` SDK and httpx against the live server."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

HI = [{"role": "user", "content": "Say hello."}]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                         "hourly": {"type": "boolean"}},
                       "required": ["unit", "hourly"], "additionalProperties": False},
        "strict": True,
    },
}


def _prompt_len(server, messages, **kw) -> int:
    text = server.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                chat_template=server.runtime.chat_template, **kw)
    return len(server.tokenizer.encode(text, add_special_tokens=False))


def _rebuild(stream):
    """The SDK's own accumulator over our chunks, plus the token IDs each chunk carried."""
    state = ChatCompletionStreamState()
    token_ids, usage, n_chunks = [], None, 0
    for chunk in stream:
        n_chunks += 1
        state.handle_chunk(chunk)
        for c in chunk.choices:
            token_ids += (c.model_extra or {}).get("token_ids") or []
        if chunk.usage is not None:
            usage = chunk.usage
    return state.current_completion_snapshot, token_ids, usage, n_chunks


def test_models_list(demo_server):
    client = demo_server.openai()
    assert [m.id for m in client.models.list().data] == ["ember-demo"]
    assert client.models.retrieve("ember-demo").id == "ember-demo"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    for headers in ({}, {"anthropic-version": "2023-06-01"}):  # the list's path with a trailing slash is the list
        slash = httpx.get(demo_server.url + "/v1/models/?limit=1", headers=headers, timeout=30)
        assert slash.status_code == 307 and slash.headers["location"].endswith("/v1/models?limit=1")
        listed = httpx.get(demo_server.url + "/v1/models/", headers=headers, timeout=30, follow_redirects=True)
        assert [m["id"] for m in listed.json()["data"]] == ["ember-demo"], listed.text


def test_chat_non_streaming_usage_counts_tokens(any_server):
    client = any_server.openai()
    r = client.chat.completions.create(model=any_server.model, messages=HI, max_tokens=12, seed=3,
                                       extra_body={"return_token_ids": True})
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert r.usage.completion_tokens == len(ids) <= 12
    assert r.usage.prompt_tokens == len(r.model_extra["prompt_token_ids"]) == _prompt_len(any_server, HI)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "length":
        assert len(ids) == 12


def test_stream_equals_non_stream_for_the_same_seed(demo_server):
    client = demo_server.openai()
    kw = dict(model=demo_server.model, messages=HI, max_tokens=16, seed=11, temperature=1.0,
              extra_body={"return_token_ids": True})
    full = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    rebuilt, ids, usage, n_chunks = _rebuild(stream)
    assert rebuilt.choices[0].message.content == full.choices[0].message.content
    assert rebuilt.choices[0].finish_reason == full.choices[0].finish_reason
    assert ids == full.choices[0].model_extra["token_ids"]
    assert usage.completion_tokens == len(ids) == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert n_chunks >= 3  # role, tokens, finish (+usage)


def test_every_token_rides_in_exactly_one_chunk_with_its_logprob(demo_server):
    """With thinking on, delimiter tokens are withheld from text but still arrive, each in one chunk."""
    with httpx.stream("POST", demo_server.url + "/v1/chat/completions", timeout=60, json={
            "model": demo_server.model, "messages": HI, "max_tokens": 10, "seed": 5, "stream": True,
            "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "max_thinking_tokens": 3,
            "chat_template_kwargs": {"enable_thinking": True}}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "prompt_token_ids" in chunks[0]
    ids, n_lp = [], 0
    for ch in chunks:
        c = ch["choices"][0]
        ids += c["token_ids"]
        if c["logprobs"] is not None:
            lp = c["logprobs"]
            entries = lp["content"] + lp.get("reasoning_content", [])
            assert len(entries) <= len(c["token_ids"])
            for e in entries:
                assert e["token"] == bytes(e["bytes"]).decode("utf-8", "replace")
                assert len(e["top_logprobs"]) == 2 and e["logprob"] <= 0.0
            n_lp += len(entries)
    assert len(ids) == 10
    think_close = demo_server.runtime.parser.delimiter_ids["</think>"]
    assert ids[3] == think_close  # the budget closed the thought after 3 reasoning tokens
    assert n_lp == 9  # every token but the delimiter has a content or reasoning logprob


def test_reasoning_is_split_from_content(demo_server):
    r = demo_server.openai().chat.completions.create(
        model=demo_server.model, messages=HI, max_tokens=12, seed=2,
        extra_body={"max_thinking_tokens": 4, "chat_template_kwargs": {"enable_thinking": True},
                    "return_token_ids": True})
    msg = r.choices[0].message
    extra = msg.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] and extra["reasoning_content"]
    assert "</think>" not in msg.content and "</think>" not in extra["reasoning_content"]
    ids = r.choices[0].model_extra["token_ids"]
    tb = demo_server.runtime.token_bytes
    assert extra["reasoning_content"] == tb.decode(ids[:4])
    assert r.usage.completion_tokens_details.reasoning_tokens == 4  # the delimiter is no reasoning text
    # thinking off: no reasoning at all
    off = demo_server.openai().chat.completions.create(
        model=demo_server.model, messages=HI, max_tokens=6, seed=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_reasoning_split_with_the_real_qwen3_thinking_template(qwen3_thinking_server):
    """The template leaves `<think>` open: the reply starts in reasoning; the budget ends it at token 151668."""
    server = qwen3_thinking_server
    kw = dict(model=server.model, messages=HI, max_tokens=10, seed=8,
              extra_body={"max_thinking_tokens": 3, "return_token_ids": True})
    r = server.openai().chat.completions.create(**kw)
    ids = r.choices[0].model_extra["token_ids"]
    assert ids[3] == 151668
    extra = r.choices[0].message.model_extra
    tb = server.runtime.token_bytes
    assert extra["reasoning_content"] == tb.decode(ids[:3])
    after = tb.decode(ids[4:]).removesuffix("<|im_end|>")
    content = r.choices[0].message.content
    assert after.endswith(content) and after[:len(after) - len(content)].strip() == ""  # at most whitespace held
    assert r.usage.completion_tokens_details.reasoning_tokens == 3
    rebuilt, stream_ids, usage, _ = _rebuild(server.openai().chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw))
    assert stream_ids == ids
    assert usage.completion_tokens_details.reasoning_tokens == 3
    assert rebuilt.choices[0].message.model_extra["reasoning_content"] == extra["reasoning_content"]
    assert rebuilt.choices[0].message.content == r.choices[0].message.content


def test_a_reply_cut_inside_its_thought_has_null_content(qwen3_thinking_server):
    """As vLLM's reasoning parsers answer (and the OpenAI SDK types it): a reply that is only a thought, cut by
    max_tokens, has content null (it was ""); a stream sends no content delta."""
    server = qwen3_thinking_server
    kw = dict(model=server.model, messages=HI, max_tokens=2, seed=8)
    r = server.openai().chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.model_extra["reasoning_content"]
    assert r.choices[0].message.content is None
    rebuilt, _, _, _ = _rebuild(server.openai().chat.completions.create(stream=True, **kw))
    assert not rebuilt.choices[0].message.content  # no content delta (the role chunk's "", as vLLM's)


def test_include_reasoning_false_leaves_the_thought_out(qwen3_thinking_server):
    """vLLM's ``include_reasoning: false``: the thought is still parsed (it never becomes content) but is not in the
    reply, streamed or not; its tokens stay in token_ids and usage, without logprob entries (it was ignored)."""
    server = qwen3_thinking_server
    kw = dict(model=server.model, messages=HI, max_tokens=10, seed=8, logprobs=True,
              extra_body={"max_thinking_tokens": 3, "return_token_ids": True})
    full = server.openai().chat.completions.create(**kw)
    assert full.choices[0].message.model_extra["reasoning_content"]
    kw["extra_body"] = {**kw["extra_body"], "include_reasoning": False}
    r = server.openai().chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.message.model_extra.get("reasoning_content") is None and choice.message.model_extra.get(
        "reasoning") is None
    assert choice.message.content == full.choices[0].message.content
    assert choice.model_extra["token_ids"] == full.choices[0].model_extra["token_ids"]
    assert r.usage.completion_tokens_details.reasoning_tokens == 3
    assert "reasoning_content" not in (choice.logprobs.model_extra or {})
    assert [e.token for e in choice.logprobs.content] == [e.token for e in full.choices[0].logprobs.content]
    rebuilt, stream_ids, _, _ = _rebuild(server.openai().chat.completions.create(stream=True, **kw))
    assert stream_ids == choice.model_extra["token_ids"]
    assert not (rebuilt.choices[0].message.model_extra or {}).get("reasoning_content")
    assert rebuilt.choices[0].message.content == choice.message.content


def test_n_choices_are_independent_and_counted(demo_server):
    r = demo_server.openai().chat.completions.create(
        model=demo_server.model, messages=HI, max_tokens=8, n=3, seed=4, extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in r.choices]
    assert len({tuple(i) for i in ids}) > 1
    assert r.usage.completion_tokens == sum(map(len, ids))
    stream = demo_server.openai().chat.completions.create(
        model=demo_server.model, messages=HI, max_tokens=8, n=3, seed=4, stream=True,
        extra_body={"return_token_ids": True})
    rebuilt, _, _, _ = _rebuild(stream)
    assert [c.message.content for c in rebuilt.choices] == [c.message.content for c in r.choices]


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_call_stream_rebuilds_to_the_non_streaming_call(any_server, choice):
    """Both end with the call; OpenAI (and vLLM) give `finish_reason` `stop` to a call of a named `tool_choice`,
    `tool_calls` to a required one."""
    client = any_server.openai()
    reason = "stop" if choice == "named" else "tool_calls"
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    # Random weights: the grammar forces the call; a bias on EOS ends the turn as soon as the grammar allows it.
    eos = any_server.tokenizer.convert_tokens_to_ids("<|im_end|>")
    kw = dict(model=any_server.model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
              tool_choice=tool_choice, max_tokens=60, seed=9, parallel_tool_calls=False, logit_bias={str(eos): 100},
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    full = client.chat.completions.create(**kw)
    rebuilt, _, _, _ = _rebuild(client.chat.completions.create(stream=True, **kw))
    calls = full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == reason
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["hourly"], bool)
    got = rebuilt.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert rebuilt.choices[0].finish_reason == reason
    assert not (full.choices[0].message.content or "").strip()


def test_allowed_tools_limit_the_calls_and_keep_every_tool_in_the_prompt(demo_server):
    """OpenAI's ``allowed_tools`` (chat's and the Responses API's shapes): with ``required`` the call names only an
    allowed tool, whatever the random model prefers; the prompt still lists every tool. It was a 400."""
    client = demo_server.openai()
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    eos = demo_server.tokenizer.convert_tokens_to_ids("<|im_end|>")
    kw = dict(model=demo_server.model, messages=[{"role": "user", "content": "Weather?"}], tools=[other, WEATHER],
              max_tokens=60, parallel_tool_calls=False, logit_bias={str(eos): 100},
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}
    for seed in range(3):
        r = client.chat.completions.create(tool_choice=allowed, seed=seed, **kw)
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    free = client.chat.completions.create(tool_choice="none", **{**kw, "max_tokens": 1})
    assert r.usage.prompt_tokens == free.usage.prompt_tokens  # both tools are rendered either way
    resp = client.responses.create(
        model=demo_server.model, input="Weather?", max_output_tokens=60, parallel_tool_calls=False,
        tools=[{"type": "function", **t["function"]} for t in (other, WEATHER)],
        tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [item.name for item in resp.output if item.type == "function_call"] == ["get_time"]
    assert resp.tool_choice.type == "allowed_tools"  # echoed as sent


def test_json_schema_response_format(demo_server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = demo_server.openai().chat.completions.create(
        model=demo_server.model, messages=HI, max_tokens=30, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)


def test_stop_string_cuts_the_output(demo_server):
    client = demo_server.openai()
    base = client.chat.completions.create(model=demo_server.model, messages=HI, max_tokens=20, temperature=0)
    text = base.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    r = client.chat.completions.create(model=demo_server.model, messages=HI, max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    kept = client.chat.completions.create(model=demo_server.model, messages=HI, max_tokens=20, temperature=0,
                                          stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == text[:text.index(stop) + len(stop)]


def test_completions_endpoint(demo_server):
    client = demo_server.openai()
    r = client.completions.create(model=demo_server.model, prompt="def fibonacci(n):", max_tokens=6, seed=1,
                                  logprobs=2, echo=False)
    c = r.choices[0]
    assert r.object == "text_completion" and len(c.logprobs.tokens) == r.usage.completion_tokens <= 6
    assert "".join(c.logprobs.tokens).startswith(c.text[:1]) or c.text == ""
    ids = demo_server.tokenizer.encode("def fibonacci(n):")
    r2 = client.completions.create(model=demo_server.model, prompt=[ids, ids], max_tokens=4, temperature=0,
                                   echo=True)
    assert [c.index for c in r2.choices] == [0, 1]
    assert r2.choices[0].text == r2.choices[1].text and r2.choices[0].text.startswith("def fibonacci(n):")
    assert r2.usage.prompt_tokens == 2 * len(ids)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=demo_server.model, prompt=[ids], max_tokens=4, temperature=0, stream=True) if ch.choices)
    assert "def fibonacci(n):" + streamed == r2.choices[0].text


def test_history_with_tool_calls_and_reasoning_renders(demo_server):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"unit": "celsius", "hourly": false}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    r = demo_server.openai().chat.completions.create(model=demo_server.model, messages=messages, tools=[WEATHER],
                                                     max_tokens=3)
    rendered = demo_server.tokenizer.apply_chat_template(
        [messages[0], {"role": "user", "content": "Weather?"},
         {**messages[2], "content": "", "tool_calls": [{**messages[2]["tool_calls"][0], "function": {
             "name": "get_weather", "arguments": {"unit": "celsius", "hourly": False}}}]}, messages[3]],
        tools=[WEATHER], tokenize=False, add_generation_prompt=True, chat_template=demo_server.runtime.chat_template)
    assert "<tool_response>\n18C\n</tool_response>" in rendered and '"unit": "celsius"' in rendered
    assert r.usage.prompt_tokens == len(demo_server.tokenizer.encode(rendered, add_special_tokens=False))


def test_errors_are_typed(demo_server, keyed_server):
    client = demo_server.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=demo_server.model, messages=HI, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HI)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=demo_server.model, messages=[{"role": "user", "content": "x " * 5000}])
    assert "maximum context length" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=demo_server.model, messages=[{"role": "bogus", "content": "x"}])
    assert "messages[0]" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=demo_server.model, messages=HI, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "missing"}})
    assert "missing" in e.value.message
    with pytest.raises(openai.AuthenticationError):
        keyed_server.openai(api_key="wrong").chat.completions.create(model=demo_server.model, messages=HI)
    ok = keyed_server.openai(api_key="sekrit").chat.completions.create(model=demo_server.model, messages=HI,
                                                                       max_tokens=1)
    assert ok.usage.completion_tokens == 1
    r = httpx.post(demo_server.url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_overload_answers_503(demo_server):
    config = demo_server.app.state.ember.config
    old = config.max_waiting
    config.max_waiting = 0  # admission refuses while >= 0 requests wait: always, for this moment
    try:
        with pytest.raises(openai.InternalServerError) as e:
            demo_server.openai().chat.completions.create(model=demo_server.model, messages=HI, max_tokens=1)
        assert e.value.status_code == 503 and e.value.body["type"] == "server_error"
    finally:
        config.max_waiting = old


def test_health_and_metrics(demo_server):
    assert httpx.get(demo_server.url + "/health", timeout=10).json()["status"] == "ok"
    demo_server.openai().chat.completions.create(model=demo_server.model, messages=HI, max_tokens=2)
    text = httpx.get(demo_server.url + "/metrics", timeout=10).text
    for name in ("ember_requests_total", "ember_num_requests_running", "ember_num_requests_waiting",
                 "ember_kv_cache_usage_ratio", "ember_prompt_tokens_total", "ember_generation_tokens_total",
                 "ember_time_to_first_token_seconds_bucket", "ember_inter_token_latency_seconds_bucket"):
        assert name in text
    assert 'ember_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    # what vLLM's server exports beside its engine's metrics: its HTTP instrumentation, the process and the runtime,
    # and the KV cache's configuration
    assert 'http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"}' in text
    assert 'http_request_duration_seconds_count{handler="/v1/chat/completions",method="POST"}' in text
    assert "process_resident_memory_bytes" in text and "python_gc_objects_collected_total" in text
    info = demo_server.runtime.model_info
    assert (f'vllm:cache_config_info{{block_size="{info.block_size}",cache_dtype="{info.kv_cache_dtype}",'
            f'enable_prefix_caching="True",gpu_memory_utilization="0.9",num_gpu_blocks="{info.num_kv_blocks}"}} 1.0'
            in text), text


def _samples(text: str) -> dict[str, float]:
    """/metrics samples by name and labels."""
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))}


def _scrape(server) -> dict[str, float]:
    return _samples(httpx.get(server.url + "/metrics", timeout=10).text)


def test_metrics_observe_the_per_request_histograms_of_vllms_dashboard(demo_server):
    """Each choice is one vLLM request (its prompt and generated tokens, max_tokens, decode time and time per output
    token after the first); each prompt's `n` choices together give `n` and the longest one's token count."""
    before = _scrape(demo_server)
    demo_server.openai().chat.completions.create(model=demo_server.model, messages=HI, max_tokens=5, n=2, seed=3,
                                                 temperature=1.0, extra_body={"ignore_eos": True})
    after = _scrape(demo_server)

    def grew(name: str, part: str) -> float:
        key = f'vllm:{name}_{part}{{model_name="{demo_server.model}"}}'
        return after[key] - before.get(key, 0.0)

    def seen(name: str) -> tuple[float, float]:
        return grew(name, "count"), grew(name, "sum")

    assert seen("request_prompt_tokens") == (2, 2 * _prompt_len(demo_server, HI))
    assert seen("request_generation_tokens") == seen("request_params_max_tokens") == (2, 10)
    assert seen("request_params_n") == (1, 2)
    assert seen("request_max_num_generation_tokens") == (1, 5)
    decode, tpot = seen("request_decode_time_seconds"), seen("request_time_per_output_token_seconds")
    assert decode[0] == tpot[0] == 2
    assert tpot[1] == pytest.approx(decode[1] / 4)  # 4 tokens after each choice's first


def test_metrics_count_prompts_per_choice_and_generated_tokens_as_they_stream(demo_server):
    """As vLLM: a prompt counts once per engine request (`n` choices are `n`, as the per-request histogram has it),
    generated tokens count as each step delivers them (a throughput panel stayed flat until a choice ended), and a
    request the engine refuses (a 400) adds no queue time."""
    def key(name: str) -> str:
        return f'vllm:{name}{{model_name="{demo_server.model}"}}'

    before = _scrape(demo_server)
    demo_server.openai().completions.create(model=demo_server.model, prompt="hi there", max_tokens=2, n=3)
    after = _scrape(demo_server)
    prompt_len = len(demo_server.tokenizer("hi there")["input_ids"])
    grew = {name: after[key(name)] - before.get(key(name), 0.0)
            for name in ("prompt_tokens_total", "request_prompt_tokens_sum")}
    assert grew == {"prompt_tokens_total": 3 * prompt_len, "request_prompt_tokens_sum": 3 * prompt_len}
    body = {"model": demo_server.model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
    start, chunks = _scrape(demo_server), 0
    with httpx.stream("POST", demo_server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 50:
                mid = _scrape(demo_server)
                break
    assert mid[key("generation_tokens_total")] - start[key("generation_tokens_total")] >= 50
    queued = key("request_queue_time_seconds_count")
    before = _scrape(demo_server)[queued]
    refused = httpx.post(demo_server.url + "/v1/completions", timeout=30, json={
        "model": demo_server.model, "prompt": "hello", "max_tokens": 5, "allowed_token_ids": [300],
        "response_format": {"type": "json_object"}})
    assert refused.status_code == 400, refused.text
    assert _scrape(demo_server)[queued] == before


def test_metrics_observe_vllms_prefill_and_inference_time_from_the_engines_first_scheduling(demo_server):
    """The engine (its own process) stamps a request's first scheduling; prefill runs from it to the first token and
    inference to the last, both as received by the server: prefill + decode = inference, within the first token's
    time (the request was scheduled after it arrived)."""
    before = _scrape(demo_server)
    demo_server.openai().chat.completions.create(model=demo_server.model, messages=HI, max_tokens=4, seed=3,
                                                 extra_body={"ignore_eos": True})
    after = _scrape(demo_server)

    def seen(name: str) -> tuple[float, float]:
        count, total = (f'vllm:{name}_{part}{{model_name="{demo_server.model}"}}' for part in ("count", "sum"))
        return after[count] - before.get(count, 0.0), after[total] - before.get(total, 0.0)

    n_prefill, prefill = seen("request_prefill_time_seconds")
    n_inference, inference = seen("request_inference_time_seconds")
    n_ttft, ttft = seen("time_to_first_token_seconds")
    decode = seen("request_decode_time_seconds")[1]
    assert n_prefill == n_inference == n_ttft == 1
    assert 0 < prefill <= ttft
    assert inference == pytest.approx(prefill + decode)
    assert after[f'vllm:request_inference_time_seconds_bucket{{le="7680.0",model_name="{demo_server.model}"}}'] >= 1


def test_an_echo_of_max_tokens_0_is_timed_as_every_request_is(demo_server):
    """vLLM runs an echo without generation for 1 token, so it is in the latency histograms like any request: each
    histogram's count grows with the finished-request count (they fell short, and dashboards dividing by them
    drifted)."""
    names = ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
             "request_decode_time_seconds_count", "request_inference_time_seconds_count",
             "request_params_max_tokens_count", "request_queue_time_seconds_count")
    success = f'vllm:request_success_total{{finished_reason="length",model_name="{demo_server.model}"}}'
    before = _scrape(demo_server)
    r = httpx.post(demo_server.url + "/v1/completions", timeout=60,
                   json={"model": demo_server.model, "prompt": "hello world", "max_tokens": 0, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    after = _scrape(demo_server)
    assert after[success] - before.get(success, 0.0) == 1
    grew = {name: after[f'vllm:{name}{{model_name="{demo_server.model}"}}']
            - before.get(f'vllm:{name}{{model_name="{demo_server.model}"}}', 0.0) for name in names}
    assert grew == dict.fromkeys(names, 1), grew


def test_metrics_export_every_finished_reason_at_0_from_startup():
    """`increase()` over a series that appears with its first count misses that count (a first abort)."""
    from ember.server.metrics import Metrics

    text = Metrics("m", lambda: None).render().decode()
    for reason in ("stop", "length", "abort", "error", "repetition"):  # vLLM's FinishReason
        assert f'vllm:request_success_total{{finished_reason="{reason}",model_name="m"}} 0.0' in text
    for reason in ("eos", "stop_string", "length", "abort", "error", "cancelled", "pooled"):
        assert f'ember_request_finished_total{{reason="{reason}"}} 0.0' in text


def test_vllm_latency_histograms_have_vllms_buckets():
    """A vLLM dashboard's `le="0.05"` inter-token panel (and TTFT's `le`s) must find their series."""
    import re

    from ember.server.metrics import Metrics

    text = Metrics("m", lambda: None).render().decode()

    def bounds(name: str) -> list[str]:
        return re.findall(rf'^vllm:{name}_bucket{{le="([^"]+)",model_name="m"}}', text, flags=re.M)

    assert bounds("inter_token_latency_seconds") == [str(b) for b in (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)] + [
        "+Inf"]
    assert bounds("time_to_first_token_seconds") == [str(b) for b in (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0)] + ["+Inf"]


def test_a_failed_choice_is_vllms_error_reason_and_a_refused_one_no_vllm_request():
    from ember.server.metrics import Metrics

    metrics = Metrics("m", lambda: None)
    metrics.finished("error")
    metrics.finished("error", rejected=True)  # the engine refused it: the client got a 400
    metrics.finished("cancelled")
    samples = _samples(metrics.render().decode())
    assert samples['ember_request_finished_total{reason="error"}'] == 2
    vllm = {r: samples[f'vllm:request_success_total{{finished_reason="{r}",model_name="m"}}']
            for r in ("error", "abort", "stop")}
    assert vllm == {"error": 1, "abort": 1, "stop": 0}


def test_latency_histograms_reach_vllms_longest_buckets():
    """A 100 s first token and a 30-minute request are told apart from an 80 s one; token counts reach
    max_model_len in vLLM's 1-2-5 steps."""
    from ember.server.metrics import Metrics

    metrics = Metrics("m", lambda: None, max_model_len=2048)
    metrics.ttft.observe(100.0)
    metrics.e2e.observe(1800.0)
    text = metrics.render().decode()
    samples = _samples(text)
    for name in ("ember_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"):
        labels = ',model_name="m"' if name.startswith("vllm") else ""
        assert samples[f'{name}_bucket{{le="80.0"{labels}}}'] == 0
        assert samples[f'{name}_bucket{{le="160.0"{labels}}}'] == 1 and f'le="2560.0"{labels}' in text
    assert samples['ember_request_latency_seconds_bucket{le="960.0"}'] == 0
    assert samples['ember_request_latency_seconds_bucket{le="1920.0"}'] == 1
    tops = [k for k in samples if k.startswith("vllm:request_prompt_tokens_bucket")]
    assert tops[0].startswith('vllm:request_prompt_tokens_bucket{le="1.0"') and 'le="2000.0"' in tops[-2]
    assert 'le="+Inf"' in tops[-1]


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(demo_server):
    """vLLM's `stream_options.continuous_usage_stats`: every chunk's usage counts its choice's tokens so far; the
    last chunk still carries the whole request's usage."""
    client = demo_server.openai()
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model=demo_server.model, messages=HI, max_tokens=6, n=2, seed=4,
                                                 temperature=1.0, stream=True, stream_options=opts,
                                                 extra_body={"return_token_ids": True}))
    *per_choice, last = chunks
    prompt = _prompt_len(demo_server, HI)
    seen = {0: 0, 1: 0}
    for ch in per_choice:
        c = ch.choices[0]
        seen[c.index] += len((c.model_extra or {}).get("token_ids") or [])
        assert ch.usage.prompt_tokens == prompt and ch.usage.completion_tokens == seen[c.index]
        assert ch.usage.total_tokens == prompt + seen[c.index]
    assert last.choices == [] and last.usage.completion_tokens == seen[0] + seen[1]
    text = list(client.completions.create(model=demo_server.model, prompt=["a b", "c d e f"], max_tokens=3,
                                          stream=True, stream_options=opts, extra_body={"ignore_eos": True}))
    for ch in text[:-1]:
        c = ch.choices[0]
        assert ch.usage.prompt_tokens == len(demo_server.tokenizer.encode(["a b", "c d e f"][c.index]))
    assert {ch.choices[0].index: ch.usage.completion_tokens for ch in text[:-1]} == {0: 3, 1: 3}
    plain = list(client.chat.completions.create(model=demo_server.model, messages=HI, max_tokens=2, stream=True,
                                                stream_options={"include_usage": True}))
    assert all(ch.usage is None for ch in plain[:-1])


def test_force_include_usage_ends_every_stream_with_usage(demo_server):
    """vLLM's --enable-force-include-usage: a stream that did not ask for usage still ends with a usage chunk."""
    import dataclasses

    from tests.server.conftest import LiveServer, _serve

    asked_none = dict(model=demo_server.model, max_tokens=3, stream=True)
    quiet = list(demo_server.openai().chat.completions.create(messages=HI, **asked_none))
    assert all(ch.usage is None for ch in quiet)
    config = dataclasses.replace(demo_server.app.state.ember.config, enable_force_include_usage=True)
    srv, app = _serve(demo_server.runtime, config)
    try:
        client = LiveServer(srv.url, demo_server.runtime, demo_server.model, demo_server.tokenizer, app).openai()
        *_, last = client.chat.completions.create(messages=HI, **asked_none)
        assert last.choices == [] and last.usage.prompt_tokens == _prompt_len(demo_server, HI)
        *_, last = client.completions.create(prompt="Once", **asked_none)
        assert last.choices == [] and last.usage.completion_tokens >= 1
    finally:
        srv.stop()


def test_sagemaker_and_vllm_utility_routes(demo_server, keyed_server):
    """`/invocations` (SageMaker, as vLLM serves it) answers what chat or completions answer for the same body and
    refuses what they refuse; `/ping` is the health check; `/version` names the version."""
    url = demo_server.url
    chat = {"model": demo_server.model, "messages": HI, "max_tokens": 4, "temperature": 0}
    via = httpx.post(url + "/invocations", json=chat, timeout=30).json()
    direct = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30).json()
    assert via["object"] == "chat.completion" and via["choices"][0]["message"] == direct["choices"][0]["message"]
    text = {"model": demo_server.model, "prompt": "Once", "max_tokens": 4, "temperature": 0}
    via = httpx.post(url + "/invocations", json=text, timeout=30).json()
    assert via["object"] == "text_completion"
    assert via["choices"][0]["text"] == httpx.post(url + "/v1/completions", json=text, timeout=30).json()[
        "choices"][0]["text"]
    with httpx.stream("POST", url + "/invocations", json={**chat, "stream": True}, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert [ln for ln in r.iter_lines() if ln.startswith("data: ")][-1] == "data: [DONE]"
    refused = (({"foo": 1}, "messages"), ({"messages": [{"role": "bogus", "content": "x"}]}, "messages[0].role"),
               ({"prompt": "x", "max_tokens": 0}, "max_tokens"))
    for body, param in refused:
        r = httpx.post(url + "/invocations", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(url + "/invocations", content=b"{nope", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid"
    assert httpx.post(keyed_server.url + "/invocations", json=chat, timeout=30).status_code == 401
    assert httpx.get(url + "/ping", timeout=30).json()["status"] == "ok"
    assert httpx.post(url + "/ping", timeout=30).status_code == 200
    assert httpx.get(url + "/version", timeout=30).json()["version"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(demo_server):
    """vLLM's `return_tokens_as_token_ids` (request field, or the server's flag): every token in logprobs reads
    `token_id:N`, its bytes unchanged, so tokens that are not valid UTF-8 alone stay identifiable."""
    import dataclasses

    from tests.server.conftest import LiveServer, _serve

    client = demo_server.openai()
    ask = dict(model=demo_server.model, messages=HI, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**ask, extra_body={"return_token_ids": True})
    named = client.chat.completions.create(**ask, extra_body={"return_token_ids": True,
                                                             "return_tokens_as_token_ids": True})
    ids = named.choices[0].model_extra["token_ids"]
    content = named.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{i}" for i in ids][:len(content)]
    assert [c.bytes for c in content] == [c.bytes for c in plain.choices[0].logprobs.content]
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    text_ask = dict(model=demo_server.model, prompt="Once upon", max_tokens=4, temperature=0, logprobs=1,
                    echo=True)
    config = dataclasses.replace(demo_server.app.state.ember.config, return_tokens_as_token_ids=True)
    srv, app = _serve(demo_server.runtime, config)
    try:
        flagged = LiveServer(srv.url, demo_server.runtime, demo_server.model, demo_server.tokenizer, app).openai()
        by_id = flagged.completions.create(**text_ask).choices[0].logprobs
        assert all(t.startswith("token_id:") for t in by_id.tokens)
        as_text = flagged.completions.create(**text_ask, extra_body={"return_tokens_as_token_ids": False})
        assert as_text.choices[0].logprobs.text_offset == by_id.text_offset  # offsets count the text, not the names
        assert not any(t.startswith("token_id:") for t in as_text.choices[0].logprobs.tokens)
        streamed = [o for ch in flagged.completions.create(**text_ask, stream=True) if ch.choices
                    and ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
        assert streamed == by_id.text_offset  # however the steps were coalesced into chunks
    finally:
        srv.stop()


def _chat_both_ways(server, body: dict) -> tuple[list[dict], dict]:
    """The streamed choices (chunk by chunk) and the non-streaming choice of one chat request."""
    url = server.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    return [c for ch in chunks for c in ch["choices"]], whole


def _lp_bytes(entries: list[dict]) -> str:
    return b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", "replace")


@pytest.mark.parametrize("bias, content", [
    ({"1274": 10}, ""),         # "\n" held at the reply's start, then the model's own <think> drops it
    ({"198": 14}, "\n\n\n"),     # "\n" held, then released as content at the end
])
def test_held_whitespace_logprobs_follow_its_text(demo_server, bias, content):
    """Whitespace the parser holds at a boundary has its logprob entries only where its text surfaces: none when it is
    dropped (before the model's own `<think>`), in the chunk that releases it when it becomes content."""
    body = {"model": demo_server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "logprobs": True, "seed": 0, "allowed_token_ids": [198, 1274], "logit_bias": bias,
            "return_token_ids": True}
    choices, whole = _chat_both_ways(demo_server, body)
    assert whole["token_ids"][0] == 198 and (whole["message"]["content"] or "") == content
    assert _lp_bytes(whole["logprobs"]["content"]) == content
    for c in choices:
        entries = (c["logprobs"] or {}).get("content") or []
        assert _lp_bytes(entries) == (c["delta"].get("content") or "")
    assert [t for c in choices for t in c.get("token_ids") or []] == whole["token_ids"]


def test_malformed_tool_call_text_keeps_its_logprobs(demo_server):
    """Text of a malformed tool call surfaces as content, with its tokens' logprob entries."""
    tok = demo_server.tokenizer
    hel = tok.encode("hel", add_special_tokens=False)[0]
    body = {"model": demo_server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "logprobs": True, "seed": 0, "allowed_token_ids": [tok.convert_tokens_to_ids("<tool_call>"), hel],
            "logit_bias": {str(hel): 3},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "chat_template_kwargs": {"enable_thinking": False}}
    choices, whole = _chat_both_ways(demo_server, body)
    content = whole["message"]["content"] or ""
    assert content == "helhelhel"  # <tool_call>, then three "hel" that break it
    assert _lp_bytes(whole["logprobs"]["content"]) == content
    streamed = "".join(c["delta"].get("content") or "" for c in choices)
    assert streamed == content
    assert _lp_bytes([e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]) == content


@pytest.mark.parametrize("key", ["--5", "\u00b2", "-\u00b2", "\u0663"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_logit_bias_key_that_is_not_a_decimal_token_id_is_a_400_naming_it(demo_server, path, key):
    """Keys Python's `str.isdigit` takes but `int` does not (a doubled sign, a superscript digit) were a 500."""
    body = {"model": demo_server.model, "max_tokens": 1, "logit_bias": {key: 1}}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(demo_server.url + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_continuous_usage_of_a_held_echo_counts_no_generated_token_yet(demo_server):
    """With logprobs the echo waits for the prompt's scores and goes out with the first step: its usage counted
    that step's tokens, which only the next chunk carries."""
    body = {"model": demo_server.model, "prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", demo_server.url + "/v1/completions", json=body, timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    sent = 0
    for k, c in enumerate(c for c in chunks if c["choices"]):
        if k > 0:
            sent += len(c["choices"][0]["logprobs"]["tokens"]) if c["choices"][0]["logprobs"] else 0
        assert c["usage"]["completion_tokens"] == sent, (k, c)
    assert chunks[0]["choices"][0]["text"] == "hi" and sent == 2
