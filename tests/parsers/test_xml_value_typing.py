"""XML tool-call values (Qwen3-Coder, Seed-OSS, MiniMax-M2, GLM) typed by the tool's schema as vLLM's parsers type
them: arrays and objects written as Python literals (the templates render earlier arguments with `| string`),
``None``/``null`` for a nullable or non-string parameter, numbers that only float() reads, GLM's undeclared
parameters read as JSON, and MiniMax's and GLM's values stripped. Each is checked fed whole, one character at a time
and cut at every few tokens (the fragments that streamed are always a prefix of the final arguments)."""
from __future__ import annotations

import json

import pytest

from ember.parsers.xml_values import typed_json
from tests.parsers.test_machine_common import QWEN_IDS, fold, machine
from tests.parsers.test_machine_properties import check_chunking_and_truncation
from tests.parsers.test_tools_glm45 import IDS as GLM_IDS

FAMILIES = ("qwen3_coder", "seed_oss", "minimax_m2", "glm45")
MM_IDS = {"<think>": 1, "</think>": 2, "<minimax:tool_call>": 3, "</minimax:tool_call>": 4, "[e~[": 5}
SEED_IDS = {"<seed:think>": 1, "</seed:think>": 2, "<seed:tool_call>": 3, "</seed:tool_call>": 4, "<seed:eos>": 5}
IDS = {"qwen3_coder": QWEN_IDS, "seed_oss": SEED_IDS, "minimax_m2": MM_IDS, "glm45": GLM_IDS}


def call_tokens(family: str, name: str, params: dict[str, str]) -> list[tuple[int | None, str]]:
    """One call as the family's template writes it: (token id, text), delimiters as their single tokens."""
    ids = IDS[family]
    tag = lambda t: (ids[t], t)  # noqa: E731
    if family == "glm45":
        toks = [tag("<tool_call>"), (None, name + "\n")]
        for k, v in params.items():
            toks += [tag("<arg_key>"), (None, k), tag("</arg_key>"), (None, "\n"), tag("<arg_value>"), (None, v),
                     tag("</arg_value>"), (None, "\n")]
        return toks + [tag("</tool_call>")]
    if family == "minimax_m2":
        body = f'\n<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n'
                                                         for k, v in params.items()) + "</invoke>\n"
        return [tag("<minimax:tool_call>"), (None, body), tag("</minimax:tool_call>")]
    pad = "\n" if family == "qwen3_coder" else ""
    body = f"\n<function={name}>\n" + "".join(f"<parameter={k}>{pad}{v}{pad}</parameter>\n"
                                              for k, v in params.items()) + "</function>\n"
    opener = "<tool_call>" if family == "qwen3_coder" else "<seed:tool_call>"
    return [tag(opener), (None, body), tag(opener.replace("<", "</"))]


def parsed(family: str, schema: dict | None, written: str) -> object:
    """The value of parameter ``p`` (of schema ``schema``; undeclared when None) written as ``written``."""
    props = {} if schema is None else {"p": schema}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props}}}]
    toks = call_tokens(family, "f", {"p": written})
    f = fold(check_chunking_and_truncation(family, IDS[family], "CONTENT", toks, tools, exact_bytes=False))
    ((name, args, ended),) = f.calls
    assert (name, ended, f.malformed) == ("f", True, "")
    return json.loads(args)["p"]


ARRAY, OBJECT = {"type": "array", "items": {"type": "string"}}, {"type": "object"}
NULLABLE = {"type": ["string", "null"]}
ROWS = [  # (what it checks, schema, as written, value, {family: value where it differs})
    # 1: Python literals for arrays and objects
    ("py list", ARRAY, "['a', 'b']", ["a", "b"], {}),
    ("py dict", OBJECT, "{'k': True, 'n': None, 'x': [1.5, (2, 3)]}", {"k": True, "n": None, "x": [1.5, [2, 3]]}, {}),
    ("py tuple", {"type": "array"}, "(1, 'two')", [1, "two"], {}),
    ("json list", ARRAY, '["a", "b"]', ["a", "b"], {}),
    ("not a literal", ARRAY, "[a, b]", "[a, b]", {}),
    ("two arguments", ARRAY, "[1], w=[2]", "[1], w=[2]", {}),
    ("list for an object", OBJECT, "['a']", "['a']", {}),
    # 2: null and None
    ("nullable None", NULLABLE, "None", None, {}),
    ("nullable null", NULLABLE, "null", None, {}),
    ("nullable NULL", NULLABLE, "NULL", None, {}),
    ("anyOf None", {"anyOf": [{"type": "string"}, {"type": "null"}]}, "None", None, {}),
    ("nullable prefix", NULLABLE, "nu", "nu", {}),
    ("nullable longer", NULLABLE, "Nonesuch", "Nonesuch", {}),
    ("nullable empty", NULLABLE, "", "", {}),
    ("anyOf integer None", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "None", None, {}),
    ("integer None", {"type": "integer"}, "None", None, {}),
    ("string None", {"type": "string"}, "None", "None", {}),
    # 3: numbers float() reads
    ("number .5", {"type": "number"}, ".5", 0.5, {}),
    ("number -.5", {"type": "number"}, "-.5", -0.5, {}),
    ("number 1.", {"type": "number"}, "1.", 1, {}),
    ("number +1", {"type": "number"}, "+1", 1, {}),
    ("number 007", {"type": "number"}, "007", 7, {}),
    ("number 1_000", {"type": "number"}, "1_000", 1000, {}),
    ("number 2.50", {"type": "number"}, "2.50", 2.5, {}),
    ("number nan", {"type": "number"}, "nan", "nan", {}),
    ("number inf", {"type": "number"}, "inf", "inf", {}),
    ("number 1e999", {"type": "number"}, "1e999", float("inf"), {}),  # a JSON number, as the grammar allows it
    ("number +1e999", {"type": "number"}, "+1e999", "+1e999", {}),
    # 4: GLM reads an undeclared parameter as JSON, else a Python literal, else a string
    ("untyped list", None, "[1, 2]", "[1, 2]", {"glm45": [1, 2]}),
    ("untyped number", None, "42", "42", {"glm45": 42}),
    ("untyped py str", None, "'x'", "'x'", {"glm45": "x"}),
    ("untyped None", None, "None", "None", {"glm45": None}),
    ("untyped word", None, "hello world", "hello world", {}),
    ("untyped schema", {"description": "no type"}, "true", "true", {"glm45": True}),
    ("untyped leading zeros", None, "02134", "02134", {}),
    ("untyped py triple str", None, "'''a\nb'''", "'''a\nb'''", {"glm45": "a\nb"}),
    ("py list leading zeros", ARRAY, "[1, 007]", "[1, 007]", {}),
    # 5: MiniMax-M2 and GLM strip a value's whitespace
    ("padded string", {"type": "string"}, "  a  b \t", "  a  b \t", {"minimax_m2": "a  b", "glm45": "a  b"}),
    ("newlines", {"type": "string"}, "\nx\n", "\nx\n", {"minimax_m2": "x", "glm45": "x"}),
    ("padded untyped", None, " hi ", " hi ", {"minimax_m2": "hi", "glm45": "hi"}),
    ("padded nullable", NULLABLE, " None\n", " None\n", {"minimax_m2": None, "glm45": None}),
    ("padded fallback", {"type": "integer"}, " x1 ", " x1 ", {"minimax_m2": "x1", "glm45": "x1"}),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("schema, written, value, by_family", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_values_are_typed_as_vllm_types_them(family, schema, written, value, by_family):
    assert parsed(family, schema, written) == by_family.get(family, value)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_nullable_string_is_held_while_it_may_spell_null_then_streams(family):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "p": NULLABLE}}}}]
    m = machine(family, IDS[family], "CONTENT", tools)
    fed, events, args_at = "", [], {}
    for tid, piece in call_tokens(family, "f", {"p": "Nonesuch"}):
        for tok in [(tid, piece)] if tid is not None else [(None, ch) for ch in piece]:
            events += m.feed(*tok)
            fed += tok[1]
            args_at[len(fed)] = fold(events).calls[0][1] if fold(events).calls else None
    start = fed.index("Nonesuch")
    assert args_at[start + 4] == ""                      # "None": the key waits
    assert args_at[start + 5] == '{"p": "Nones'          # "Nones": a string, streaming


@pytest.mark.parametrize("types", [("array",), ("number",), ()])
def test_a_value_nested_too_deep_to_read_is_a_string_not_a_crash(types):
    raw = "[" * 100_000
    assert typed_json(raw, types, untyped=True) == json.dumps(raw)
