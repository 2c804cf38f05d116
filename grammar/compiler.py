"""From a request's structured-output settings to ONE llguidance grammar (design D, A.8, A.9).

Pure: no tokenizer; llguidance only for its tokenizer-free string helpers and a whitespace pattern's regex check.
Inputs are the request fields (``response_format``, ``tools``, ``tool_choice``, ``parallel_tool_calls``, a thinking
budget), the model family's `Profile`, the request's `InitialState` (the same value the parser starts from) and the
delimiter token IDs (terminal text -> single token ID, as `parsers.tokens.resolve_delimiters` found them; a terminal
absent from it is spelled as text).

The grammar is ``reasoning region, optional whitespace, answer``:

* initial state REASONING: free text that ends only at the close delimiter referenced by its token ID (``<[151668]>``),
  so ``</think>`` spelled in ordinary pieces stays reasoning and no special token (EOS included) can appear before it;
* initial state CONTENT with a profile whose model may open a thought itself: an optional ``<think> .. </think>``
  block (both by token ID) before the answer, which is what the parser does with a ``<think>`` token at the start,
  after a little whitespace (GLM-4.5 and Qwen3.5 write ``\n<think>``; the parser drops it there, a JSON reader
  skips it before an answer);
* the answer: a JSON schema, a regex, a user Lark grammar, or tool calls in the family's native syntax.

A thinking budget is not part of the grammar (a ``max_tokens=`` lexeme option would break rollback); it travels in
`GrammarPlan.budget` and the matcher enforces it by allowing only the close delimiter once it is spent.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ember.parsers.initial import InitialState
from ember.parsers.profiles import Profile
from ember.parsers.profiles.base import REASONING as REASONING_STATE
from ember.parsers.xml_values import resolved, schema_types, streams_as_string

__all__ = ["GrammarError", "GrammarPlan", "ThinkingBudget", "compile_request", "build_grammar", "JSON_OPTIONS",
           "answer_field"]


class GrammarError(ValueError):
    """A request's structured-output settings cannot be turned into a grammar; the message names the field and the
    problem (the server answers 400 with it)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class ThinkingBudget:
    """At most ``tokens`` generated tokens inside the thought; once spent only ``close_id`` may be sampled.

    ``open_id`` (when the model may open a thought itself) and ``close_id`` are the same delimiter token IDs the parser
    switches on; ``implicit_end_ids`` end the thought too (a `<tool_call>` token inside it, as the profile says);
    ``starts_in_reasoning`` is the request's initial state.
    """

    tokens: int
    close_id: int
    open_id: int | None
    starts_in_reasoning: bool
    implicit_end_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class GrammarPlan:
    """What constrains one request: an llguidance grammar (None: the tokens are free) and/or a thinking budget."""

    grammar: str | None
    budget: ThinkingBudget | None
    field: str = "response_format"   # the request field the grammar comes from, for error messages


JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON layout of structured answers and Hermes tool calls: ``{"a": 1, "b": [2, 3]}``, as the Qwen/Hermes templates
render tool calls (Jinja ``tojson``). Flexible whitespace lets a model pad JSON with newlines forever; a schema's own
``x-guidance`` overrides these."""

_HARMONY_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
"""gpt-oss writes compact JSON (its recorded tool arguments: ``{"city":"Tokyo"}``); used for its answers too."""

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
"""A tool name: Anthropic's length limit (OpenAI's is 64), as MCP tools named the Claude Code way
(``mcp__<server>__<tool>``) often pass 64 characters."""

_TEXT = "/(?s:.*)/"
_WS = "/[ \\t\\r\\n]{0,8}/"
"""Whitespace after the thought and between tool calls: what models emit ("\\n\\n"), bounded so that a model can
never pad forever."""


# ---------------------------------------------------------------------------------------------------- request parsing

@dataclass(frozen=True)
class _Tool:
    name: str
    parameters: dict
    strict: bool
    index: int = 0   # its place in the request's tools, for error messages


def _tools(tools: Sequence[Mapping] | None) -> list[_Tool]:
    out: list[_Tool] = []
    seen: set[str] = set()
    for i, t in enumerate(tools or ()):
        if not isinstance(t, Mapping):
            raise GrammarError(f"tools[{i}] must be an object")
        fn = t.get("function", t) if t.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping):
            raise GrammarError(f"tools[{i}].type must be 'function'")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise GrammarError(f"tools[{i}].function.name must match {_TOOL_NAME.pattern}, got {name!r}")
        if name in seen:
            raise GrammarError(f"tools[{i}].function.name {name!r} is not unique")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = fn.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise GrammarError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append(_Tool(name, dict(params), bool(fn.get("strict", False)), i))
    return out


# ------------------------------------------------------------------------------------------ embedded tool schemas

_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON data, never schemas: a ``$ref`` inside them is a value, not a reference."""

_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose values map names (any string, ``const`` or ``$ref`` included) to schemas."""


def _pointer(*tokens: str | int) -> str:
    """The JSON pointer of ``tokens`` as a URI fragment (RFC 6901: ``~0``, ``~1``, then percent-encoding)."""
    return "".join("/" + quote(str(t).replace("~", "~0").replace("/", "~1"), safe="!$&'()*+,;=:@~")
                   for t in tokens)


def _edited(schema: Any, edit: Callable[[Mapping], Mapping | None]) -> Any:
    """A copy of ``schema`` where each subschema is first replaced by ``edit(subschema)`` (None: kept as it is, with
    everything under it), then has its own subschemas edited: every value but those of data keywords, names in
    schema maps (``properties``, ``$defs``, ...) not being keywords. The one walk `_rebased`,
    `_readable_patterns` and `_check_counted_open_objects` take."""
    if isinstance(schema, list):
        return [_edited(s, edit) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    node = edit(schema)
    if node is None:
        return dict(schema)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {name: _edited(sub, edit) for name, sub in value.items()}
        else:
            out[key] = _edited(value, edit)
    return out


def _rebased(schema: Any, prefix: str) -> Any:
    """A copy of ``schema`` that means the same once embedded at the JSON pointer ``prefix`` of a larger document:
    each local reference (``#`` or ``#/...``) gets ``prefix`` in front. References under a nested ``$id`` (a
    resource of its own, whose ``#`` is itself) and the values of data keywords are kept as they are."""
    def rebase(node: Mapping) -> Mapping | None:
        own_id, ref = node.get("$id"), node.get("$ref")
        if isinstance(own_id, str) and not own_id.startswith("#"):
            return None
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            return {**node, "$ref": "#" + prefix + ref[1:]}
        return node

    return _edited(schema, rebase)


def _has_local_refs(schema: Any) -> bool:
    """Whether ``schema`` holds a local reference that moving it would change (`_rebased` would rewrite)."""
    return _rebased(schema, "/x") != schema


def _param_schema(tool: _Tool, name: str, schema: Mapping) -> Mapping:
    """Parameter ``name``'s schema as a root of its own: ``schema`` itself, or (when the tool's schema holds local
    references) a reference to it inside the whole tool schema, so ``#/$defs/...`` and ``#`` keep their meaning."""
    if not _has_local_refs(tool.parameters):
        return schema
    return {"$defs": {"tool": _rebased(tool.parameters, _pointer("$defs", "tool"))},
            "$ref": "#" + _pointer("$defs", "tool", "properties", name)}


def _choice(tool_choice: str | Mapping | None, tools: list[_Tool]) -> tuple[str, str | None, frozenset[str] | None]:
    """("none" | "auto" | "required" | "named", the named tool's name, the tools calls may name: OpenAI's
    ``allowed_tools``, else None for all), from OpenAI's or Anthropic's shapes."""
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "allowed_tools":
        return _allowed(tool_choice, tools)
    mode, named = _mode(tool_choice, tools)
    return mode, named, None


def _allowed(tool_choice: Mapping, tools: list[_Tool]) -> tuple[str, None, frozenset[str]]:
    """OpenAI's ``allowed_tools`` choice, chat's (``{"allowed_tools": {"mode", "tools"}}``) or the Responses API's
    flat shape (``{"mode", "tools"}``; a tool ``{"type": "function", "name"}``)."""
    spec = tool_choice.get("allowed_tools", tool_choice)
    mode = spec.get("mode") if isinstance(spec, Mapping) else None
    if mode not in ("auto", "required"):
        raise GrammarError(f"tool_choice.allowed_tools.mode must be 'auto' or 'required', got {mode!r}")
    listed = spec.get("tools")
    if not isinstance(listed, list) or not listed:
        raise GrammarError("tool_choice.allowed_tools.tools must list at least one tool")
    known, names = {x.name for x in tools}, set()
    for i, t in enumerate(listed):
        fn = t.get("function") if isinstance(t, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else t.get("name") if isinstance(t, Mapping) else None
        if not isinstance(name, str) or name not in known:
            raise GrammarError(f"tool_choice.allowed_tools.tools[{i}] names no function in tools ({name!r})")
        names.add(name)
    return mode, None, frozenset(names)


def _mode(tool_choice: str | Mapping | None, tools: list[_Tool]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named tool's name) of any other tool_choice."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise GrammarError(f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                               f"got {tool_choice!r}")
        if tool_choice == "required" and not tools:
            raise GrammarError("tool_choice 'required' needs at least one entry in tools")
        return tool_choice, None
    if isinstance(tool_choice, Mapping):
        kind = tool_choice.get("type")
        if kind in ("auto", "none", "required", "any"):  # Anthropic's shapes; "any" is OpenAI's "required"
            return _mode("required" if kind == "any" else kind, tools)
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")  # Anthropic {"type": "tool"}
        if not isinstance(name, str):
            raise GrammarError("tool_choice.function.name is missing")
        if name not in {t.name for t in tools}:
            raise GrammarError(f"tool_choice names function {name!r}, which is not in tools")
        return "named", name
    raise GrammarError(f"tool_choice must be a string or an object, got {type(tool_choice).__name__}")


def check_tools(tools: Sequence[Mapping] | None, tool_choice: str | Mapping | None = None) -> None:
    """Raises the `GrammarError` that `compile_request` would raise for these ``tools`` and ``tool_choice`` (a bad
    or repeated name, a choice naming no tool), without building a grammar: for endpoints that take tools but
    generate nothing (Anthropic's count_tokens)."""
    _choice(tool_choice, _tools(tools))


def _with_options(schema: Mapping, options: Mapping[str, Any], lenient: bool) -> dict:
    """A copy of ``schema`` with our JSON layout (and leniency) as defaults under its top-level ``x-guidance``;
    lenient, without the regexes llguidance cannot read (`_readable_patterns`), and without the property counts
    (``minProperties``, ``maxProperties``) where llguidance refuses the schema with them but takes it without."""
    x = dict(options)
    if lenient:
        x["lenient"] = True
    user = schema.get("x-guidance")
    if isinstance(user, Mapping):
        x.update(user)
    schema = _edited(schema, _bounded_hostname)
    if not lenient:
        return {**schema, "x-guidance": x}
    out = {**_readable_patterns(schema), "x-guidance": x}
    if _counts_properties(out) and _schema_problem(_dumps(out)):
        uncounted = {**_edited(out, _uncounted), "x-guidance": x}
        if not _schema_problem(_dumps(uncounted)):
            return uncounted
    return out


HOSTNAME_MAX = 253
"""RFC 1123's bound on a whole host name: llguidance's ``hostname`` format bounds each label (63) but not the name."""


def _bounded_hostname(node: Mapping) -> Mapping:
    """``node`` with ``format: hostname`` also bounded by `HOSTNAME_MAX` characters."""
    if node.get("format") != "hostname":
        return node
    most = node.get("maxLength")
    bounded = most if isinstance(most, int) and not isinstance(most, bool) and most < HOSTNAME_MAX else HOSTNAME_MAX
    return {**node, "maxLength": bounded}


def _dumps(schema: Mapping) -> str:
    """JSON of ``schema`` as `_schema_problem` caches it (NaN and Infinity let through, for the caller to refuse)."""
    return json.dumps(schema, ensure_ascii=False)


def _counts_properties(schema: Any) -> bool:
    found = False

    def look(node: Mapping) -> Mapping:
        nonlocal found
        found = found or "minProperties" in node or "maxProperties" in node
        return node

    _edited(schema, look)
    return found


def _uncounted(node: Mapping) -> Mapping:
    """``node`` without ``minProperties`` and ``maxProperties`` (llguidance refuses some satisfiable ones: two of
    three optional properties, "Unsatisfiable schema: minProperties (2) is greater than number of properties (0)")."""
    return {k: v for k, v in node.items() if k not in ("minProperties", "maxProperties")}


@functools.lru_cache(maxsize=1024)
def _regex_readable(pattern: str) -> bool:
    """Whether llguidance reads ``pattern`` (look-around, back-references and ``\\b`` it does not)."""
    try:
        _check_regex(pattern, "pattern")
    except GrammarError:
        return False
    return True


def _readable_patterns(schema: Any) -> Any:
    """``schema`` without the ``pattern`` keywords and ``patternProperties`` entries whose regex llguidance cannot
    read, as a lenient schema ignores what it cannot enforce (OpenAI and Anthropic take such tools unless strict;
    zod's email pattern has look-aheads): the string is then free, the key falls to ``additionalProperties``."""
    def readable(node: Mapping) -> Mapping:
        out = {k: v for k, v in node.items() if not (k == "pattern" and isinstance(v, str) and not _regex_readable(v))}
        named = out.get("patternProperties")
        if isinstance(named, Mapping):
            out["patternProperties"] = {regex: sub for regex, sub in named.items() if _regex_readable(regex)}
        return out

    return _edited(schema, readable)


def _json_rule(schema: Mapping, options: Mapping[str, Any] = JSON_OPTIONS, lenient: bool = False,
               where: str = "tools") -> str:
    """``%json`` of ``schema``; a `GrammarError` naming ``where`` (the request field of the schema) when it is not
    JSON (NaN or Infinity, which Python's JSON reader lets through). Tool schemas are checked one by one first
    (`_check_tool_schemas`), which names the tool; ``tools`` is the fallback."""
    try:
        body = json.dumps(_with_options(schema, options, lenient), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"{where} is not JSON: {e}") from None
    _check_integers(schema, where)
    if not lenient:
        _check_counted_open_objects(schema, where)
    return "%json " + body


_EXACT_INT = 2 ** 53
_VALUE_KEYWORDS = frozenset({"const", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                             "multipleOf"})


def _check_integers(schema: Any, where: str) -> None:
    """A `GrammarError` naming ``where`` when a value the output must match (``const``, ``enum``) or a bound holds an
    integer beyond 2^53: llguidance reads schema numbers as doubles, so it would allow a neighbouring value
    instead (9007199254740993 comes out as ...992)."""
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, is_value = stack.pop()
        if isinstance(node, int) and not isinstance(node, bool):
            if is_value and abs(node) > _EXACT_INT:
                raise GrammarError(f"{where} holds the integer {node}, beyond 2^53, which structured output cannot "
                                   f"match exactly (send it as a string)")
        elif isinstance(node, Mapping):
            stack.extend((v, is_value or k in _VALUE_KEYWORDS) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, is_value) for v in node)


def _check_counted_open_objects(schema: Any, where: str) -> None:
    """A `GrammarError` naming ``where`` when a strict schema bounds the property count (``minProperties``,
    ``maxProperties``) of an object whose keys are not all named (``patternProperties``, or ``additionalProperties``
    not false): llguidance may write such a key twice, which counts twice there but once in the parsed object, so
    the bound would not hold."""
    def check(node: Mapping) -> Mapping:
        counted = "minProperties" in node or "maxProperties" in node
        if counted and ("patternProperties" in node or node.get("additionalProperties", True) is not False):
            raise GrammarError(f"{where}: minProperties/maxProperties need an object whose keys are all named in "
                               "properties (additionalProperties: false, no patternProperties): keys matched "
                               "otherwise may repeat in strict output")
        return node

    _edited(schema, check)


def _check_tool_schemas(tools: Sequence[_Tool]) -> None:
    """A `GrammarError` naming ``tools[i].function.parameters`` for the first tool schema that is not JSON (NaN,
    Infinity) or that llguidance refuses on its own (an unknown type, no value satisfies it): checked per tool, so
    that the error names the tool rather than the call grammar the schemas go into."""
    for t in tools:
        try:
            body = json.dumps(_with_options(t.parameters, JSON_OPTIONS, not t.strict), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"tools[{t.index}].function.parameters is not JSON: {e}") from None
        _check_integers(t.parameters, f"tools[{t.index}].function.parameters")
        if t.strict:
            _check_counted_open_objects(t.parameters, f"tools[{t.index}].function.parameters")
        problem = _schema_problem(body)
        if problem:
            raise GrammarError(f"tools[{t.index}].function.parameters is not a usable JSON schema: {problem}")


@functools.lru_cache(maxsize=512)
def _schema_problem(schema_json: str) -> str | None:
    """Why llguidance cannot compile this JSON schema (its first message), or None."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.grammar_from("json", schema_json))
    return (messages[0] if messages else "invalid schema") if is_error else None


def _lit(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text, ensure_ascii=False)


class _Lark:
    """Accumulates named rules; ``start`` is written first."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        self.subgrammars: list[tuple[str, str]] = []

    def add(self, name: str, body: str, attrs: str = "") -> str:
        self.rules[name + attrs] = body
        return name

    def source(self, start: str) -> str:
        lines = ["%llguidance {}", f"start: {start}"]
        lines += [f"{k}: {v}" for k, v in self.rules.items()]
        lark = "\n".join(lines) + "\n"
        if not self.subgrammars:
            return lark
        grammars: list[dict[str, str]] = [{"lark_grammar": lark}]
        grammars += [{"name": n, "lark_grammar": g} for n, g in self.subgrammars]
        return json.dumps({"grammars": grammars}, ensure_ascii=False)


class _Delims:
    """Terminal name -> Lark fragment: ``<[id]>`` for a single-token delimiter, a quoted literal otherwise."""

    def __init__(self, profile: Profile, delimiter_ids: Mapping[str, int]) -> None:
        self.profile = profile
        self.ids = delimiter_ids

    def id(self, name: str) -> int | None:
        text = self.profile.terminals.get(name)
        if text is None or name not in self.profile.token_id_terminals:
            return None
        return self.ids.get(text)

    def ref(self, name: str) -> str:
        tid = self.id(name)
        if tid is not None:
            return f"<[{tid}]>"
        text = self.profile.terminals.get(name)
        if text is None:
            raise GrammarError(f"profile {self.profile.name!r} has no terminal {name!r}")
        return _lit(text)


# ------------------------------------------------------------------------------------------------------------ answers

def _response_format_answer(g: _Lark, rf: Mapping | None, options: Mapping[str, Any]) -> str | None:
    """The answer rule of ``response_format`` in the family's JSON layout, None for plain text.

    Beside OpenAI's types: ``regex``, ``grammar`` (Lark, or GBNF as llama.cpp and xgrammar write it) and ``choice``
    (``choice``: a list of strings, the answer is exactly one). A ``param`` key names the request field the value
    came from when it is not ``response_format`` (vLLM's ``structured_outputs.regex``, ``guided_regex``, ...);
    ``whitespace_pattern`` (a regex) and ``compact`` override the JSON layout."""
    if rf is None:
        return None
    if not isinstance(rf, Mapping):
        raise GrammarError("response_format must be an object")
    param = rf.get("param")

    def name(key: str) -> str:
        return param or f"response_format.{key}"

    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind in ("json_object", "json_schema"):
        options = _json_layout(options, rf)
    if kind == "json_object":
        return g.add("answer", _json_rule({"type": "object"}, options, where=name("json_object")))
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping):
            raise GrammarError(f"{name('json_schema')} must be an object")
        schema = js.get("schema", js.get("schema_", {}))
        where = param or "response_format.json_schema.schema"
        if not isinstance(schema, Mapping):
            raise GrammarError(f"{where} must be a JSON schema object")
        strict = bool(js.get("strict", False))
        return g.add("answer", _json_rule(schema, options, lenient=not strict, where=where))
    if kind == "regex":
        pattern = rf.get("regex", rf.get("pattern"))
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"{name('regex')} must be a non-empty string")
        g.subgrammars.append(("user_regex", "start: " + _regex_literal(pattern, name("regex")) + "\n"))
        return g.add("answer", "@user_regex")
    if kind == "grammar":
        text = rf.get("grammar")
        if not isinstance(text, str) or not text.strip():
            raise GrammarError(f"{name('grammar')} must be a non-empty Lark or GBNF grammar")
        g.subgrammars.append(("user_grammar", _lark_of(text, name("grammar"))))
        return g.add("answer", "@user_grammar")
    if kind == "structural_tag":
        return _structural_tag_answer(g, rf, param or "response_format", options)
    if kind == "choice":
        options_list = rf.get("choice")
        if (not isinstance(options_list, Sequence) or isinstance(options_list, str) or not options_list
                or not all(isinstance(c, str) for c in options_list)):
            raise GrammarError(f"{name('choice')} must be a non-empty list of strings")
        return g.add("answer", " | ".join(_lit(c) for c in dict.fromkeys(options_list)))
    raise GrammarError(f"response_format.type must be one of text, json_object, json_schema, regex, grammar, "
                       f"structural_tag; got {kind!r}")


def _structural_tag_answer(g: _Lark, rf: Mapping, field: str, options: Mapping[str, Any]) -> str:
    """vLLM's structural tags (``structures`` of ``{begin, schema, end}`` and their ``triggers``): free text in which
    each trigger, once written, must go on as one of the structures whose ``begin`` starts with it, the JSON of its
    schema and its ``end``, then free text again. The added tokens of the tokenizer found in triggers, begins and
    ends (``token_ids``, filled by the server) count only as those tokens, as the parsers read delimiters: a trigger
    that starts with one (``"<tool_call>\n"``) is opened by that token and goes on with the rest of the trigger, and
    an added token after text in a trigger is refused (free text cannot end on part of it). A text trigger ends the
    free text at its first occurrence (a lazy lexeme)."""
    structures, triggers = rf.get("structures"), rf.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError(f"{field}.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise GrammarError(f"{field}.structures must be a non-empty list of {{begin, schema, end}} objects")
    ids = rf.get("token_ids") or {}
    tokens = sorted(ids, key=len, reverse=True)

    def piece(text: str) -> str:
        """``text`` as grammar: its added tokens as token references, the rest as literals."""
        out, i = [], 0
        while i < len(text):
            hit = next((t for t in tokens if text.startswith(t, i)), None)
            if hit is not None:
                out.append(f"<[{int(ids[hit])}]>")
                i += len(hit)
                continue
            j = i + 1
            while j < len(text) and not any(text.startswith(t, j) for t in tokens):
                j += 1
            out.append(_lit(text[i:j]))
            i = j
        return " ".join(out)

    bodies: dict[str, list[str]] = {}
    for i, st in enumerate(structures):
        where = f"{field}.structures[{i}]"
        if not isinstance(st, Mapping) or not isinstance(st.get("begin"), str) or not isinstance(st.get("end"), str):
            raise GrammarError(f"{where} must be an object with begin and end strings and a schema")
        schema = st.get("schema", {})
        if not isinstance(schema, Mapping):
            raise GrammarError(f"{where}.schema must be a JSON schema object")
        trigger = max((t for t in triggers if st["begin"].startswith(t)), key=len, default=None)
        if trigger is None:
            raise GrammarError(f"{where}.begin {st['begin']!r} starts with none of the triggers")
        g.add(f"st{i}_json", _json_rule(schema, options, lenient=True, where=f"{where}.schema"))
        parts = [piece(st["begin"][len(trigger):]), f"st{i}_json", piece(st["end"])]
        bodies.setdefault(trigger, []).append(" ".join(p for p in parts if p))
    g.add("ST_TEXT", _TEXT)
    segments = []
    for k, (trigger, alts) in enumerate(bodies.items()):
        if any(trigger.startswith(t) for t in tokens):
            head = f"ST_TEXT {piece(trigger)}"
        elif (inner := next((t for t in tokens if t in trigger), None)) is not None:
            raise GrammarError(f"{field}.triggers: {trigger!r} holds the added token {inner!r} after text, where "
                               f"free text cannot end; start the trigger at the token")
        else:
            head = g.add(f"st_h{k}", f"ST_TEXT {_lit(trigger)}", "[lazy]")
        segments.append(g.add(f"st_t{k}", f"{head} ({' | '.join(alts)})"))
    return g.add("answer", f"({' | '.join(segments)})* ST_TEXT")


def answer_field(response_format: Any) -> str:
    """The request field a ``response_format`` mapping came from, for error messages: its ``param`` (vLLM's
    ``structured_outputs.regex``, ``guided_json``, ...), else ``response_format``."""
    return response_format.get("param", "response_format") if isinstance(response_format, Mapping) \
        else "response_format"


def _whitespace_field(param: str | None) -> str:
    """The request field a ``whitespace_pattern`` came from, beside the answer format field ``param``: vLLM's
    ``structured_outputs.whitespace_pattern``, the older ``guided_whitespace_pattern``, else
    ``response_format.whitespace_pattern``."""
    if param and param.startswith("structured_outputs"):
        return "structured_outputs.whitespace_pattern"
    if param and param.startswith("guided_"):
        return "guided_whitespace_pattern"
    return "response_format.whitespace_pattern"


def _json_layout(options: Mapping[str, Any], rf: Mapping) -> Mapping[str, Any]:
    """The JSON layout with a request's overrides: ``compact`` (no whitespace at all) or a ``whitespace_pattern``
    (the only whitespace allowed between tokens; a `GrammarError` naming its field when it is not a regex)."""
    if rf.get("compact"):
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    pattern = rf.get("whitespace_pattern")
    if pattern is None:
        return options
    where = _whitespace_field(rf.get("param"))
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError(f"{where} must be a non-empty regex")
    _check_regex(pattern, where)
    return {"whitespace_pattern": pattern, "item_separator": ",", "key_separator": ":"}


def _check_regex(pattern: str, where: str) -> None:
    """A `GrammarError` naming ``where`` when ``pattern`` is not a regex llguidance reads (checked on its own, with
    no tokenizer, so that the error is not blamed on the grammar it goes into)."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(llguidance.grammar_from("regex", pattern))
    if is_error:
        lines = [line.strip() for line in messages[0].splitlines()]
        reason = next((line.removeprefix("error:").strip() for line in lines if line.startswith("error:")), lines[0])
        raise GrammarError(f"{where} is not a valid regex: {reason}")


_LARK_START = re.compile(r"(?m)^\s*[?!]?start\s*:")
_GBNF_ESCAPE = re.compile(r"\\(\\|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8}))")


def _lark_of(text: str, where: str) -> str:
    """A user grammar as Lark: kept when it is Lark (a ``start:`` rule, inlined ``?start:`` included, or no GBNF
    ``::=`` at all), else read as GBNF (``root ::= ...``), its ``\\uXXXX`` / ``\\UXXXXXXXX`` escapes included."""
    from llguidance.gbnf_to_lark import any_to_lark  # a pure string translation

    if "::=" not in text or _LARK_START.search(text):
        return text
    try:
        return any_to_lark(_GBNF_ESCAPE.sub(_short_escape, text))
    except Exception as e:  # noqa: BLE001 - any failure here is the user's grammar
        raise GrammarError(f"{where} is neither Lark nor valid GBNF: {e}") from None


def _short_escape(m: re.Match) -> str:
    """A GBNF ``\\u``/``\\U`` escape as the translator reads it (it cuts their digits short): ``\\xHH`` for ASCII,
    the character itself beyond (no GBNF syntax is outside ASCII); ``\\\\`` and surrogates as they are."""
    hexa = m.group(2) or m.group(3)
    code = int(hexa, 16) if hexa else -1
    if code < 0 or 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
        return m.group(0)
    return f"\\x{code:02X}" if code < 0x80 else chr(code)


def _regex_literal(pattern: str, where: str = "response_format.regex") -> str:
    """``pattern`` (Rust regex syntax, matching the whole answer) as a Lark ``/.../`` terminal."""
    import llguidance  # only its pure string helper, which escapes "/" for the /.../ syntax

    try:
        return "/" + llguidance.regex_to_lark(pattern, "") + "/"
    except Exception as e:  # noqa: BLE001 - any failure here is the user's regex
        raise GrammarError(f"{where} is not a valid regex: {e}") from None


def _hermes_call(g: _Lark, d: _Delims, tools: list[_Tool]) -> str:
    """``<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>`` with one schema per tool keyed by name."""
    schema = _wrapper_schema(tools, "arguments")
    g.add("call_json", _json_rule(schema, lenient=not all(t.strict for t in tools)))
    return g.add("call", f'{d.ref("tool_open")} "\\n" call_json "\\n" {d.ref("tool_close")}')


def _is_text_param(schema: Mapping, params: Mapping) -> bool:
    """A parameter whose value Qwen3-Coder writes raw, not as JSON: exactly the values the parser streams as a JSON
    string (its schema, local references followed in its tool's ``params``, allows a string or declares no type)."""
    return streams_as_string(schema_types(schema, params))


def _tag_value(g: _Lark, rule: str, schema: Mapping, lenient: bool, close: str, lazy: tuple[str, str] | None,
               as_root: Mapping | None = None, params: Mapping | None = None) -> str:
    """Rule for one tag-delimited argument value ending with ``close`` (a rule reference or literal): raw text where
    the parser streams the value as a string (an enum/const of strings as its literals), else JSON of its schema
    (of ``as_root``, the same schema as a root of its own, when given: see `_param_schema`); ``params`` is the tool's
    parameters schema, where the value's local references resolve.
    ``lazy`` = (closer text, suffix literal) when the closer is text: a text value never contains the closer (the
    parser ends the value at its first occurrence; an enum/const value holding it cannot be written: a `GrammarError`
    in a strict schema, left out of a lenient one) and ends lazily at the suffix; None when the closer is a token."""
    if _is_text_param(schema, params or {}):
        schema = resolved(schema, params or {})
        values = schema.get("enum") if isinstance(schema.get("enum"), list) else \
            [schema["const"]] if "const" in schema else None
        if values is not None and all(isinstance(v, str) for v in values):
            unwritable = [v for v in values if lazy is not None and lazy[0] in v]
            if unwritable and not lenient:
                raise GrammarError(f"value {unwritable[0]!r} cannot be written in this tool format: {lazy[0]!r} "
                                   "would end it")
            written = [v for v in values if v not in unwritable]
            if written:
                return g.add(rule, "(" + " | ".join(_lit(v) for v in written) + ") " + close)
        lo = int(schema.get("minLength", 0) or 0)
        hi = schema.get("maxLength")
        span = f"{{{lo},{int(hi)}}}" if hi is not None else (f"{{{lo},}}" if lo else "*")
        term = rule.upper() + "_TEXT"
        text = f"/(?s:.{span})/" + "".join(f" & /{r}/" for r in _text_regexes(schema, lenient))
        if lazy is None:
            g.add(term, text)
            return g.add(rule, f"{term} {close}")
        closer, suffix = re.escape(lazy[0]).replace("/", "\\/"), lazy[1]
        g.add(term, f"{text} & ~/(?s:.*){closer}(?s:.*)/")
        return g.add(rule, term, f"[suffix={suffix}]")
    g.add(rule + "_json", _json_rule(schema if as_root is None else as_root, lenient=lenient))
    return g.add(rule, f"{rule}_json {close}")


_ANCHOR_INSIDE = re.compile(r"[$^]")


def _whole_match(pattern: str) -> str | None:
    """JSON Schema's ``pattern`` (a search) as a regex the whole value must match: ``.*`` on each side its anchor does
    not fix; None where an anchor is not at an end, or the anchored pattern alternates at its top level."""
    start = pattern.startswith("^")
    end = pattern.endswith("$") and not pattern.endswith("\\$")
    core = pattern[1 if start else 0:len(pattern) - 1 if end else None]
    outside = re.sub(r"\[\^?\]?[^\]]*\]", "", re.sub(r"\\.", "", core))  # escapes and character classes gone
    if _ANCHOR_INSIDE.search(outside):
        return None
    depth, top_bar = 0, False
    for c in outside:
        depth += (c == "(") - (c == ")")
        top_bar |= c == "|" and depth == 0
    if top_bar and (start or end):
        return None
    return ("" if start else "(?s:.*)") + f"(?:{core})" + ("" if end else "(?s:.*)")


def _text_regexes(schema: Mapping, lenient: bool) -> list[str]:
    """The regexes (lark-quoted) a raw-text value must match whole: its ``pattern`` (`_whole_match`). A pattern
    llguidance cannot read or `_whole_match` cannot make whole, and a ``format`` (whose regex is llguidance's JSON
    compiler's own), are dropped from a lenient schema and a `GrammarError` in a strict one: they cannot be
    enforced."""
    pattern, out = schema.get("pattern"), []
    if isinstance(pattern, str):
        whole = _whole_match(pattern)
        if whole is not None and _regex_readable(whole):
            out.append(re.sub(r"(?<!\\)/", r"\/", whole))
        elif not lenient:
            raise GrammarError(f"pattern {pattern!r} cannot be enforced on a parameter written as text")
    if "format" in schema and not lenient:
        raise GrammarError(f"format {schema['format']!r} cannot be enforced on a parameter written as text (send the "
                           "tool without strict, or with a pattern instead)")
    return out


def _coder_value(g: _Lark, rule: str, schema: Mapping, lenient: bool, closer: str, pad: str,
                 as_root: Mapping | None = None, params: Mapping | None = None) -> str:
    """Rule for one parameter value, ending with its ``pad + closer + "\\n"`` (Qwen3-Coder: ``\\n</parameter>\\n``)."""
    close = _lit(pad + closer + "\n")
    return _tag_value(g, rule, schema, lenient, close, (closer, close), as_root, params)


def _param_set(g: _Lark, k: int, t: _Tool, param: Callable[[str, Mapping, str], str]) -> str | None:
    """Tool ``t``'s parameters, each at most once, in any order, the required ones present: the rule to use (None when
    it has none). ``param(name, schema, rule)`` adds rule ``rule`` for one parameter (its tags and value) and returns
    the grammar text that writes it."""
    props = t.parameters.get("properties") or {}
    if not isinstance(props, Mapping):
        raise GrammarError(f"tools: function {t.name!r}: parameters.properties must be an object")
    required = [p for p in t.parameters.get("required", []) if p in props]
    names = required + [p for p in props if p not in required]
    if len(names) > 64:
        raise GrammarError(f"tools: function {t.name!r} has {len(names)} parameters; at most 64 are supported")
    if not names:
        return None
    perm = f"t{k}_params"
    rows = [f'"" %if is_ones([0:{len(required)}])' if required else '""']
    for b, p in enumerate(names):
        ps = props[p] if isinstance(props[p], Mapping) else {}
        try:
            written = param(p, ps, f"t{k}_p{b}")
        except GrammarError as e:
            if e.message.startswith("tools"):
                raise
            raise GrammarError(f"tools[{t.index}].function.parameters.properties.{p}: {e.message}") from None
        rows.append(f'{written} {perm}::set_bit({b}) %if bit_clear({b})')
    g.add(f"{perm}::_", "\n    | ".join(rows))
    return f"{perm}::0x0"


def _coder_call(g: _Lark, d: _Delims, tools: list[_Tool], many: bool) -> str:
    """``<tool_call>\\n<function=NAME>\\n(<parameter=K>\\nV\\n</parameter>\\n)*</function>\\n</tool_call>`` with each
    parameter at most once, in any order, required ones present, each value constrained by its schema. The tags are
    the profile's terminals, the newlines around values only where it strips them (MiniMax-M2:
    ``<invoke name="NAME">\\n(<parameter name="K">V</parameter>\\n)*</invoke>\\n``); where its calls share one block,
    the block holds one call, or several when ``many``."""
    term = d.profile.terminals
    fn_open, fn_close, tag_end = term["function_open"], term["function_close"], term["tag_end"]
    key_open, key_close = term["parameter_open"], term["parameter_close"]
    pad = "\n" if d.profile.strip_value_newlines else ""
    tail = _lit(fn_close + "\n")
    unwritable = set("<>\n" + tag_end)
    alts = []
    for k, t in enumerate(tools):
        lenient = not t.strict

        def param(p: str, ps: Mapping, rule: str) -> str:
            if not p or unwritable & set(p):
                raise GrammarError(f"tools: function {t.name!r}: parameter name {p!r} cannot be written as "
                                   f"{key_open}{p}{tag_end}")
            value = _coder_value(g, rule, ps, lenient, key_close, pad, _param_schema(t, p, ps), t.parameters)
            return f'{_lit(key_open + p + tag_end + pad)} {value}'

        head = _lit(fn_open + t.name + tag_end + "\n")
        params = _param_set(g, k, t, param)
        alts.append(g.add(f"t{k}_fn", f'{head} {params or ""} {tail}'))
    g.add("fn", " | ".join(alts))
    body = "fn+" if many and d.profile.calls_share_block else "fn"
    return g.add("call", f'{d.ref("tool_open")} "\\n" {body} {d.ref("tool_close")}')


def _glm_value(g: _Lark, d: _Delims, rule: str, schema: Mapping, lenient: bool,
               as_root: Mapping | None = None, params: Mapping | None = None) -> str:
    """Rule for one GLM argument value, ending with its ``</arg_value>`` (a token, or text where the vocabulary lacks
    it)."""
    text = d.profile.terminals["value_close"]
    lazy = None if d.id("value_close") is not None else (text, _lit(text))
    return _tag_value(g, rule, schema, lenient, d.ref("value_close"), lazy, as_root, params)


def _glm_call(g: _Lark, d: _Delims, tools: list[_Tool]) -> str:
    """GLM-4.5: ``<tool_call>NAME\\n(<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n)*</tool_call>``, each argument
    at most once, in any order, required ones present, values as the parser types them."""
    alts = []
    for k, t in enumerate(tools):
        lenient = not t.strict

        def param(p: str, ps: Mapping, rule: str) -> str:
            return (f'{d.ref("key_open")} {_lit(p)} {d.ref("key_close")} "\\n" {d.ref("value_open")} '
                    f'{_glm_value(g, d, rule, ps, lenient, _param_schema(t, p, ps), t.parameters)} "\\n"')

        params = _param_set(g, k, t, param)
        alts.append(g.add(f"t{k}_fn", f'{_lit(t.name + chr(10))} {params or ""}'.rstrip()))
    g.add("fn", " | ".join(alts))
    return g.add("call", f'{d.ref("tool_open")} fn {d.ref("tool_close")}')


def _section_call(g: _Lark, d: _Delims, tools: list[_Tool], fmt: str, many: bool) -> str:
    """DeepSeek and Kimi K2: ``tool_open (call_open HEAD call_sep {args} call_close)+ tool_close``. DeepSeek's head is
    V3.1's ``NAME`` (bare JSON after the separator) or V3's ``function`` with ``NAME\\n```json\\n{args}\\n``` ``
    after it; Kimi's is ``functions.NAME:IDX``."""
    alts = []
    for k, t in enumerate(tools):
        args = g.add(f"t{k}_args", _json_rule(t.parameters, lenient=not t.strict))
        sep = d.ref("call_sep")
        if fmt == "kimi_k2":
            body = f'{_lit("functions." + t.name + ":")} /[0-9]{{1,3}}/ {sep} {args}'
        else:
            fenced = _lit(t.name + "\n```json\n") + f" {args} " + _lit("\n```")
            body = f'({_lit(t.name)} {sep} {args} | "function" {sep} {fenced})'
        alts.append(g.add(f"t{k}_call", f'{d.ref("call_open")} {body} {d.ref("call_close")}'))
    g.add("one_call", " | ".join(alts))
    return g.add("call", f'{d.ref("tool_open")} {"one_call+" if many else "one_call"} {d.ref("tool_close")}')


def _harmony_call(g: _Lark, d: _Delims, tools: list[_Tool]) -> str:
    """``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}`` (the turn ends after it)."""
    alts = []
    for k, t in enumerate(tools):
        g.add(f"t{k}_args", _json_rule(t.parameters, _HARMONY_JSON_OPTIONS, lenient=not t.strict))
        alts.append(g.add(f"t{k}_call", f'{d.ref("channel")} {_lit("commentary to=functions." + t.name + " ")} '
                                         f'{d.ref("constrain")} "json" {d.ref("message")} t{k}_args'))
    return g.add("call", " | ".join(alts))


def _wrapper_schema(tools: list[_Tool], args_key: str) -> dict:
    """``{"name": NAME, args_key: {..}}`` with one schema per tool keyed by name (Hermes, Llama 3 JSON, Mistral's
    list); each tool's local references still resolve inside its own schema."""
    def entry(t: _Tool, at: tuple[str | int, ...]) -> dict:
        args = _rebased(t.parameters, _pointer(*at, "properties", args_key))
        return {"type": "object", "properties": {"name": {"const": t.name}, args_key: args},
                "required": ["name", args_key], "additionalProperties": False}

    if len(tools) == 1:
        return entry(tools[0], ())
    return {"anyOf": [entry(t, ("anyOf", k)) for k, t in enumerate(tools)]}


def _python_value(g: _Lark, rule: str, schema: Mapping, lenient: bool, as_root: Mapping | None = None) -> str:
    """One pythonic keyword value: ``True``/``False``/``None`` for a boolean / null schema, else JSON of the schema
    (JSON strings, numbers, lists and dicts are Python literals; the parser also reads a nested true/false/null);
    ``as_root`` as in `_tag_value`."""
    kind = schema.get("type")
    if kind == "boolean":
        return g.add(rule, '"True" | "False"')
    if kind == "null":
        return g.add(rule, '"None"')
    return g.add(rule, _json_rule(schema if as_root is None else as_root, lenient=lenient))


def _pythonic_call(g: _Lark, tools: list[_Tool]) -> str:
    """``NAME(k=v, ...)``: the parameters in declared order (required first), optional ones may be left out."""
    alts = []
    for k, t in enumerate(tools):
        props = t.parameters.get("properties") or {}
        if not isinstance(props, Mapping):
            raise GrammarError(f"tools: function {t.name!r}: parameters.properties must be an object")
        if not t.name.isidentifier():
            raise GrammarError(f"tools: function name {t.name!r} cannot be written as a Python call")
        required = [p for p in t.parameters.get("required", []) if p in props]
        names = required + [p for p in props if p not in required]
        if len(names) > 64:
            raise GrammarError(f"tools: function {t.name!r} has {len(names)} parameters; at most 64 are supported")
        items = []
        for b, p in enumerate(names):
            if not isinstance(p, str) or not p.isidentifier():
                raise GrammarError(f"tools: function {t.name!r}: parameter name {p!r} is not a Python identifier")
            ps = props[p] if isinstance(props[p], Mapping) else {}
            value = _python_value(g, f"t{k}_v{b}", ps, not t.strict, _param_schema(t, p, ps))
            items.append(f'{_lit(p + "=")} {value}')
        # t{k}_f{i}: parameters i.. with nothing written yet; t{k}_s{i}: the same after a written one (", " first)
        after, first = '""', '""'
        for b in range(len(names) - 1, -1, -1):
            req = names[b] in required
            s_rule = g.add(f"t{k}_s{b}", f'", " {items[b]} {after}' + ("" if req else f" | {after}"))
            f_rule = g.add(f"t{k}_f{b}", f"{items[b]} {after}" + ("" if req else f" | {first}"))
            after, first = s_rule, f_rule
        alts.append(g.add(f"t{k}_call", f'{_lit(t.name + "(")} {first} ")"'))
    return g.add("call", " | ".join(alts))


def _flat_answer(g: _Lark, d: _Delims, fmt: str, mode: str, tools: list[_Tool], formatted: str | None,
                 many: bool) -> str | None:
    """Calls that need no section markers: Llama 3 JSON objects (bare, `; ` between them), a pythonic list, Mistral's
    ``[TOOL_CALLS]NAME[ARGS]{..}`` (v11+ vocabularies, where ``[ARGS]`` is a token) or ``[TOOL_CALLS][{..}, ..]``."""
    lenient = not all(t.strict for t in tools)
    free_start = None
    if fmt == "llama3_json":
        g.add("call_json", _json_rule(_wrapper_schema(tools, "parameters"), lenient=lenient))
        calls = g.add("calls", 'call_json ("; " call_json)*' if many else "call_json")
        free_start = "{"
    elif fmt == "pythonic":
        _pythonic_call(g, tools)
        calls = g.add("calls", '"[" call (", " call)* "]"' if many else '"[" call "]"')
        free_start = "["
    elif d.id("args") is not None:
        alts = []
        for k, t in enumerate(tools):
            g.add(f"t{k}_args", _json_rule(t.parameters, lenient=not t.strict))
            alts.append(g.add(f"t{k}_call", f'{d.ref("tool_open")} {_lit(t.name)} {d.ref("args")} t{k}_args'))
        g.add("call", " | ".join(alts))
        calls = g.add("calls", "call+" if many else "call")
    else:
        g.add("call_json", _json_rule(_wrapper_schema(tools, "arguments"), lenient=lenient))
        items = 'call_json (", " call_json)*' if many else "call_json"
        calls = g.add("calls", f'{d.ref("tool_open")} "[" {items} "]"')
    if mode in ("required", "named"):
        return calls
    if formatted is not None:
        return g.add("tools", f"{formatted} | {calls}")
    if free_start is None:
        if d.id("tool_open") is None:
            return None  # the trigger is text: free text cannot be told apart from a call's start
        g.add("TEXT", _TEXT)
        return g.add("tools", f"TEXT {calls} | TEXT")
    # the parser reads calls only at the reply's start: otherwise the reply must not start like one
    g.add("FREE", f"/[ \\t\\r\\n]*([^{re.escape(free_start)} \\t\\r\\n](?s:.*))?/")
    return g.add("tools", f"{calls} | FREE")


# ------------------------------------------------------------------------------------------------------------ compose

def compile_request(profile: Profile, initial: InitialState, delimiter_ids: Mapping[str, int | None], *,
                    response_format: Mapping | None = None, tools: Sequence[Mapping] | None = None,
                    tool_choice: str | Mapping | None = None, parallel_tool_calls: bool = True,
                    thinking_budget: int | None = None, thinking: bool = True) -> GrammarPlan | None:
    """The request's `GrammarPlan`, or None when nothing constrains its tokens.

    ``tool_choice``: ``none`` ignores tools; ``auto`` constrains each call that starts when any tool is ``strict``
    (text stays free); ``required`` forces at least one call (exactly one without ``parallel_tool_calls``); a named
    function forces that tool once; OpenAI's ``allowed_tools`` (``auto`` or ``required``) lets calls name only the
    tools it lists, the others staying in the prompt (every call is constrained, strict or not). With tools forced,
    ``response_format`` does not apply (the reply is calls); ``auto`` with a ``response_format`` allows either the
    formatted answer or tool calls.

    ``thinking=False`` (the request turned thinking off: ``enable_thinking=false``, Anthropic ``thinking.type``
    ``disabled``) means that in the CONTENT state the model may not open a thought of its own; with the default a
    hybrid model (Qwen3) may start its reply with ``<think>`` as it does when thinking is on.

    Raises `GrammarError` (HTTP 400) naming the offending field.
    """
    ids = {k: v for k, v in delimiter_ids.items() if v is not None}
    d = _Delims(profile, ids)
    g = _Lark()
    tool_list = _tools(tools)
    mode, named, allowed = _choice(tool_choice, tool_list)
    if mode == "none":
        tool_list = []
    if named is not None:
        tool_list = [t for t in tool_list if t.name == named]
    if allowed is not None:
        tool_list = [t for t in tool_list if t.name in allowed]
    if tool_list and profile.tool_format is None:
        if mode in ("required", "named"):
            raise GrammarError(f"tool_choice {mode!r}: model family {profile.name!r} has no tool-call syntax")
        tool_list = []

    may_open = _may_open(profile, d) if thinking else None
    budget = _budget(profile, initial, d, thinking_budget, _may_open(profile, d))
    answer = _answer(g, d, profile, mode, tool_list, response_format, parallel_tool_calls, allowed is not None)
    if answer is None:
        return GrammarPlan(None, budget) if budget is not None else None
    if profile.tool_format == "harmony":
        start = _harmony_start(g, d, answer)
    else:
        exact = mode not in ("required", "named") and (response_format or {}).get("type") in _EXACT_FORMATS
        lead = None
        if tool_list and not exact:  # whitespace may lead a call, never a formatted answer beside the calls
            lead = "answer | WS calls" if answer == "tools" and "answer" in g.rules else f"WS {answer}"
        start = _reasoning_start(g, d, profile, initial, answer, may_open, lead)
    format_field = answer_field(response_format)
    fields = [f for f, used in ((format_field, "answer" in g.rules), ("tools", "call" in g.rules)) if used]
    return GrammarPlan(g.source(start), budget, " and ".join(fields) or format_field)


def build_grammar(profile: Profile, initial: InitialState, delimiter_ids: Mapping[str, int | None],
                  **request: Any) -> str | None:
    """Just the grammar source of `compile_request` (None when the tokens are free)."""
    plan = compile_request(profile, initial, delimiter_ids, **request)
    return plan.grammar if plan is not None else None


def _budget(profile: Profile, initial: InitialState, d: _Delims, tokens: int | None,
            may_open: int | None) -> ThinkingBudget | None:
    if tokens is None:
        return None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise GrammarError(f"max_thinking_tokens: a thinking budget must be a non-negative integer, got {tokens!r}")
    if profile.reasoning is None:
        if profile.tool_format == "harmony":
            raise GrammarError(f"max_thinking_tokens: a thinking budget is not supported for model family "
                               f"{profile.name!r}")
        return None  # the model never thinks: nothing to bound
    close = d.id("think_close")
    if close is None:
        if initial is not InitialState.REASONING and may_open is None:
            return None  # no thought opens on a token here (DeepSeek-V3's vocabulary has no <think>): none to bound
        raise GrammarError(f"max_thinking_tokens: a thinking budget needs {profile.reasoning.close!r} to be a single "
                           f"token in this model's vocabulary")
    implicit = frozenset(i for (state, name), rule in profile.transitions.items()
                         if state == REASONING_STATE and rule.action == "tool_open"
                         for i in [d.id(name)] if i is not None)
    return ThinkingBudget(tokens, close, may_open, initial is InitialState.REASONING, implicit)


def _may_open(profile: Profile, d: _Delims) -> int | None:
    """The open delimiter's ID when the model may start a thought itself (as the parser lets it: the family has an
    open delimiter)."""
    spec = profile.reasoning
    if spec is None or spec.open is None:
        return None
    return d.id("think_open")


def _answer(g: _Lark, d: _Delims, profile: Profile, mode: str, tools: list[_Tool], rf: Mapping | None,
            parallel: bool, restricted: bool = False) -> str | None:
    harmony = profile.tool_format == "harmony"
    forced = bool(tools) and mode in ("required", "named")
    formatted = None if forced else _response_format_answer(g, rf, _HARMONY_JSON_OPTIONS if harmony else JSON_OPTIONS)
    if harmony and formatted is not None:
        formatted = g.add("final", f'{d.ref("channel")} "final" {d.ref("message")} {formatted}')
    if not tools or (mode == "auto" and not restricted and not any(t.strict for t in tools) and formatted is None):
        return formatted
    _check_tool_schemas(tools)
    if profile.tool_format in ("llama3_json", "pythonic", "mistral"):
        return _flat_answer(g, d, profile.tool_format, mode, tools, formatted, parallel and mode != "named")
    if profile.tool_format == "hermes":
        call = _hermes_call(g, d, tools)
    elif profile.tool_format == "qwen3_coder":
        call = _coder_call(g, d, tools, parallel and mode != "named")
    elif profile.tool_format == "glm45":
        call = _glm_call(g, d, tools)
    elif profile.tool_format in ("deepseek_v3", "kimi_k2"):
        call = _section_call(g, d, tools, profile.tool_format, parallel and mode != "named")
    else:
        call = _harmony_call(g, d, tools)
    if harmony:
        # A harmony call ends the turn (`<|call|>` is an end-of-turn token): one call per reply.
        if mode in ("required", "named"):
            return g.add("tools", call)
        free = formatted or g.add("final", f'{d.ref("channel")} "final" {d.ref("message")} TEXT')
        g.add("TEXT", _TEXT)
        return g.add("tools", f"{free} | {call}")
    g.add("WS", _WS)
    blocks = parallel and not profile.calls_share_block  # several blocks; a shared block holds every call itself
    calls = g.add("calls", "(call WS)+" if blocks and mode != "named" else "call WS")
    if mode in ("required", "named"):
        return calls
    if formatted is not None:
        return g.add("tools", f"{formatted} | {calls}")
    if d.id("tool_open") is None:
        return None  # the trigger is text: free text cannot be told apart from a call's start
    g.add("TEXT", _TEXT)
    tail = "(TEXT call)+ TEXT | TEXT" if blocks else "TEXT call TEXT | TEXT"
    return g.add("tools", tail)


_EXACT_FORMATS = frozenset({"regex", "choice", "grammar", "structural_tag"})
"""Answers whose every character the request fixes: no whitespace may lead them (JSON and tool calls may have it)."""


def _reasoning_start(g: _Lark, d: _Delims, profile: Profile, initial: InitialState, answer: str,
                     open_id: int | None, lead: str | None = None) -> str:
    """The start rule: the thought (the rest of one already open, or one the model may open: after whitespace, as
    GLM-4.5 and Qwen3.5 write ``\n<think>``), then ``answer``. Without a thought, the answer is ``lead`` where given
    (its tool calls after whitespace, which their parser drops), else ``answer`` from its first character."""
    spec = profile.reasoning
    if spec is None:
        return answer
    g.add("WS", _WS)
    close_id = d.id("think_close")
    if initial is InitialState.REASONING:
        if close_id is not None:
            g.add("REASONING", _TEXT)
            return f"REASONING <[{close_id}]> WS {answer}"
        g.add("thought", _TEXT, f"[suffix={_lit(spec.close)}]")
        return f"thought WS {answer}"
    if open_id is None or close_id is None:
        return answer
    g.add("REASONING", _TEXT)
    if lead is not None:
        return f"WS <[{open_id}]> REASONING <[{close_id}]> WS {answer} | {lead}"
    return f"(WS <[{open_id}]> REASONING <[{close_id}]> WS)? {answer}"


def _harmony_start(g: _Lark, d: _Delims, answer: str) -> str:
    """Any number of analysis messages (reasoning), each ``<|end|><|start|>assistant``, then the answer."""
    g.add("ANALYSIS", _TEXT)
    g.add("analysis", f'{d.ref("channel")} "analysis" {d.ref("message")} ANALYSIS {d.ref("end")} '
                      f'{d.ref("start")} "assistant"')
    return f"analysis* {answer}"
