"""Chat prompts for what real models ship and clients send: named chat templates (Hermes 2 Pro / Hermes 3 /
Command R), a system prompt sent as text parts to Gemma 4, tool-call arguments nested too deeply to parse or render,
and continue_final_message on a message that ends with tool calls."""
from __future__ import annotations

import copy
import json
import types

import httpx
import pytest

from ember.server import chat
from ember.server import content_format as cf
from ember.server import protocol_anthropic as pa
from ember.server import protocol_openai as po
from ember.server.errors import ApiError
from ember.server.responses_input import responses_messages
from tests.conftest import shared_path, write_shared_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
# Hermes 3's `default` template (ChatML); its `tool_use` one is the real file from ../shared.
HERMES_DEFAULT = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                  "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                  "{% endif %}")


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(write_shared_tokenizer("qwen3", tmp_path_factory.mktemp("qwen3")))


# ----------------------------------------------------------------------------------------------- named templates

@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory):
    """A model folder whose tokenizer_config.json names its templates, as Hermes 3's does (the Qwen3 tokenizer)."""
    tool_use = shared_path("templates", "llama.cpp", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja").read_text()
    d = write_shared_tokenizer("qwen3", tmp_path_factory.mktemp("hermes"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": HERMES_DEFAULT}, {"name": "tool_use", "template": tool_use}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return d


def _build(model_dir):
    """`ModelRuntime.build` as `ember serve` calls it, over a stand-in engine (no model runs)."""
    from transformers import AutoTokenizer

    from ember.engine.client import ModelInfo
    from ember.server.config import ServeConfig
    from ember.server.generation import ModelRuntime

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    info = ModelInfo(model_dir=str(model_dir), tokenizer_path=str(model_dir), model_type="llama",
                     architecture="LlamaForCausalLM", dtype="float32", device="cpu", vocab_size=151936,
                     max_model_len=2048, eos_token_ids=(151645,), block_size=16, num_kv_blocks=16, max_num_seqs=1,
                     tensor_parallel_size=1, kv_cache_dtype="auto", load_seconds=0.0, num_params=0)
    config = ServeConfig(model_dir=model_dir, served_model_name="hermes")
    return ModelRuntime.build(types.SimpleNamespace(model_info=info), config, model_dir, None, None, tok), config


def test_a_model_with_named_templates_starts_and_renders_as_transformers_chooses(hermes_dir):
    from ember.server import startup

    rt, config = _build(hermes_dir)
    assert isinstance(rt.tokenizer.chat_template, dict)
    startup.check_template(rt, config)  # used to fail: "unhashable type: 'dict'"
    assert rt.parser.profile.name == "hermes"  # the tool markup is only in `tool_use`
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    plain = rt.render(msgs)
    assert plain == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    assert plain == rt.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    with_tools = rt.render(msgs, tools=TOOLS)
    assert "<tools>" in with_tools and "get_weather" in with_tools and with_tools.endswith("<|im_start|>assistant\n")
    assert with_tools == rt.tokenizer.apply_chat_template(msgs, tools=TOOLS, tokenize=False,
                                                          add_generation_prompt=True)


def test_named_templates_without_a_default_are_a_clear_error(qwen3_tokenizer):
    with pytest.raises(ApiError, match="tool_use.*no default") as e:
        chat.render(qwen3_tokenizer, {"tool_use": HERMES_DEFAULT}, [{"role": "user", "content": "hi"}])
    assert e.value.status == 400


def test_a_served_model_with_named_templates_uses_tool_use_for_requests_with_tools(rebuilt_server, demo_runtime):
    tok = demo_runtime[0].tokenizer
    srv = rebuilt_server({"default": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
                          "tool_use": "<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
                                      "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"})
    messages = [{"role": "user", "content": "hi"}]
    for extra, expected in (({}, "<user>hi"), ({"tools": TOOLS}, "<tools>get_weather;</tools><user>hi")):
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       json={"messages": messages, "max_tokens": 1, "return_token_ids": True, **extra})
        assert r.status_code == 200, r.text
        assert tok.decode(r.json()["prompt_token_ids"]) == expected
        r = httpx.post(srv.url + "/tokenize", timeout=60, json={"messages": messages, **extra})
        assert r.status_code == 200, r.text
        assert tok.decode(r.json()["tokens"]) == expected


def test_add_special_tokens_adds_the_tokenizers_bos_to_a_chat_prompt(rebuilt_server, demo_runtime):
    """vLLM's ``add_special_tokens`` on chat: the tokenizer's BOS on top of what the template wrote; off (the
    default) the prompt is the template's text alone."""
    tok = copy.deepcopy(demo_runtime[0].tokenizer)
    tok.bos_token, tok.add_bos_token = "<|endoftext|>", True
    srv = rebuilt_server(tokenizer=tok)

    def prompt(**extra) -> list[int]:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "return_token_ids": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()["prompt_token_ids"]

    plain = prompt()
    assert plain[0] != tok.bos_token_id and prompt(add_special_tokens=False) == plain
    assert prompt(add_special_tokens=True) == [tok.bos_token_id, *plain]


# ------------------------------------------------------------------------------------ Gemma 4's system text parts

@pytest.fixture(scope="module")
def gemma4():
    return shared_path("templates", "llama.cpp", "google-gemma-4-31B-it.jinja").read_text()


def _openai(*messages):
    return chat.openai_messages([po.ChatMessage.model_validate(m) for m in messages])


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
def test_gemma4_renders_a_system_prompt_sent_as_text_parts_as_its_text(qwen3_tokenizer, gemma4, api):
    fmt = cf.resolve("auto", gemma4)
    assert fmt == "as_sent"  # Gemma 4 loops over user content, and prints the system turn's content whole
    expected = chat.render(qwen3_tokenizer, gemma4, _openai({"role": "system", "content": "Be brief.\nUse French."},
                                                            {"role": "user", "content": "Hi"}), content_format=fmt)
    assert expected.startswith("<|turn>system\nBe brief.\nUse French.<turn|>\n<|turn>user\nHi<turn|>")
    if api == "openai":
        msgs = _openai({"role": "system", "content": [{"type": "text", "text": "Be brief."},
                                                      {"type": "text", "text": "Use French."}]},
                       {"role": "user", "content": "Hi"})
    elif api == "anthropic":
        body = pa.CountTokensRequest.model_validate({"model": "m", "system": [
            {"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use French."}],
            "messages": [{"role": "user", "content": "Hi"}]})
        msgs = chat.anthropic_messages(body.system, body.messages)
    else:
        msgs = responses_messages([{"role": "developer", "content": [{"type": "input_text", "text": "Be brief."},
                                                                     {"type": "input_text", "text": "Use French."}]},
                                   {"role": "user", "content": "Hi"}])
    assert chat.render(qwen3_tokenizer, gemma4, msgs, content_format=fmt) == expected


def test_gemma4_still_gets_a_users_text_parts_as_parts(qwen3_tokenizer, gemma4):
    msgs = _openai({"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]})
    assert cf.apply(msgs, "as_sent")[0]["content"] == [{"type": "text", "text": "one"},
                                                      {"type": "text", "text": "two"}]
    prompt = chat.render(qwen3_tokenizer, gemma4, msgs, content_format="as_sent")
    assert prompt.startswith("<|turn>user\nonetwo<turn|>")  # the template's own joining of parts


# ---------------------------------------------------------------------------------- deeply nested tool arguments

DEEP = "[" * 1000 + "]" * 1000  # json's decoder gives up (RecursionError)


def _call(arguments):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


def test_deeply_nested_arguments_are_a_400_naming_them(demo_server):
    messages = [{"role": "user", "content": "hi"}, _call(DEEP), {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    for path, body in (("/v1/chat/completions", {"model": "ember-demo", "max_tokens": 1, "messages": messages}),
                       ("/tokenize", {"model": "ember-demo", "messages": messages})):
        r = httpx.post(demo_server.url + path, timeout=60, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments", path
        assert "nested too deeply" in r.json()["error"]["message"]
    r = httpx.post(demo_server.url + "/v1/responses", timeout=60, json={
        "model": "ember-demo", "max_output_tokens": 1, "input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
            {"type": "function_call_output", "call_id": "c1", "output": "x"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input[1].arguments"


def test_a_cut_call_replayed_by_the_client_renders_with_empty_arguments(demo_server):
    """A call cut by max_tokens comes back in the next request as the client got it (arguments '{"city": '): it
    renders as `{}`, as Ember replays it for previous_response_id, instead of a 400 that would refuse every later
    turn of the agent's conversation (the OpenAI Agents SDK replays it so)."""
    def prompt_tokens(arguments: str) -> int:
        messages = [{"role": "user", "content": "hi"}, _call(arguments),
                    {"role": "tool", "tool_call_id": "c1", "content": "x"}]
        r = httpx.post(demo_server.url + "/v1/chat/completions", timeout=60,
                       json={"model": "ember-demo", "max_tokens": 1, "messages": messages})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    def input_tokens(arguments: str, **status) -> int:
        r = httpx.post(demo_server.url + "/v1/responses", timeout=60, json={
            "model": "ember-demo", "max_output_tokens": 1, "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments, **status},
                {"type": "function_call_output", "call_id": "c1", "output": "x"}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"]

    assert prompt_tokens('{"city": ') == prompt_tokens("{}") != prompt_tokens('{"city": "x"}')  # arguments render
    assert input_tokens('{"city": ', status="incomplete") == input_tokens('{"city": ') == input_tokens("{}")
    assert input_tokens('"ber', status="incomplete") == input_tokens("{}")


def test_arguments_too_deep_for_the_template_are_a_400(qwen3_tokenizer):
    """Arguments json parses but the template's `tojson` cannot print: the request's fault, not the server's."""
    template = shared_path("templates", "hf", "Qwen3-0.6B.jinja").read_text()
    deep = "[" * 600 + "]" * 600
    msgs = _openai({"role": "user", "content": "hi"}, _call(deep), {"role": "tool", "tool_call_id": "c1",
                                                                     "content": "x"})
    with pytest.raises(ApiError, match="nested too deeply") as e:
        chat.render(qwen3_tokenizer, template, msgs)
    assert (e.value.status, e.value.param) == (400, "messages")
    hi = _openai({"role": "user", "content": "hi"})  # the depth is in a template variable: named so
    with pytest.raises(ApiError, match="nested too deeply") as e:
        chat.render(qwen3_tokenizer, "{{ x | tojson }}{{ messages[0].content }}", hi, kwargs={"x": json.loads(deep)})
    assert (e.value.status, e.value.param) == (400, "chat_template_kwargs")


# ------------------------------------------------------------------------- continuing a message with tool calls

def test_continue_final_message_refuses_a_final_message_with_tool_calls(demo_server):
    call = _call('{"city": "Paris"}')
    call["content"] = "Let me check."
    messages = [{"role": "user", "content": "Weather in Paris?"}, call]
    for path, body in (("/v1/chat/completions", {"model": "ember-demo", "max_tokens": 1, "messages": messages,
                                                 "add_generation_prompt": False, "continue_final_message": True}),
                       ("/tokenize", {"model": "ember-demo", "messages": messages, "add_generation_prompt": False,
                                      "continue_final_message": True})):
        r = httpx.post(demo_server.url + path, timeout=60, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == "messages[1].tool_calls", path
    # without the calls the same message is continued
    del call["tool_calls"]
    r = httpx.post(demo_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "ember-demo", "max_tokens": 1, "messages": messages, "add_generation_prompt": False,
        "continue_final_message": True})
    assert r.status_code == 200, r.text


def test_an_assistant_refusal_part_is_its_text(demo_server):
    """An earlier assistant turn replayed with a ``refusal`` content part (as the openai SDK returns one) renders
    as that text, as vLLM reads it; only an assistant may carry one."""
    def tokens(content) -> httpx.Response:
        return httpx.post(demo_server.url + "/tokenize", timeout=30, json={"messages": [
            {"role": "user", "content": "Do something bad."}, {"role": "assistant", "content": content},
            {"role": "user", "content": "Why not?"}]})

    refused = tokens([{"type": "refusal", "refusal": "I can't help with that."}])
    assert refused.status_code == 200, refused.text
    assert refused.json()["tokens"] == tokens("I can't help with that.").json()["tokens"]
    user = httpx.post(demo_server.url + "/tokenize", timeout=30, json={"messages": [
        {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]})
    assert user.status_code == 400 and user.json()["error"]["param"] == "messages[0].content[0].type", user.text


# ------------------------------------------------------------------------ tools without a description, thinking switch

def test_gpt_oss_renders_a_tool_without_a_description(qwen3_tokenizer):
    """gpt-oss's template adds `tool.description` unguarded; the OpenAI and Anthropic APIs make it optional, so a
    tool without one renders as one with an empty description (vLLM's harmony path renders it too)."""
    template = shared_path("templates", "llama.cpp", "openai-gpt-oss-120b.jinja").read_text()
    bare = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}}]
    blank = [{"type": "function", "function": {**bare[0]["function"], "description": ""}}]
    messages = [{"role": "user", "content": "hi"}]
    text = chat.render(qwen3_tokenizer, template, messages, tools=bare)
    assert "type get_weather = " in text and text == chat.render(qwen3_tokenizer, template, messages, tools=blank)


def test_documents_reach_the_template(qwen3_tokenizer):
    """vLLM's ``documents`` (RAG) field goes to the template, which renders them (Granite 3.3); it was dropped, and the
    model answered without them."""
    template = shared_path("templates", "llama.cpp", "ibm-granite-granite-3.3-2B-Instruct.jinja").read_text()
    docs = [{"doc_id": 1, "title": "Paris", "text": "The secret code is 4711."}]
    body = po.ChatCompletionRequest.model_validate({"model": "m", "documents": docs, "messages": [
        {"role": "user", "content": "What is the secret code?"}]})
    messages = chat.openai_messages(body.messages)
    assert "4711" in chat.render(qwen3_tokenizer, template, messages, documents=body.documents)
    assert "4711" not in chat.render(qwen3_tokenizer, template, messages)


def test_a_replayed_tool_call_without_an_id_renders(qwen3_tokenizer):
    """A call whose client left out ``id`` reaches the template without one, as vLLM passes it: Apriel's template
    tests ``id is defined`` and concatenated a null (a 400)."""
    template = shared_path("templates", "llama.cpp", "Apriel-1.6-15b-Thinker-fixed.jinja").read_text()
    messages = _openai({"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                       {"role": "tool", "content": "18C"})
    assert "id" not in messages[1]["tool_calls"][0]
    assert "get_weather" in chat.render(qwen3_tokenizer, template, messages)


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
def test_deepseek_v31_renders_a_replayed_call_with_its_arguments_text(qwen3_tokenizer, api):
    """DeepSeek's own templates concatenate a call's arguments as text, while templates that iterate them need the
    object: a second tool turn on DeepSeek-V3.1 was a 400 ("can only concatenate str (not "dict") to str")."""
    template = shared_path("templates", "hf", "DeepSeek-V3.1.jinja").read_text()
    if api == "openai":
        messages = _openai({"role": "user", "content": "Weather in Zürich?"},
                           {"role": "assistant", "content": "", "tool_calls": [
                               {"id": "c1", "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
                           {"role": "tool", "tool_call_id": "c1", "content": "18C"})
    elif api == "anthropic":
        body = pa.MessagesRequest.model_validate({"model": "m", "max_tokens": 9, "messages": [
            {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather",
                                               "input": {"city": "Zürich"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "18C"}]}]})
        messages = chat.anthropic_messages(body.system, body.messages)
    else:
        messages = responses_messages([
            {"role": "user", "content": "Weather in Zürich?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Zürich"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"}])
    text = chat.render(qwen3_tokenizer, template, messages)
    assert 'get_weather<｜tool▁sep｜>{"city": "Zürich"}<｜tool▁call▁end｜>' in text and "18C" in text
    qwen = shared_path("templates", "hf", "Qwen3-0.6B.jinja").read_text()
    assert '{"city": "Zürich"}' in chat.render(qwen3_tokenizer, qwen, messages)  # iterated as the object still


def test_anthropic_thinking_sets_both_template_switches(rebuilt_server, demo_runtime):
    """DeepSeek-V3.1's template reads `thinking`, Qwen3's `enable_thinking`: `thinking` on /v1/messages sets both."""
    srv = rebuilt_server("{% for m in messages %}{{ m.content }}{% endfor %}"
                         "|{{ thinking is defined and thinking }}|{{ enable_thinking is defined and enable_thinking }}")
    counts = {}
    for kind in ("enabled", "disabled"):
        thinking = {"type": kind, "budget_tokens": 1024} if kind == "enabled" else {"type": kind}
        r = httpx.post(srv.url + "/v1/messages/count_tokens", timeout=60, json={
            "model": "ember-demo", "messages": [{"role": "user", "content": "hi"}], "thinking": thinking})
        assert r.status_code == 200, r.text
        counts[kind] = r.json()["input_tokens"]
    tok = demo_runtime[0].tokenizer
    assert counts == {"enabled": len(tok.encode("hi|True|True", add_special_tokens=False)),
                      "disabled": len(tok.encode("hi|False|False", add_special_tokens=False))}


# ------------------------------------------------------------------------------------- vLLM's parser flags, alone

def test_a_reasoning_parser_alone_keeps_the_detected_tool_syntax(qwen3_tokenizer):
    """Qwen's recipes for QwQ / Qwen3-Thinking-2507 pass only vLLM's `--reasoning-parser deepseek_r1`: the thought is
    split off as that parser says, and the calls the template's family writes still parse (they came back as raw
    `<tool_call>` content); with no family detected, the reasoning parser names it."""
    from ember.parsers.initial import InitialState
    from ember.parsers.pipeline import ParserSetup, parse_all
    from ember.server.generation import choose_profile

    template = shared_path("templates", "hf", "Qwen3-Thinking-2507.jinja").read_text()
    profile = choose_profile(template, None, "deepseek_r1", None)
    text = 'Weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    setup = ParserSetup.from_tokenizer(qwen3_tokenizer, profile)
    out = parse_all(setup.pipeline(initial=InitialState.REASONING, tools=TOOLS),
                    qwen3_tokenizer.encode(text, add_special_tokens=False))
    assert out.reasoning == "Weather.\n" and [c.name for c in out.tool_calls] == ["get_weather"]
    assert choose_profile(None, None, "deepseek_r1", None).name == "deepseek_r1"
    assert choose_profile(None, None, None, "glm47").name == "glm45"  # vLLM's GLM-4.7 parser name


@pytest.mark.parametrize("key", ["conversations", "self", "tools"])
def test_chat_template_kwargs_may_not_set_the_renderers_own_arguments(qwen3_tokenizer, key):
    """A key the renderer itself takes is refused naming chat_template_kwargs, not blamed on the messages."""
    hi = _openai({"role": "user", "content": "hi"})
    with pytest.raises(ApiError, match=f"chat_template_kwargs may not set {key}") as e:
        chat.render(qwen3_tokenizer, "{{ messages[0].content }}", hi, kwargs={key: 1})
    assert (e.value.status, e.value.param) == (400, "chat_template_kwargs")
