"""String formats a schema's output is held to: llguidance's ``hostname`` bounds each label but not the whole name,
so a strict schema let through names of thousands of characters; RFC 1123's 253 now bounds it, in strict and
lenient schemas, in answers and in tool arguments, under any tighter ``maxLength`` the schema sets."""
from __future__ import annotations

import json

import pytest

from ember.grammar import GrammarBackend, compile_request
from ember.parsers.pipeline import ParserSetup
from tests.grammar.test_engine_section_tools import _tokenizer


@pytest.fixture(scope="module")
def qwen3():
    tok = _tokenizer("qwen3")
    eos = [tok.token_to_id("<|endoftext|>")]
    return tok, eos, GrammarBackend.from_tokenizer(tok, eos_ids=eos), ParserSetup.from_tokenizer(tok, "hermes")


def _accepts(qwen3, text: str, **request) -> bool:
    tok, eos, backend, setup = qwen3
    plan = compile_request(setup.profile, setup.initial_state([]), setup.delimiter_ids, **request)
    c = backend.constraint(plan)
    return all(c.accept_token(t) for t in tok.encode(text, add_special_tokens=False).ids + eos)


def _answer(schema: dict, strict: bool) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": schema,
                                                                       "strict": strict}}}


LONGEST = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])  # 253 characters
TOO_LONG = LONGEST + "e"


@pytest.mark.parametrize("strict", [True, False])
def test_a_hostname_is_at_most_253_characters(qwen3, strict):
    host = {"type": "string", "format": "hostname"}
    assert len(LONGEST) == 253
    assert _accepts(qwen3, json.dumps(LONGEST), **_answer(host, strict))
    assert not _accepts(qwen3, json.dumps(TOO_LONG), **_answer(host, strict))
    assert not _accepts(qwen3, json.dumps("a" * 64 + ".com"), **_answer(host, strict))  # a label's own bound
    nested = {"type": "object", "properties": {"hosts": {"type": "array", "items": host}}, "required": ["hosts"]}
    assert _accepts(qwen3, json.dumps({"hosts": ["example.com", LONGEST]}), **_answer(nested, strict))
    assert not _accepts(qwen3, json.dumps({"hosts": [TOO_LONG]}), **_answer(nested, strict))
    tighter = {**host, "maxLength": 11}
    assert _accepts(qwen3, json.dumps("example.com"), **_answer(tighter, strict))
    assert not _accepts(qwen3, json.dumps("example.comx"), **_answer(tighter, strict))


def test_a_strict_tools_hostname_argument_is_bounded(qwen3):
    tools = [{"type": "function", "function": {"name": "ping", "strict": True, "parameters": {
        "type": "object", "properties": {"host": {"type": "string", "format": "hostname"}}, "required": ["host"],
        "additionalProperties": False}}}]

    def call(host: str) -> str:
        return "<tool_call>\n" + json.dumps({"name": "ping", "arguments": {"host": host}}) + "\n</tool_call>"

    assert _accepts(qwen3, call(LONGEST), tools=tools, tool_choice="required")
    assert not _accepts(qwen3, call(TOO_LONG), tools=tools, tool_choice="required")
