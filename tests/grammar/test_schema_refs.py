"""Tool schemas with references inside the grammars that embed them, and grammars whose lexer gives up.

Each test drives a request's constraint token by token with the real llguidance (Qwen3 tokenizer; the demo model's
where ../shared is absent), as the engine does.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from ember.grammar import GrammarError, compile_request
from ember.parsers.initial import InitialState
from ember.parsers.profiles import PROFILE_NAMES, get_profile
from ember.parsers.tokens import profile_delimiter_ids

ADDRESS = {
    "type": "object",
    "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                       "required": ["city"], "additionalProperties": False}},
    "definitions": {"Zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
    "properties": {"home": {"$ref": "#/$defs/Addr"}, "zip": {"$ref": "#/definitions/Zip"},
                   "work": {"$ref": "#/properties/home"},
                   "tag": {"const": {"$ref": "#/$defs/Addr"}}},
    "required": ["home", "zip"], "additionalProperties": False}
TREE = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "ship", "parameters": ADDRESS}},
         {"type": "function", "function": {"name": "tree", "parameters": TREE}}]
FORCED = ["required", {"type": "function", "function": {"name": "tree"}}, {"type": "any"},
          {"type": "tool", "name": "ship"}]


def constraint(hf_tok, backend, family: str, **request):
    profile = get_profile(family)
    plan = compile_request(profile, InitialState.CONTENT, profile_delimiter_ids(hf_tok, profile), thinking=False,
                           **request)
    return backend.constraint(plan)


def takes(hf_tok, c, text: str) -> bool:
    """Whether the constraint accepts ``text`` whole and may then end (EOS)."""
    ids = hf_tok.encode(text, add_special_tokens=False) + [hf_tok.convert_tokens_to_ids("<|im_end|>")]
    return all(c.accept_token(t) for t in ids)


def hermes_call(name: str, arguments: dict) -> str:
    return '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>\n' % (name, json.dumps(arguments))


@pytest.mark.parametrize("family", [n for n in PROFILE_NAMES if get_profile(n).tool_format is not None])
@pytest.mark.parametrize("choice", FORCED, ids=["required", "named", "any", "tool"])
def test_forced_calls_with_schema_references_compile_in_every_family(hf_tok, backend, family, choice):
    constraint(hf_tok, backend, family, tools=TOOLS, tool_choice=choice)


@pytest.mark.parametrize("choice", ["required", {"type": "tool", "name": "ship"}])
def test_forced_call_arguments_follow_the_tools_own_definitions(hf_tok, backend, choice):
    good = {"home": {"city": "Oslo"}, "zip": "123", "work": {"city": "Rome"}, "tag": {"$ref": "#/$defs/Addr"}}
    jsonschema.validate(good, ADDRESS)
    assert takes(hf_tok, constraint(hf_tok, backend, "qwen3", tools=TOOLS, tool_choice=choice),
                 hermes_call("ship", good))
    for bad in ({"home": {"city": 7}, "zip": "123"}, {"home": {"city": "Oslo"}, "zip": "12a"},
                {"home": {"city": "Oslo"}, "zip": "123", "work": {"town": "Rome"}},
                {"home": {"city": "Oslo"}, "zip": "123", "tag": {"$ref": "#/anyOf/0/properties/arguments/$defs"
                                                                          "/Addr"}}):
        c = constraint(hf_tok, backend, "qwen3", tools=TOOLS, tool_choice=choice)
        assert not takes(hf_tok, c, hermes_call("ship", bad)), bad


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "tree"}}])
def test_a_recursive_tool_schema_nests_itself_not_the_call(hf_tok, backend, choice):
    tree = {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}, {"v": 4}]}
    assert takes(hf_tok, constraint(hf_tok, backend, "qwen3", tools=TOOLS, tool_choice=choice),
                 hermes_call("tree", tree))
    wrapper_kid = {"v": 1, "kids": [{"name": "tree", "arguments": {"v": 2}}]}
    c = constraint(hf_tok, backend, "qwen3", tools=TOOLS, tool_choice=choice)
    assert not takes(hf_tok, c, hermes_call("tree", wrapper_kid))


def test_xml_parameters_resolve_references_against_the_tool_schema(hf_tok, backend):
    """Qwen3-Coder writes each parameter on its own: a parameter's `$ref` still means the tool's definition."""
    c = constraint(hf_tok, backend, "qwen3_coder", tools=TOOLS, tool_choice={"type": "tool", "name": "tree"})
    call = '<tool_call>\n<function=tree>\n<parameter=v>\n1\n</parameter>\n<parameter=kids>\n%s\n</parameter>\n' \
           '</function>\n</tool_call>'
    assert takes(hf_tok, c, call % json.dumps([{"v": 2, "kids": [{"v": 3}]}]))
    c = constraint(hf_tok, backend, "qwen3_coder", tools=TOOLS, tool_choice={"type": "tool", "name": "tree"})
    assert not takes(hf_tok, c, call % json.dumps([{"v": "two"}]))


XML_CALLS = {
    "qwen3_coder": ("<tool_call>\n<function=ship>\n", "<parameter=%s>\n%s\n</parameter>\n",
                    "</function>\n</tool_call>"),
    "glm45": ("<tool_call>ship\n", "<arg_key>%s</arg_key>\n<arg_value>%s</arg_value>\n", "</tool_call>"),
}


@pytest.mark.parametrize("family", sorted(XML_CALLS))
def test_xml_parameters_that_are_bare_references_are_typed_by_the_schema_they_name(hf_tok, backend, family):
    """``home`` is only ``{"$ref": "#/$defs/Addr"}``: an object, so JSON of the tool's Addr, never raw text (the
    parser parses it as JSON); ``zip`` names a string, so it is raw text, as the parser streams it."""
    head, param, tail = XML_CALLS[family]

    def call(home: str) -> str:
        return head + param % ("home", home) + param % ("zip", "123") + tail

    choice = {"type": "tool", "name": "ship"}
    assert takes(hf_tok, constraint(hf_tok, backend, family, tools=TOOLS, tool_choice=choice),
                 call(json.dumps({"city": "Oslo"})))
    for bad in ("Oslo", json.dumps({"city": 7}), json.dumps({"town": "Oslo"})):
        c = constraint(hf_tok, backend, family, tools=TOOLS, tool_choice=choice)
        assert not takes(hf_tok, c, call(bad)), bad


def step(backend, c, token: int) -> bool:
    """One engine step: the batch's mask filled, then the sampled token accepted."""
    backend.bitmask_filler()([c], torch.zeros(1, (backend.vocab_size + 31) // 32, dtype=torch.int32))
    return c.accept_token(token)


# A single bounded repetition so long that llguidance's lexer runs out of fuel on its second character.
HUGE = "b{100002}"


def test_a_grammar_whose_lexer_gives_up_is_a_bad_request(hf_tok, backend):
    profile = get_profile("qwen3")
    plan = compile_request(profile, InitialState.REASONING, profile_delimiter_ids(hf_tok, profile),
                           response_format={"type": "regex", "regex": HUGE})
    with pytest.raises(GrammarError, match=r"^response_format: invalid structured-output grammar: lexer error"):
        backend.constraint(plan)
    with pytest.raises(GrammarError, match="^response_format: "):
        backend.constraint(plan)  # the same request again: still refused, never admitted half-broken


def test_a_schema_that_fails_only_past_a_thought_is_a_bad_request(hf_tok, backend):
    """``{"$ref": "#"}`` fails at the answer's first token: after ``</think>`` the admission walk takes the answer's
    first solid token, not whitespace (which used up its steps, so the request was admitted and failed mid-reply)."""
    profile = get_profile("qwen3")
    fmt = {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}
    for initial in (InitialState.CONTENT, InitialState.REASONING):
        plan = compile_request(profile, initial, profile_delimiter_ids(hf_tok, profile), response_format=fmt)
        with pytest.raises(GrammarError, match=r"^response_format: invalid structured-output grammar"):
            backend.constraint(plan)


def test_a_lexer_failure_past_admission_fails_its_request_and_not_the_next(hf_tok, backend):
    """The lexer gives up only after a 40-character prefix (past what admission walks): that request ends with an
    error, EOS included, and an identical request gets a fresh grammar instead of an EOS-only mask."""
    grammar = '%llguidance {}\nstart: "' + "x" * 40 + '" WS ANS\nANS: /' + HUGE + '/\nWS: /[ \\t]{0,8}/\n'
    request = {"response_format": {"type": "grammar", "grammar": grammar}}
    prefix = [hf_tok.convert_tokens_to_ids("x")] * 40
    b = hf_tok.convert_tokens_to_ids("b")
    eos = hf_tok.convert_tokens_to_ids("<|im_end|>")
    for _ in range(2):
        c = constraint(hf_tok, backend, "qwen3", **request)
        assert all(step(backend, c, t) for t in prefix), c.error_message()
        assert step(backend, c, b)
        assert not step(backend, c, b)
        assert "lexer error" in c.error_message()
        assert not step(backend, c, eos) and not c.is_terminated()


@pytest.mark.parametrize("family", sorted(XML_CALLS))
def test_a_text_parameters_pattern_is_enforced_and_an_unenforceable_one_refused_when_strict(hf_tok, backend, family):
    """`zip` (`^[0-9]{3}$`) is written as raw text in the XML formats: its pattern was dropped (any text passed); an
    unanchored pattern must occur somewhere in it. A pattern or format the text rule cannot hold is a 400 for a
    strict tool and dropped for a lenient one."""
    head, param, tail = XML_CALLS[family]
    home = param % ("home", json.dumps({"city": "Oslo"}))
    choice = {"type": "tool", "name": "ship"}
    for zip_code, ok in (("123", True), ("12a", False), ("1234", False), ("\n\n", False)):
        c = constraint(hf_tok, backend, family, tools=TOOLS, tool_choice=choice)
        assert takes(hf_tok, c, head + home + param % ("zip", zip_code) + tail) == ok, zip_code

    def tools_with(zip_schema: dict, strict: bool) -> list[dict]:
        ship = {**ADDRESS, "definitions": {"Zip": {"type": "string", **zip_schema}}}
        return [{"type": "function", "function": {"name": "ship", "parameters": ship, "strict": strict}}]

    for zip_code, ok in (("x-42-y", True), ("x-4-y", False)):
        c = constraint(hf_tok, backend, family, tools=tools_with({"pattern": "-[0-9]{2}-"}, True), tool_choice=choice)
        assert takes(hf_tok, c, head + home + param % ("zip", zip_code) + tail) == ok, zip_code
    for unenforceable in ({"pattern": "^a|b$"}, {"pattern": "(?=a)a"}, {"format": "date"}):
        with pytest.raises(GrammarError):
            constraint(hf_tok, backend, family, tools=tools_with(unenforceable, True), tool_choice=choice)
        constraint(hf_tok, backend, family, tools=tools_with(unenforceable, False), tool_choice=choice)
