"""XML-style parameter values (Qwen3-Coder, MiniMax-M2, GLM-4.5) typed by the tool's JSON schema: which values stream
as JSON strings, the JSON text of a value written whole at its close tag, and `XmlValue`, which writes one value into
the open call's arguments."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Protocol
from urllib.parse import unquote

from .python_literals import JSON_NUMBER, PythonArgs


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
        elif isinstance(node, list) and token.isascii() and token.isdigit() and (token == "0" or token[0] != "0") \
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


_NULLS = ("null", "none")
"""How a value that is JSON null is written (case-insensitive): JSON's spelling, and Python's (the Qwen3.5 and
Seed-OSS templates render a None argument as ``None``)."""

_DECODER = json.JSONDecoder()


def typed_json(raw: str, types: tuple[str, ...], untyped: bool = False) -> str:
    """The JSON text of a whole non-string value: see `typed_value`; else a JSON string."""
    v = typed_value(raw, types, untyped)
    return json.dumps(raw, ensure_ascii=False) if v is None else v


def typed_value(raw: str, types: tuple[str, ...], untyped: bool = False) -> str | None:
    """The JSON text (strict RFC 8259: no NaN or Infinity) of ``raw``, its surrounding whitespace stripped, as the
    first declared type it converts to, or None. ``integer`` and ``number`` take what Python's int()/float() read
    (``+1``, ``.5``, ``1_000``; an integral number is written as an integer); ``object`` and ``array`` take JSON,
    else a Python literal (``{'k': True}``, as vLLM's literal_eval fallback). A value of no declared type converts
    only with ``untyped`` (GLM): JSON, else a Python literal. ``null``/``None`` (any case) that no type took is null."""
    v = raw.strip()
    for t in types:
        if t == "integer":
            try:
                return str(int(v))
            except ValueError:
                pass
        elif t == "number":
            num = _number(v)
            if num is not None:
                return num
        elif t == "boolean":
            if v.lower() in ("true", "false"):
                return v.lower()
        elif t == "null":
            if v.lower() in _NULLS:
                return "null"
        elif t in ("object", "array"):
            found = _any_json(v)
            if found is not None and found.startswith("{" if t == "object" else "["):
                return found
    if untyped and not types:
        return _any_json(v)
    return "null" if v.lower() in _NULLS else None


def _number(v: str) -> str | None:
    """JSON text of a number: ``v`` itself where it is a JSON number (also one past a double's range, `1e999`, which
    a strict tool's grammar allows: it stays a number, as the JSON-argument families write it), else the finite
    number int() or float() read (integral floats as integers)."""
    if JSON_NUMBER.fullmatch(v):
        return v
    try:
        return str(int(v))
    except ValueError:
        pass
    try:
        f = float(v)
    except ValueError:
        return None
    if not math.isfinite(f):
        return None
    return str(int(f)) if f.is_integer() else json.dumps(f)


def _any_json(v: str) -> str | None:
    """JSON text of ``v`` read as strict JSON (``v`` itself), else as a Python literal (`_literal`); None when
    neither reads it."""
    try:
        json.loads(v, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return _literal(v)
    return v


def _literal(v: str) -> str | None:
    """JSON text of the Python literal ``v`` (str, int, float, True/False/None, list, tuple as a list, dict), read by
    `PythonArgs` (never eval; linear, scalars bounded), or None."""
    src = f"v={v})"
    scan = PythonArgs()
    used, out = scan.feed(src)
    head = '"v": '
    if scan.error is not None or not scan.done or used != len(src) or not out.startswith(head):
        return None
    try:
        _, end = _DECODER.raw_decode(out, len(head))
    except (ValueError, RecursionError):
        return None
    return out[len(head):end] if out[end:] == "}" else None


class Emitter(Protocol):
    """Where `XmlValue` writes: the parser machine's emitting helpers."""

    def drop(self, text: str, reason: str) -> None: ...

    def args(self, fragment: str) -> None: ...


class XmlValue:
    """The parameter values of an XML-style call, each written into the open call's JSON arguments (one instance per
    syntax, so per choice). A value whose schema allows a string is keyed when it opens and streams as a JSON string;
    another is written whole, key and all, when it closes (`typed_value`, else a string). A value whose types allow
    both a string and null is held while it may still spell ``null``/``None``: written as null when it closes so,
    else streamed as a string. With ``untyped`` (GLM), a value of no declared type is written whole as JSON or a
    Python literal, else a string.

    Value text that may begin ``close`` (the value's close tag; with ``newline``, Qwen3-Coder's template newline
    before it, and the one after the open tag, too; with ``trim``, any whitespace around the value, as MiniMax-M2's
    and GLM's parsers strip it) is withheld: it is value text when more follows (or, but for that padding, the tag
    closes the value), and markup (Dropped) when the output ends there. A call cut there holds no markup, and a
    non-string value cut before it converts is left out (its key was never written), so what streamed is the final
    arguments."""

    def __init__(self, out: Emitter, close: str, *, newline: bool = False, trim: bool = False,
                 untyped: bool = False) -> None:
        self._out = out
        self._close = close
        self._newline = newline
        self._trim = trim
        self._untyped = untyped
        self.n_keys = 0                      # keys written in the open call (reset when a call starts)
        self._key = ""
        self._types: tuple[str, ...] = ()
        self._str = True
        self._nullable = False               # a string-or-null value not yet keyed: it may still spell null
        self._start = False
        self._held = ""                      # text that may begin the close tag (and Qwen3-Coder's newline)
        self._pad: list[str] = []            # with ``trim``: whitespace at the value's end so far
        self._buf: list[str] = []            # a non-string value's raw pieces, or a nullable one's so far

    def open(self, key: str, types: tuple[str, ...]) -> None:
        """A value of parameter ``key`` of the open call begins; ``types`` are its declared JSON types."""
        self._key, self._types = key, types
        self._str = streams_as_string(types) and not (self._untyped and not types)
        self._nullable = self._str and "null" in types
        self._start, self._held, self._buf, self._pad = self._newline or self._trim, "", [], []
        if self._str and not self._nullable:
            self._write_key('"')

    def text(self, s: str) -> None:
        """Text of the value."""
        if self._start:
            lead = len(s) - len(s.lstrip()) if self._trim else int(s.startswith("\n"))
            self._out.drop(s[:lead], "value padding" if self._trim else "template newline")
            s = s[lead:]
            self._start = self._trim and not s
        s = self._held + s
        keep = len(s) - self._markup_tail(s)
        self._held = s[keep:]
        if self._trim:
            self._padded(s[:keep])
        else:
            self._put(s[:keep])

    def _padded(self, s: str) -> None:
        """``trim``: value text whose trailing whitespace is withheld until non-space text follows it (each character
        looked at once, however long the run)."""
        body = s.rstrip()
        if body:
            self._put("".join(self._pad) + body)
            self._pad = []
        if len(body) < len(s):
            self._pad.append(s[len(body):])

    def close(self, at_finish: bool) -> None:
        """The value ends: at its close tag or another construct (``at_finish`` False), or where the output ended."""
        out = self._out
        held, self._held = self._held, ""
        if not at_finish and self._trim:
            self._padded(held)
            pad, self._pad = "".join(self._pad), []
            out.drop(pad, "value padding")
        elif not at_finish:
            body = held[:-1] if self._newline and held.endswith("\n") else held
            self._put(body)
            out.drop(held[len(body):], "template newline")
        else:
            held = "".join(self._pad) + held
        self._pad = []
        if self._nullable:
            raw, self._buf, self._nullable = "".join(self._buf), [], False
            end = "" if at_finish else '"'
            self._write_key("null" if raw.lower() in _NULLS else '"' + escape(raw) + end)
        elif self._str:
            if not at_finish:
                out.args('"')
        else:
            raw, self._buf = "".join(self._buf), []
            value = typed_value(raw, self._types, self._untyped)
            if value is None and not at_finish:
                value = json.dumps(raw.strip() if self._trim else raw, ensure_ascii=False)
            if value is None:
                out.drop(raw, "non-string value cut short")
            else:
                self._write_key(value)
        if at_finish:
            out.drop(held, "parameter close tag cut short")

    def _markup_tail(self, s: str) -> int:
        """How many characters at the end of ``s`` may begin the close tag (a proper prefix of it, after a newline
        with ``newline``)."""
        close = self._close
        n = 0
        for i in range(max(0, len(s) - len(close) + 1), len(s)):
            if s[i] == close[0] and close.startswith(s[i:]):
                n = len(s) - i
                break
        if self._newline and s.endswith("\n", 0, len(s) - n):
            n += 1
        return n

    def _put(self, text: str) -> None:
        if not text:
            return
        if self._nullable:
            self._buf.append(text)
            raw = "".join(self._buf)
            if len(raw) <= 4 and any(n.startswith(raw.lower()) for n in _NULLS):
                return
            self._buf, self._nullable = [], False
            self._write_key('"' + escape(raw))
        elif self._str:
            self._out.args(escape(text))
        else:
            self._buf.append(text)

    def _write_key(self, value: str) -> None:
        self._out.args(("{" if self.n_keys == 0 else ", ") + json.dumps(self._key, ensure_ascii=False) + ": " + value)
        self.n_keys += 1
