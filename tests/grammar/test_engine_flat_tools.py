"""Forced tool calls (`tool_choice` required / named) in Llama 3 JSON, Mistral and pythonic syntax, sampled by the
engine from a tiny random-weight model through the grammar's bitmask and parsed back by the parsers.

None of these families' vocabularies is under ../shared/data: the model uses the real Qwen3 vocabulary with Llama 3's,
Llama 4's and Mistral's control tokens added as single special tokens (so `[ARGS]` is a token and Mistral calls take
the v11+ `[TOOL_CALLS]NAME[ARGS]{..}` form); the grammar-only tests use plain Qwen3, where they are text."""
from __future__ import annotations

import json

from ember.grammar import GrammarBackend, compile_request
from ember.parsers.pipeline import ParserSetup, parse_all
from tests.grammar.test_engine import TOOLS
from tests.grammar.test_engine_section_tools import _check, _engine, _forced, _tokenizer

LLAMA = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
         "<|python_tag|>", "<|python_start|>", "<|python_end|>")
MISTRAL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "</s>")
LLAMA_PROMPT = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nSet an alarm or check the weather."
                "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama3_json_mistral_and_pythonic_forced_calls_parse_back(tmp_path):
    tok = _tokenizer("qwen3", LLAMA + MISTRAL)
    eos = [tok.token_to_id(t) for t in ("<|eot_id|>", "</s>", "<|endoftext|>")]
    backend, engine = _engine(tmp_path, tok, eos)
    results = _forced(tok, backend, engine, eos, [("llama3_json", LLAMA_PROMPT), ("pythonic", LLAMA_PROMPT),
                                                  ("mistral", "[INST]Set an alarm or check the weather.[/INST]")])
    by = {}
    for r in results:
        by.setdefault(r[0].profile.name, []).append(r)
    _check(tok, by["llama3_json"], '"parameters": ')
    _check(tok, by["pythonic"], "(")
    _check(tok, by["mistral"], "[ARGS]")


def _accepts(tok, backend, plan, text: str, eos) -> bool:
    c = backend.constraint(plan)
    return all(c.accept_token(t) for t in tok.encode(text, add_special_tokens=False).ids + eos)


def test_grammars_take_the_native_forms_and_refuse_bad_arguments():
    tok = _tokenizer("qwen3")
    eos = [tok.token_to_id("<|endoftext|>")]
    backend = GrammarBackend.from_tokenizer(tok, eos_ids=eos)

    def plan(profile, **kw):
        setup = ParserSetup.from_tokenizer(tok, profile)
        return setup, compile_request(setup.profile, setup.initial_state([]), setup.delimiter_ids, tools=TOOLS, **kw)

    weather = {"city": "Oslo", "unit": "celsius"}
    alarm = {"hour": 7, "label": "up"}
    # Llama 3: bare objects separated by "; "
    setup, p = plan("llama3_json", tool_choice="required")
    both = (json.dumps({"name": "get_weather", "parameters": weather}) + "; "
            + json.dumps({"name": "set_alarm", "parameters": alarm}))
    assert _accepts(tok, backend, p, both, eos)
    assert not _accepts(tok, backend, p, json.dumps({"name": "get_weather", "parameters": {"city": "Oslo"}}), eos)
    ids = tok.encode(both, add_special_tokens=False).ids
    got = parse_all(setup.pipeline(initial=setup.initial_state([]), tools=TOOLS), ids).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in got] == [("get_weather", weather), ("set_alarm", alarm)]
    # Mistral without an [ARGS] token: the JSON list
    setup, p = plan("mistral", tool_choice="required")
    listed = "[TOOL_CALLS][" + json.dumps({"name": "get_weather", "arguments": weather}) + "]"
    assert _accepts(tok, backend, p, listed, eos)
    assert not _accepts(tok, backend, p, "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(weather), eos)
    got = parse_all(setup.pipeline(initial=setup.initial_state([]), tools=TOOLS),
                    tok.encode(listed, add_special_tokens=False).ids).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in got] == [("get_weather", weather)]
    # pythonic: keyword literals, optional ones may be left out, booleans as True/False
    setup, p = plan("pythonic", tool_choice={"type": "function", "function": {"name": "set_alarm"}})
    call = '[set_alarm(hour=7, label="up", repeat=True)]'
    assert _accepts(tok, backend, p, call, eos)
    assert _accepts(tok, backend, p, '[set_alarm(hour=7, label="up", days=["mon"])]', eos)
    assert not _accepts(tok, backend, p, '[set_alarm(label="up")]', eos)
    assert not _accepts(tok, backend, p, '[set_alarm(hour=70, label="up")]', eos)
    got = parse_all(setup.pipeline(initial=setup.initial_state([]), tools=TOOLS),
                    tok.encode(call, add_special_tokens=False).ids).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in got] == [("set_alarm", {**alarm, "repeat": True})]
    # auto with strict tools: free text, or calls at the start (the only place the parser reads them)
    setup, p = plan("llama3_json", tool_choice="auto")
    assert _accepts(tok, backend, p, "It is sunny.", eos)
    assert _accepts(tok, backend, p, json.dumps({"name": "get_weather", "parameters": weather}), eos)
    assert not _accepts(tok, backend, p, json.dumps({"name": "get_weather", "parameters": {}}), eos)
