"""Schema integers past 2^53, which llguidance reads as doubles: an output it allowed would not be the schema's value,
so such a schema is a 400 naming its field instead of a reply that silently breaks it."""
from __future__ import annotations

import pytest

from ember.grammar import GrammarError, compile_request
from ember.parsers.initial import InitialState
from ember.parsers.profiles import get_profile

BIG = 2 ** 53 + 1


def _compile(**request):
    return compile_request(get_profile("hermes"), InitialState.CONTENT, {}, **request)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"id": {"const": BIG}}, "required": ["id"]},
    {"type": "integer", "minimum": BIG, "maximum": BIG},
    {"enum": [1, 2, -BIG]},
    {"const": {"deep": [BIG]}},
])
def test_integers_past_2_53_are_refused_naming_the_field(schema):
    with pytest.raises(GrammarError) as e:
        _compile(response_format={"type": "json_schema", "json_schema": {"schema": schema, "strict": True}})
    assert e.value.message.startswith("response_format") and str(BIG).lstrip("-") in e.value.message
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": schema}}}}]
    with pytest.raises(GrammarError) as e:
        _compile(tools=tools, tool_choice="required")
    assert e.value.message.startswith("tools[0].function.parameters")


def test_exact_integers_and_big_annotations_still_compile():
    schema = {"type": "object", "properties": {"id": {"const": 2 ** 53, "description": "x", "default": BIG},
                                               "n": {"type": "integer", "examples": [BIG]}}}
    assert _compile(response_format={"type": "json_schema", "json_schema": {"schema": schema}}) is not None
