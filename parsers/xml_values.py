"""Qwen3-Coder parameter values typed by the tool's JSON schema: which values stream as JSON strings, and the JSON
text of a value written whole at `</parameter>`."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence


def parameter_types(tools: Sequence[dict] | None) -> dict[str, dict[str, tuple[str, ...]]]:
    """tool name -> parameter name -> the JSON schema types declared for it (empty when undeclared)."""
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, Mapping) else None
        types: dict[str, tuple[str, ...]] = {}
        for key, schema in (props or {}).items():
            types[key] = _schema_types(schema)
        out[fn["name"]] = types
    return out


def _schema_types(schema: object) -> tuple[str, ...]:
    if not isinstance(schema, Mapping):
        return ()
    t = schema.get("type")
    if isinstance(t, str):
        return (t,)
    if isinstance(t, list):
        return tuple(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return tuple(x for sub in schema[key] for x in _schema_types(sub))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        kinds = {_json_type(v) for v in schema["enum"]}
        return tuple(sorted(kinds))
    return ()


def _json_type(v: object) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if v is None:
        return "null"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def streams_as_string(types: tuple[str, ...]) -> bool:
    """A value streams piece by piece as a JSON string when its schema allows a string or declares nothing."""
    return not types or "string" in types


def escape(piece: str) -> str:
    """JSON string-body escaping of a piece of a string value (escaping is per character, so pieces concatenate)."""
    return json.dumps(piece, ensure_ascii=False)[1:-1]


def typed_json(raw: str, types: tuple[str, ...]) -> str:
    """The JSON text of a whole non-string value: the first declared type it converts to, else a JSON string."""
    v = raw.strip()
    for t in types:
        if t == "integer":
            try:
                return str(int(v))
            except ValueError:
                pass
        elif t == "number":
            try:
                num = json.loads(v)
            except ValueError:
                num = None
            if isinstance(num, (int, float)) and not isinstance(num, bool) and math.isfinite(num):
                return v
        elif t == "boolean":
            if v.lower() in ("true", "false"):
                return v.lower()
        elif t == "null":
            if v.lower() in ("null", "none"):
                return "null"
        elif t in ("object", "array"):
            try:
                parsed = json.loads(v)
            except ValueError:
                continue
            if isinstance(parsed, dict if t == "object" else list):
                return v
    return json.dumps(raw, ensure_ascii=False)
