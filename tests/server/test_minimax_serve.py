"""MiniMax-M2 served end to end: a tiny random MiniMax-M2 whose tokenizer has MiniMax's special tokens as single
tokens, behind the real MiniMax-M2 chat template. The reply starts in the thought the template opens; the grammar
ends it at the thinking budget and forces the call; the `minimax_m2` parser makes it an OpenAI tool call; the call
and its result render back through the template."""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import save_with_tokenizer, shared_path
from tests.moe.test_minimax_m2 import CONFIG
from tests.server.conftest import served

SPECIALS = ["<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>", "[e~[", "]~b]", "]~!b["]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "strict": True,
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string", "maxLength": 12},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                             "required": ["city", "days"], "additionalProperties": False}}}


def _tokenizer(demo_model_dir, out):
    """The demo vocabulary with MiniMax's specials appended as single special tokens; `[e~[` ends a turn."""
    from tokenizers import AddedToken, Tokenizer

    out.mkdir()
    tok = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
    cfg.pop("added_tokens_decoder", None)
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "[e~["}))
    return out, {t: tok.token_to_id(t) for t in SPECIALS}


@pytest.fixture(scope="module")
def minimax_server(tmp_path_factory, demo_model_dir):
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    from ember.server.config import ServeConfig

    template = shared_path("templates", "llama.cpp", "MiniMax-M2.jinja").read_text()
    root = tmp_path_factory.mktemp("tiny-minimax-serve")
    tok_dir, ids = _tokenizer(demo_model_dir, root / "tok")
    torch.manual_seed(0)
    model = MiniMaxM2ForCausalLM(MiniMaxM2Config(**{**CONFIG, "vocab_size": 1296, "max_position_embeddings": 2048,
                                                    "bos_token_id": None,
                                                    "eos_token_id": ids["[e~["]}))
    path = save_with_tokenizer(model, root / "model", tok_dir)
    config = ServeConfig(model_dir=path, served_model_name="tiny-minimax", max_num_seqs=4, kv_cache_blocks=64,
                         chat_template=template, in_process=True)
    with served(config) as server:
        yield server


def test_a_forced_call_is_an_openai_tool_call_and_renders_back(minimax_server):
    server = minimax_server
    client = server.openai()
    assert server.runtime.parser.profile.name == "minimax_m2"
    messages = [{"role": "user", "content": "Weather in Paris for three days?"}]
    kw = dict(model=server.model, messages=messages, tools=[TOOL], max_tokens=120, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}},
              extra_body={"max_thinking_tokens": 4})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    [call] = msg.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "days"}
    assert isinstance(args["city"], str) and 1 <= args["days"] <= 7
    assert r.choices[0].finish_reason == "stop" and msg.content in (None, "")
    assert isinstance(msg.reasoning_content, str)  # the thought the template's generation prompt opened
    streamed = list(client.chat.completions.create(**kw, stream=True))
    pieces = [tc.function.arguments or "" for ch in streamed for c in ch.choices for tc in c.delta.tool_calls or []]
    assert "".join(pieces) == call.function.arguments
    follow = client.chat.completions.create(model=server.model, tools=[TOOL], max_tokens=1, messages=messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                              "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens
