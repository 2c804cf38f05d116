"""Where the reply starts, from the prompt tail only: with rendered real chat templates and hand-built prompts."""
from __future__ import annotations

import json

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember.parsers.initial import InitialState, initial_state
from ember.parsers.profiles import get_profile
from ember.parsers.tokens import TokenBytes, profile_delimiter_ids
from tests.conftest import shared_path
from tests.parsers.test_tokens import demo_tokenizer, load_tokenizer

R, C = InitialState.REASONING, InitialState.CONTENT


def render(template_dir: str, messages: list[dict], **kwargs) -> str:
    """A chat template from ../shared rendered the way transformers renders it (sandboxed jinja, trim/lstrip)."""
    cfg = json.loads(shared_path("tokenizers", template_dir, "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    return env.from_string(cfg["chat_template"]).render(messages=messages, add_generation_prompt=True, **kwargs)


_TABLES: dict[int, TokenBytes] = {}


def table(tok) -> TokenBytes:
    if id(tok) not in _TABLES:
        _TABLES[id(tok)] = TokenBytes.from_tokenizer(tok)
    return _TABLES[id(tok)]


def state_of(tok, text: str, profile: str = "qwen3") -> InitialState:
    p = get_profile(profile)
    ids = tok.encode(text, add_special_tokens=False).ids
    return initial_state(ids, p, table(tok), profile_delimiter_ids(tok, p))


def _qwen3():
    return load_tokenizer("qwen3")


HISTORY = [
    {"role": "system", "content": "Think inside <think> tags. Example: <tool_call>\n{\"name\": \"x\"}\n</tool_call>"},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "<think>\nold thought\n</think>\n\nold answer"},
    {"role": "user", "content": "a question that mentions </think> and <think>"},
]


def test_qwen3_template_thinking_on_starts_in_content_and_may_open():
    tok = _qwen3()
    assert state_of(tok, render("qwen3", HISTORY)) == C
    assert state_of(tok, render("qwen3", HISTORY[-1:])) == C


def test_qwen3_template_thinking_off_injects_an_empty_thought():
    prompt = render("qwen3", HISTORY, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert state_of(_qwen3(), prompt) == C


def test_thinking_2507_template_opens_the_thought():
    prompt = render("qwen3-thinking-2507", HISTORY)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert state_of(_qwen3(), prompt) == R


def test_tool_examples_in_the_prompt_do_not_flip_the_state():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = HISTORY + [{"role": "assistant", "content": "",
                       "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                      {"role": "tool", "content": "sunny </think>"}]
    assert state_of(_qwen3(), render("qwen3-thinking-2507", msgs, tools=tools)) == R
    assert state_of(_qwen3(), render("qwen3", msgs, tools=tools)) == C


@pytest.fixture(params=["qwen3", "demo"])
def chatml_tok(request):
    return _qwen3() if request.param == "qwen3" else demo_tokenizer()


def test_history_never_matters(chatml_tok):
    open_history = "<|im_start|>assistant\n<think>\nunfinished<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert state_of(chatml_tok, open_history + "<|im_start|>assistant\n") == C
    closed_history = "<|im_start|>user\nhi</think><|im_end|>\n"
    assert state_of(chatml_tok, closed_history + "<|im_start|>assistant\n<think>\n") == R


def test_assistant_prefill_carries_its_thought_state(chatml_tok):
    head = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert state_of(chatml_tok, head + "<think>\nI am still think") == R
    assert state_of(chatml_tok, head + "<think>\nThought.\n</think>\n\nThe answer beg") == C
    assert state_of(chatml_tok, head + "</think>") == C
    assert state_of(chatml_tok, head + "Plain prefill") == C


def test_spelled_open_tag_in_the_tail_is_not_a_delimiter(chatml_tok):
    p = get_profile("qwen3")
    head = chatml_tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
    spelled = [i for piece in ("<th", "ink", ">\n") for i in chatml_tok.encode(piece, add_special_tokens=False).ids]
    tb = table(chatml_tok)
    assert tb.decode(spelled) == "<think>\n"
    dids = profile_delimiter_ids(chatml_tok, p)
    assert initial_state(head + spelled, p, tb, dids) == C
    real = chatml_tok.encode("<think>\n", add_special_tokens=False).ids
    assert initial_state(head + real, p, tb, dids) == R


def test_header_far_back_in_a_long_prompt(chatml_tok):
    prefill = "<think>\n" + "a long thought that goes on and on. " * 200
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + prefill
    assert len(chatml_tok.encode(prompt, add_special_tokens=False).ids) > 1000
    assert state_of(chatml_tok, prompt) == R
    assert state_of(chatml_tok, prompt + "</think>\n\n") == C


def test_no_header_uses_the_whole_prompt_last_delimiter_wins(chatml_tok):
    assert state_of(chatml_tok, "Question: why?\n<think>\n") == R
    assert state_of(chatml_tok, "<think>\nx</think>\nAnswer:") == C
    assert state_of(chatml_tok, "") == C


def test_no_header_an_open_the_prompt_does_not_end_in_is_text(chatml_tok):
    """`add_generation_prompt: false` leaves no generation header: a `<think>` in a system prompt or the user's
    text put the whole reply into the reasoning channel."""
    turns = "<|im_start|>system\nUse <think> tags<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
    assert state_of(chatml_tok, turns) == C
    assert state_of(chatml_tok, "<|im_start|>user\nExplain <think><|im_end|>\n") == C
    assert state_of(chatml_tok, turns + "<think>\n") == R


def test_deepseek_r1_on_deepseek_v3_vocab_matches_the_tags_as_text():
    tok = load_tokenizer("deepseek-v3")
    assert tok.token_to_id("<think>") is None
    head = "<｜begin▁of▁sentence｜><｜User｜>hi <think> there<｜Assistant｜>"
    assert state_of(tok, head, "deepseek_r1") == R           # template opens the thought: start_mode "always"
    assert state_of(tok, head + "<think>\n", "deepseek_r1") == R
    assert state_of(tok, head + "<think>\n\n</think>\n\n", "deepseek_r1") == C
    assert state_of(tok, head + "</think>", "deepseek_r1") == C


def test_profiles_without_reasoning_start_in_content():
    tok = load_tokenizer("gpt-oss")
    text = "<|start|>user<|message|>hi<|end|><|start|>assistant"
    assert state_of(tok, text, "gpt_oss") == C
    assert state_of(_qwen3(), "<|im_start|>assistant\n<think>\n", "hermes") == C
    assert state_of(_qwen3(), "<|im_start|>assistant\n<think>\n", "none") == C
