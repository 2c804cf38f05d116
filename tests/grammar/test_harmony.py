"""gpt-oss harmony grammars on the real o200k_harmony tokenizer and recorded gpt-oss tool-call streams."""
from __future__ import annotations

import gzip
import json

import pytest

from ember.grammar import GrammarBackend, compile_request
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import ParserSetup, parse_all
from tests.conftest import shared_path

TOOLS = [
    {"type": "function", "function": {"name": "get_tourist_attractions", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_current_time_nyc", "strict": True, "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def harmony():
    from tokenizers import Tokenizer

    raw = gzip.decompress(shared_path("tokenizers", "gpt-oss", "tokenizer.json.gz").read_bytes()).decode()
    tok = Tokenizer.from_str(raw)
    eos = [tok.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|endoftext|>")]
    return tok, GrammarBackend.from_tokenizer(tok, eos_ids=eos), ParserSetup.from_tokenizer(tok, "gpt_oss")


def _recorded():
    rec = json.loads(shared_path("outputs", "dynamo", "derived", "stream_token_ids.json").read_text())
    return [v for k, v in sorted(rec.items()) if k.startswith("gpt-oss")]


def test_recorded_gpt_oss_tool_calls_are_accepted_and_parse_back(harmony):
    tok, backend, setup = harmony
    for stream in _recorded():
        ids = stream["token_ids"]
        name = stream["tool_calls"][0]["function"]["name"]
        for choice in ("required", "auto", {"type": "function", "function": {"name": name}}):
            plan = compile_request(setup.profile, InitialState.CONTENT, setup.delimiter_ids, tools=TOOLS,
                                   tool_choice=choice)
            c = backend.constraint(plan)
            assert all(c.accept_token(t) for t in ids), c.error_message()
            assert c.matcher.is_stopped(), "the call ends the turn: only EOS (<|call|>) may follow"
        calls = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS), ids).tool_calls
        assert [(c.name, c.arguments) for c in calls] == [(name, stream["tool_calls"][0]["function"]["arguments"])]


def test_harmony_grammar_refuses_other_tools_and_bad_arguments(harmony):
    tok, backend, setup = harmony
    plan = compile_request(setup.profile, InitialState.CONTENT, setup.delimiter_ids, tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "get_tourist_attractions"}})
    head = tok.encode("<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary "
                      "to=functions.").ids

    def accepted(text: str) -> bool:
        c = backend.constraint(plan)
        return all(c.accept_token(t) for t in head + tok.encode(text).ids)

    assert accepted('get_tourist_attractions <|constrain|>json<|message|>{"city":"Kyoto"}')
    assert not accepted('get_current_time_nyc <|constrain|>json<|message|>{}')
    assert not accepted('get_tourist_attractions <|constrain|>json<|message|>{"town":"Kyoto"}')
    final = compile_request(setup.profile, InitialState.CONTENT, setup.delimiter_ids,
                            response_format={"type": "json_object"})
    c = backend.constraint(final)
    ids = tok.encode('<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>final<|message|>{"a":1}').ids
    assert all(c.accept_token(t) for t in ids) and c.matcher.is_stopped()
