"""Anthropic histories rendered as the Messages API reads them: consecutive messages of one role are one turn (so
alternating templates render them and a prefill split in two continues as one), tool results reach the template in
the order of the calls they answer (templates that print no ids pair them by position), and a call without a result
or a result without a call is a 400 in Anthropic's words."""
from __future__ import annotations

import anthropic
import pytest

from ember.server import chat
from ember.server import protocol_anthropic as pa
from ember.server.errors import ApiError
from tests.conftest import shared_path, write_shared_tokenizer

CALLS = {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
    {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {"zone": "CET"}}]}
WEATHER = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}
TIME = {"type": "tool_result", "tool_use_id": "toolu_2", "content": "12:00"}


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(write_shared_tokenizer("qwen3", tmp_path_factory.mktemp("qwen3")))


def _template(*parts: str) -> str:
    return shared_path("templates", *parts).read_text()


def _render(tokenizer, template: str, messages: list[dict]) -> str:
    body = pa.CountTokensRequest.model_validate({"model": "m", "messages": messages})
    final = messages[-1]["role"] == "assistant"
    return chat.render(tokenizer, template, chat.anthropic_messages(body.system, body.messages),
                       add_generation_prompt=not final, continue_final_message=final)


def _text(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


def test_consecutive_messages_of_a_role_are_one_turn(qwen3_tokenizer):
    qwen3 = _template("hf", "Qwen3-0.6B.jinja")
    split = [{"role": "user", "content": "a"}, {"role": "user", "content": _text("b")}]
    assert _render(qwen3_tokenizer, qwen3, split) == _render(qwen3_tokenizer, qwen3, [
        {"role": "user", "content": _text("a", "b")}])
    prefill = _render(qwen3_tokenizer, qwen3, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"},
                                               {"role": "assistant", "content": "B"}])
    assert prefill.count("<|im_start|>assistant") == 1 and prefill.endswith("A\nB")  # one reply, continued
    nemo = _template("llama.cpp", "mistralai-Mistral-Nemo-Instruct-2407.jinja")  # refuses roles that do not alternate
    assert "[INST]a\nb[/INST]" in _render(qwen3_tokenizer, nemo, split)


def test_tool_results_reach_the_template_in_call_order(qwen3_tokenizer):
    qwen3 = _template("hf", "Qwen3-0.6B.jinja")
    ask = {"role": "user", "content": "Weather and time in Paris?"}
    swapped = _render(qwen3_tokenizer, qwen3, [ask, CALLS, {"role": "user", "content": [TIME, WEATHER]}])
    assert swapped == _render(qwen3_tokenizer, qwen3, [ask, CALLS, {"role": "user", "content": [WEATHER, TIME]}])
    assert swapped.index("<tool_response>\nSunny") < swapped.index("<tool_response>\n12:00")


@pytest.mark.parametrize("answer,param,message", [
    ({"role": "user", "content": [WEATHER, *_text("and the time?")]}, "messages[1].content",
     "`tool_use` ids were found without `tool_result` blocks immediately after: toolu_2. Each `tool_use` block must "
     "have a corresponding `tool_result` block in the next message."),
    ({"role": "user", "content": [WEATHER, TIME, {**TIME, "tool_use_id": "toolu_9"}]},
     "messages[2].content[2].tool_use_id",
     "unexpected `tool_use_id` found in `tool_result` blocks: toolu_9. Each `tool_result` block must have a "
     "corresponding `tool_use` block in the previous message."),
], ids=["call-without-result", "result-without-call"])
def test_unpaired_calls_and_results_are_refused_naming_the_message(answer, param, message):
    body = pa.CountTokensRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather and time in Paris?"}, CALLS, answer]})
    with pytest.raises(ApiError) as refused:
        chat.anthropic_messages(body.system, body.messages)
    assert (refused.value.param, refused.value.message) == (param, message)


def test_the_sdk_gets_the_400_for_an_unanswered_call(demo_server):
    with pytest.raises(anthropic.BadRequestError) as refused:
        demo_server.anthropic().messages.create(model=demo_server.model, max_tokens=4, messages=[
            {"role": "user", "content": "Weather?"}, CALLS, {"role": "user", "content": [TIME]}])
    assert "without `tool_result` blocks immediately after: toolu_1." in refused.value.body["error"]["message"]


def test_a_tool_search_result_of_tool_references_reaches_the_template(qwen3_tokenizer):
    """Claude Code's tool search answers with `tool_reference` blocks (the SDK's type): each becomes its block's JSON
    in the tool message, beside the result's text; `defer_loading` tools are in the prompt from the start."""
    qwen3 = _template("hf", "Qwen3-0.6B.jinja")
    search = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "tool_search",
                                                "input": {"query": "weather"}}]}
    found = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
        {"type": "text", "text": "Found:"}, {"type": "tool_reference", "tool_name": "get_weather"}]}]}
    text = _render(qwen3_tokenizer, qwen3, [{"role": "user", "content": "Weather?"}, search, found])
    assert '<tool_response>\nFound:\n{"type": "tool_reference", "tool_name": "get_weather"}\n</tool_response>' in text
