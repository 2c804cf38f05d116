"""`answer_format`: vLLM's `disable_additional_properties` closes every object schema of a request's JSON schema,
nested ones included, and leaves a property that happens to be named like a keyword alone."""
from __future__ import annotations

from ember.server import protocol_openai as po
from ember.server.answer_format import answer_format


def _schema(extra: dict) -> dict:
    body = po.CompletionRequest(prompt="x", **extra)
    return answer_format(body)["json_schema"]["schema"]


def test_disable_additional_properties_closes_nested_objects_only():
    item = {"type": "object", "properties": {"v": {"type": "integer"}}}
    schema = {"type": "object",
              "properties": {"properties": {"type": "string"},  # a property named like the keyword
                             "list": {"type": "array", "items": item},
                             "either": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
                             "open": {"type": "object", "additionalProperties": True}},
              "$defs": {"point": {"properties": {"x": {"type": "number"}}}}}
    out = _schema({"structured_outputs": {"json": schema, "disable_additional_properties": True}})
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"] == {"type": "string"}
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert out["$defs"]["point"]["additionalProperties"] is False
    assert out["properties"]["either"]["anyOf"][1] == {"type": "null"}
    assert out["properties"]["open"]["additionalProperties"] is True  # what the schema says wins
    assert "additionalProperties" not in schema  # the request's own schema is not modified
    assert _schema({"structured_outputs": {"json": schema}}) == schema
