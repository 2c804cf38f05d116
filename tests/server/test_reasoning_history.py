"""Earlier reasoning reaches the chat template, whichever API the conversation came through: the real gpt-oss
template reads it as `message.thinking` (Qwen3's and most others as `reasoning_content`), and in a tool-calling turn
it must be sent back (harmony keeps the analysis of a turn that calls a tool). transformers fills `thinking` itself
only in recent releases (not in 5.17, which pyproject allows, where these tests fail without Ember setting it).
Upstage's Solar Open reads it as `message.reasoning` (as vLLM names it)."""
from __future__ import annotations

import pytest

from ember.server import chat
from ember.server import protocol_anthropic as pa
from ember.server import protocol_openai as po
from ember.server.responses_input import responses_messages
from tests.conftest import shared_path, write_shared_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"unit": {"type": "string"}}}}}]
ANALYSIS = "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
CALL = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"unit": "celsius"}<|call|>'


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from transformers import AutoTokenizer

    template = shared_path("templates", "llama.cpp", "openai-gpt-oss-120b.jinja").read_text()
    tokenizer = AutoTokenizer.from_pretrained(write_shared_tokenizer("gpt-oss", tmp_path_factory.mktemp("gpt-oss")))
    return tokenizer, template


def _openai():
    return chat.openai_messages([po.ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]])


def _anthropic():
    body = pa.CountTokensRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the weather.", "signature": "x"},
            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"unit": "celsius"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "18C"}]}]})
    return chat.anthropic_messages(body.system, body.messages)


def _responses():
    return responses_messages([
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Need the weather."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"unit": "celsius"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"}])


@pytest.mark.parametrize("api", [_openai, _anthropic, _responses])
def test_gpt_oss_renders_the_analysis_of_a_tool_calling_turn(gpt_oss, api):
    tokenizer, template = gpt_oss
    prompt = chat.render(tokenizer, template, api(), tools=TOOLS)
    assert ANALYSIS + CALL in prompt
    assert prompt == chat.render(tokenizer, template, _openai(), tools=TOOLS)


@pytest.mark.parametrize("api", [_openai, _anthropic, _responses])
def test_solar_open_renders_the_reasoning_of_a_tool_calling_turn(tmp_path_factory, api):
    from transformers import AutoTokenizer

    template = shared_path("templates", "llama.cpp", "upstage-Solar-Open-100B.jinja").read_text()
    tokenizer = AutoTokenizer.from_pretrained(write_shared_tokenizer("qwen3", tmp_path_factory.mktemp("qwen3")))
    prompt = chat.render(tokenizer, template, api(), tools=TOOLS)
    assert "<|begin|>assistant<|think|>Need the weather.<|end|>" in prompt
