"""A request's answer format: OpenAI's `response_format`, or vLLM's `structured_outputs` (or the `guided_*` fields
it replaced in vLLM 0.12), as the one ``response_format`` mapping the grammar compiler reads
(`ember.grammar.compile_request`).

A request may set one of them; a second is a 400 naming it. Errors found later, while compiling, name the field the
value came from (``structured_outputs.regex``, ``guided_json``, ...): the mapping carries it as ``param``.
"""
from __future__ import annotations

import json
from typing import Any

from . import protocol_openai as po
from .errors import bad_request

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def answer_format(body: po._SamplingFields) -> dict[str, Any] | None:
    """The request's answer format (None: free text)."""
    sources: list[tuple[str, dict[str, Any]]] = []
    if body.response_format is not None and body.response_format.type != "text":
        sources.append(("response_format", _from_response_format(body.response_format)))
    if body.structured_outputs is not None:
        sources.append(("structured_outputs", _from_structured_outputs(body.structured_outputs)))
    guided = [name for name in GUIDED if getattr(body, name) is not None]
    if len(guided) > 1:
        raise bad_request(f"set only one of {', '.join(guided)}", param=guided[1])
    if guided:
        sources.append((guided[0], _from_guided(body, guided[0])))
    if len(sources) > 1:
        raise bad_request(f"set only one of {' and '.join(name for name, _ in sources)}: each fixes the answer's "
                          "format", param=sources[1][0])
    return sources[0][1] if sources else None


def _from_response_format(rf: po.ResponseFormat) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "grammar" if rf.type == "lark" else rf.type}
    if rf.json_schema is not None:
        out["json_schema"] = rf.json_schema.model_dump(by_alias=True, exclude_none=True)
    if rf.regex is not None:
        out["regex"] = rf.regex
    if rf.grammar is not None:
        out["grammar"] = rf.grammar
    if rf.type == "structural_tag":
        out["structures"], out["triggers"] = rf.structures, rf.triggers
    return out


def _structural_tag(value: Any, param: str) -> dict[str, Any]:
    """vLLM's ``structured_outputs.structural_tag``: the JSON text (or object) of ``{"type": "structural_tag",
    "structures": [...], "triggers": [...]}``."""
    value = _object(value, param, "an object with structures and triggers")
    if "format" in value and "structures" not in value:
        raise bad_request(f"{param}: the 'format' form of structural tags is not supported; send structures and "
                          "triggers", param=param)
    return {"type": "structural_tag", "structures": value.get("structures"), "triggers": value.get("triggers"),
            "param": param}


def _from_structured_outputs(so: po.StructuredOutputs) -> dict[str, Any]:
    if so.structural_tag is not None:
        out = _structural_tag(so.structural_tag, "structured_outputs.structural_tag")
    elif so.json_ is not None:
        out = _json(so.json_, "structured_outputs.json", so.disable_additional_properties)
    elif so.json_object:
        out = {"type": "json_object", "param": "structured_outputs.json_object"}
    elif so.regex is not None:
        out = {"type": "regex", "regex": so.regex, "param": "structured_outputs.regex"}
    elif so.choice is not None:
        out = {"type": "choice", "choice": so.choice, "param": "structured_outputs.choice"}
    else:
        out = {"type": "grammar", "grammar": so.grammar, "param": "structured_outputs.grammar"}
    if so.disable_any_whitespace:
        out["compact"] = True
    elif so.whitespace_pattern is not None:
        out["whitespace_pattern"] = so.whitespace_pattern
    return out


def _from_guided(body: po._SamplingFields, name: str) -> dict[str, Any]:
    value = getattr(body, name)
    if name == "guided_json":
        out = _json(value, name, False)
        if body.guided_whitespace_pattern is not None:
            out["whitespace_pattern"] = body.guided_whitespace_pattern
        return out
    kind = name.removeprefix("guided_")
    return {"type": kind, kind: value, "param": name}


def _object(value: Any, param: str, what: str) -> dict[str, Any]:
    """``value`` as a JSON object: itself, or parsed from JSON text; a 400 naming ``param`` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param=param) from None
        except RecursionError:
            raise bad_request(f"{param} is nested too deeply to parse", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be {what}", param=param)
    return value


def _json(schema: dict[str, Any] | str, param: str, closed: bool) -> dict[str, Any]:
    """A JSON-schema answer; ``schema`` may come as JSON text. ``closed``: objects that do not say otherwise get
    ``additionalProperties: false`` (vLLM's ``disable_additional_properties``)."""
    schema = _object(schema, param, "a JSON schema object")
    if closed:
        schema = _closed(schema)
    return {"type": "json_schema", "json_schema": {"schema": schema}, "param": param}


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
"""Keywords whose values map names to schemas (``dependencies``' lists of names are not schemas: left alone)."""
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
            "propertyNames", "unevaluatedItems", "unevaluatedProperties")
"""Keywords whose value is one schema (or a boolean, kept; ``items`` may also be a list of schemas). Data keywords
(``const``, ``enum``, ``default``, ``examples``) are values, never schemas: never touched."""


def _closed(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema without ``additionalProperties`` forbids extra keys, wherever
    a schema can appear (under ``properties``, ``items``, ``anyOf``, an object-valued ``additionalProperties``...)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _SCHEMAS:
        if key in out:
            out[key] = [_closed(s) for s in out[key]] if isinstance(out[key], list) else _closed(out[key])
    kind = out.get("type")
    objects = kind == "object" or (isinstance(kind, list) and "object" in kind)
    if ("properties" in out or objects) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
