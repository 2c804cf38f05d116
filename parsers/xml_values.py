"""Qwen3-Coder parameter values typed by the tool's JSON schema: which values stream as JSON strings, and the JSON
text of a value written whole at `</parameter>`."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from urllib.parse import unquote


_MAX_DEPTH = 64
"""Subschemas and references followed inside one another for one value's types at most."""


class _GiveUp(Exception):
    """A reference met again while the types it names are being worked out, or subschemas nested past `_MAX_DEPTH`:
    the value's types are left undeclared."""


def parameter_types(tools: Sequence[dict] | None) -> dict[str, dict[str, tuple[str, ...]]]:
    """tool name -> parameter name -> the JSON schema types declared for it (empty when undeclared), local references
    (`#`, `#/...`) followed within the tool's parameters schema."""
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") or {}
        root = params if isinstance(params, Mapping) else {}
        props = root.get("properties")
        out[fn["name"]] = {key: schema_types(schema, root) for key, schema in (props or {}).items()}
    return out


def schema_types(schema: object, root: Mapping) -> tuple[str, ...]:
    """The JSON types ``schema`` declares (``type``, ``anyOf``/``oneOf``, ``enum``, ``const``, else its ``$ref`` or
    ``allOf``), its local references resolved in ``root`` (the tool's parameters); empty when it declares none, or
    when its references loop or do not resolve."""
    try:
        return _types(schema, root, {}, 0)
    except _GiveUp:
        return ()


def resolved(schema: Mapping, root: Mapping) -> Mapping:
    """``schema`` with its own chain of local references followed to the schema they name (``schema``'s other
    keywords kept over it); ``schema`` itself when it has none, or they loop or do not resolve."""
    out: dict = dict(schema)
    seen: set[int] = set()
    while isinstance(out.get("$ref"), str):
        root = _resource(out, root)
        target = _target(out.pop("$ref"), root)
        if target is None or id(target) in seen:
            return schema
        seen.add(id(target))
        out = {**target, **out}
    return out


_Named = dict[tuple[int, int], tuple[str, ...] | None]
"""(target, root) -> the types a reference names there; None while they are being worked out."""


def _types(schema: object, root: Mapping, named: _Named, depth: int) -> tuple[str, ...]:
    if not isinstance(schema, Mapping):
        return ()
    if depth > _MAX_DEPTH:
        raise _GiveUp
    root = _resource(schema, root)
    t = schema.get("type")
    if isinstance(t, str):
        return (t,)
    if isinstance(t, list):
        return tuple(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return tuple(dict.fromkeys(x for sub in schema[key] for x in _types(sub, root, named, depth + 1)))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return _value_types(schema["enum"])
    if "const" in schema:
        return _value_types([schema["const"]])
    if isinstance(schema.get("$ref"), str):
        target = _target(schema["$ref"], root)
        found = _named_types(target, root, named, depth + 1) if target is not None else ()
        if found:
            return found
    for sub in schema.get("allOf") if isinstance(schema.get("allOf"), list) else ():
        found = _types(sub, root, named, depth + 1)
        if found:
            return found
    return ()


def _named_types(target: Mapping, root: Mapping, named: _Named, depth: int) -> tuple[str, ...]:
    """The types of a reference's ``target``, worked out once per value however many references name it; a reference
    back to a target still being worked out gives up."""
    key = (id(target), id(root))
    if key not in named:
        named[key] = None
        named[key] = _types(target, root, named, depth)
    found = named[key]
    if found is None:
        raise _GiveUp
    return found


def _resource(schema: Mapping, root: Mapping) -> Mapping:
    """The schema that ``#`` means inside ``schema``: itself where it has an ``$id`` of its own, else ``root``."""
    own_id = schema.get("$id")
    return schema if isinstance(own_id, str) and not own_id.startswith("#") else root


def _target(ref: str, root: Mapping) -> Mapping | None:
    """The schema a local reference names in ``root`` (an RFC 6901 pointer in a URI fragment), or None."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node: object = root
    for token in unquote(ref[2:]).split("/") if ref != "#" else ():
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and (token == "0" or token[0] != "0") \
                and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node if isinstance(node, Mapping) else None


def _value_types(values: list) -> tuple[str, ...]:
    return tuple(sorted({_json_type(v) for v in values}))


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


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def typed_json(raw: str, types: tuple[str, ...]) -> str:
    """The JSON text of a whole non-string value: the first declared type it converts to (as strict RFC 8259 JSON:
    no NaN or Infinity), else a JSON string."""
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
                parsed = json.loads(v, parse_constant=_reject_constant)
            except ValueError:
                continue
            if isinstance(parsed, dict if t == "object" else list):
                return v
    return json.dumps(raw, ensure_ascii=False)
