"""vLLM's `structured_outputs.disable_additional_properties` through the real compile path (answer format ->
`compile_request` -> llguidance, Qwen3 tokenizer; the demo model's where ../shared is absent): an object schema is
closed wherever a schema can appear, so the answer may not add a key to it, and the objects it describes still pass.
"""
from __future__ import annotations

import json

import pytest

from ember.grammar import compile_request
from ember.parsers.initial import InitialState
from ember.parsers.profiles import get_profile
from ember.server.answer_format import _from_structured_outputs
from ember.server.protocol_openai import StructuredOutputs

INNER = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
GOOD, EXTRA = {"x": 1}, {"x": 1, "extra": 2}

# (schema holding INNER somewhere, answer with ``inner`` in that place)
PLACES = {
    "additionalProperties": ({"type": "object", "additionalProperties": INNER}, lambda inner: {"k": inner}),
    "patternProperties": ({"type": "object", "patternProperties": {"^k": INNER}}, lambda inner: {"k": inner}),
    "properties": ({"type": "object", "properties": {"k": INNER}}, lambda inner: {"k": inner}),
    "items": ({"type": "array", "items": INNER}, lambda inner: [inner]),
    "prefixItems": ({"type": "array", "prefixItems": [INNER]}, lambda inner: [inner]),
    "additionalItems": ({"type": "array", "items": [{"type": "integer"}], "additionalItems": INNER},
                        lambda inner: [0, inner]),
    "anyOf": ({"anyOf": [INNER, {"type": "integer"}]}, lambda inner: inner),
    "$defs": ({"$defs": {"o": INNER}, "$ref": "#/$defs/o"}, lambda inner: inner),
    "definitions": ({"definitions": {"o": INNER}, "type": "array", "items": {"$ref": "#/definitions/o"}},
                    lambda inner: [inner]),
    "nullable object": ({"type": "object", "properties": {"k": {"type": ["object", "null"]}}},
                        lambda inner: {"k": {} if inner is GOOD else {"extra": 2}}),
}


def _takes(hf_tok, backend, schema: dict, answer) -> bool:
    rf = _from_structured_outputs(StructuredOutputs(json=schema, disable_additional_properties=True))
    plan = compile_request(get_profile("none"), InitialState.CONTENT, {}, response_format=rf)
    c = backend.constraint(plan)
    ids = hf_tok.encode(json.dumps(answer), add_special_tokens=False) + [backend.eos_ids[0]]
    return all(c.accept_token(t) for t in ids)


@pytest.mark.parametrize("place", list(PLACES))
def test_objects_are_closed_wherever_a_schema_can_appear(hf_tok, backend, place):
    schema, answer = PLACES[place]
    assert _takes(hf_tok, backend, schema, answer(GOOD))
    assert not _takes(hf_tok, backend, schema, answer(EXTRA))


def test_closing_leaves_data_and_what_the_schema_says_alone():
    """``const``/``enum``/``default``/``examples`` hold values, not schemas; a boolean ``additionalProperties``
    and non-schema ``dependencies`` stay as written; schema-valued keywords get closed."""
    value = {"type": "object", "properties": {"a": {"type": "object"}}}
    schema = {"type": "object", "const": value, "enum": [value], "default": value, "examples": [value],
              "additionalProperties": True, "dependencies": {"a": ["b"], "c": INNER},
              "not": INNER, "if": INNER, "then": INNER, "else": INNER, "propertyNames": {"type": "string"},
              "dependentSchemas": {"d": INNER}, "unevaluatedProperties": INNER,
              "contains": INNER, "unevaluatedItems": False}
    out = _from_structured_outputs(StructuredOutputs(json=schema, disable_additional_properties=True))
    out = out["json_schema"]["schema"]
    for key in ("const", "default"):
        assert out[key] == value
    assert out["enum"] == [value] and out["examples"] == [value]
    assert out["additionalProperties"] is True and out["unevaluatedItems"] is False
    assert out["dependencies"]["a"] == ["b"] and out["dependencies"]["c"]["additionalProperties"] is False
    assert out["propertyNames"] == {"type": "string"}
    for key in ("not", "if", "then", "else", "unevaluatedProperties", "contains"):
        assert out[key]["additionalProperties"] is False, key
    assert out["dependentSchemas"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in INNER  # the request's own schema is not modified


@pytest.mark.parametrize("counted", [
    {"type": "object", "patternProperties": {"^[ab]$": {"type": "integer"}}, "additionalProperties": False,
     "minProperties": 2},
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
    {"type": "object", "properties": {"o": {"type": "object", "minProperties": 1}}},
])
def test_a_strict_property_count_over_keys_that_may_repeat_is_refused(counted):
    """llguidance may write a key matched by patternProperties or additionalProperties twice ({"a": -4, "a": 3}):
    strict, a property count over such keys would not hold in the parsed object, so it is a 400 naming the field;
    lenient, and over named keys only, it compiles."""
    from ember.grammar import GrammarError

    def compile_(schema, strict=True):
        return compile_request(get_profile("hermes"), InitialState.CONTENT, {}, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}})

    with pytest.raises(GrammarError, match="^response_format.*minProperties/maxProperties"):
        compile_(counted)
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": counted}, "required": ["x"], "additionalProperties": False}}}]
    with pytest.raises(GrammarError, match=r"^tools\[0\].function.parameters"):
        compile_request(get_profile("hermes"), InitialState.CONTENT, {}, tools=tools, tool_choice="required")
    assert compile_(counted, strict=False) is not None
    named = {"type": "object", "properties": {"a": {"type": "integer"}, "minProperties": {"type": "integer"}},
             "additionalProperties": False, "minProperties": 1, "enum": [{"minProperties": 1}]}
    assert compile_(named) is not None


ZOD_EMAIL = r"^(?!\.)(?!.*\.\.)([A-Za-z0-9_'+\-\.]*)[A-Za-z0-9_+-]@([A-Za-z0-9][A-Za-z0-9\-]*\.)+[A-Za-z]{2,}$"


def test_a_lenient_schema_drops_only_the_patterns_llguidance_cannot_read(hf_tok, backend):
    """zod's email pattern (look-aheads), a back-reference: OpenAI and Anthropic take such tools unless strict, so a
    lenient schema leaves those strings free (before, a forced call or a json_schema answer was a 400) while the
    patterns llguidance reads still hold; strict, the pattern is a 400 naming the field."""
    from ember.grammar import GrammarError

    schema = {"type": "object", "properties": {"email": {"type": "string", "pattern": ZOD_EMAIL},
                                               "code": {"type": "string", "pattern": "^[0-9]{3}$"}},
              "patternProperties": {r"^(a)\1$": {"type": "integer"}},
              "required": ["email", "code"], "additionalProperties": False}

    def plan(strict: bool, **request):
        return compile_request(get_profile("hermes"), InitialState.CONTENT, {}, **request) if request else \
            compile_request(get_profile("none"), InitialState.CONTENT, {}, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}})

    def takes(answer) -> bool:
        c = backend.constraint(plan(False))
        ids = hf_tok.encode(json.dumps(answer), add_special_tokens=False) + [backend.eos_ids[0]]
        return all(c.accept_token(t) for t in ids)

    assert takes({"email": "..@x", "code": "123"}) and not takes({"email": "a@b.co", "code": "12a"})
    tools = [{"type": "function", "function": {"name": "add_contact", "parameters": schema}}]
    assert plan(False, tools=tools, tool_choice="required") is not None
    with pytest.raises(GrammarError, match="^response_format"):
        backend.validate(plan(True).grammar)
    tools[0]["function"]["strict"] = True
    with pytest.raises(GrammarError, match=r"^tools\[0\].function.parameters"):
        plan(True, tools=tools, tool_choice="required")


def test_a_lenient_property_count_llguidance_refuses_is_ignored_not_a_400(hf_tok, backend):
    """At least two of three optional properties: llguidance calls it unsatisfiable, so a lenient schema (json_schema
    not strict, a non-strict tool) ignores the count rather than refusing the request, while a count llguidance
    takes (at least one) still holds; strict, it stays a 400."""
    from ember.grammar import GrammarError

    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in "abc"}, "minProperties": 2,
              "additionalProperties": False}

    def plan(schema, strict=False):
        return compile_request(get_profile("none"), InitialState.CONTENT, {}, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}})

    def takes(schema, answer) -> bool:
        c = backend.constraint(plan(schema))
        ids = hf_tok.encode(json.dumps(answer), add_special_tokens=False) + [backend.eos_ids[0]]
        return all(c.accept_token(t) for t in ids)

    assert takes(schema, {"a": 1, "c": 2}) and not takes(schema, {"a": 1, "d": 2})
    assert not takes({**schema, "minProperties": 1}, {})
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    backend.validate(compile_request(get_profile("hermes"), InitialState.CONTENT, {}, tools=tools,
                                     tool_choice="required").grammar)
    with pytest.raises(GrammarError, match="^response_format"):
        backend.validate(plan(schema, strict=True).grammar)
