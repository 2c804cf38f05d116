"""XML tool-call values (Qwen3-Coder, GLM) whose parameter schema is a local `$ref`: each is typed by the schema the
reference names inside the tool's own parameters, so objects, arrays and numbers come back as JSON, not strings."""
from __future__ import annotations

import json

from tests.parsers.test_machine_common import QWEN_IDS, fold, machine, run, split
from tests.parsers.test_machine_properties import check_chunking_and_truncation
from tests.parsers.test_tools_glm45 import IDS as GLM_IDS

PARAMS = {
    "type": "object",
    "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}, "pop": {"type": "integer"}}},
              "a/b~c": {"type": "integer"}, "Label": {"type": "string"},
              "Ping": {"$ref": "#/$defs/Pong"}, "Pong": {"$ref": "#/$defs/Ping"}},
    "definitions": {"Flags": {"type": "array", "items": {"type": "boolean"}}},
    "properties": {
        "home": {"$ref": "#/$defs/City"},
        "work": {"$ref": "#/properties/home", "description": "a reference to a reference"},
        "count": {"$ref": "#/$defs/a~1b~0c"},
        "ratio": {"$ref": "#/%24defs/a~1b~0c"},
        "flags": {"$ref": "#/definitions/Flags"},
        "maybe": {"anyOf": [{"$ref": "#/$defs/City"}, {"type": "null"}]},
        "wrapped": {"allOf": [{"$ref": "#/$defs/City"}], "description": "pydantic v1's shape"},
        "itself": {"$ref": "#"},
        "label": {"$ref": "#/$defs/Label"},
        "loop": {"$ref": "#/$defs/Ping"},
        "gone": {"$ref": "#/$defs/Nowhere"},
        "sup": {"$ref": "#/properties/maybe/anyOf/\u00b2", "description": "a superscript two is no array index"},
    }}
TOOLS = [{"type": "function", "function": {"name": "move", "parameters": PARAMS}}]
WRITTEN = {"home": '{"name": "Oslo", "pop": 700000}', "work": '{"name": "Rome"}', "count": "42", "ratio": "7",
           "flags": "[true, false]", "maybe": "null", "wrapped": '{"name": "Bergen"}',
           "itself": '{"home": {"name": "Pisa"}}', "label": "[not json]", "loop": '{"a": 1}', "gone": "[1]",
           "sup": "[2]"}
EXPECTED = {"home": {"name": "Oslo", "pop": 700000}, "work": {"name": "Rome"}, "count": 42, "ratio": 7,
            "flags": [True, False], "maybe": None, "wrapped": {"name": "Bergen"}, "itself": {"home": {"name": "Pisa"}},
            "label": "[not json]", "loop": '{"a": 1}', "gone": "[1]", "sup": "[2]"}
"""What each value parses to: a reference that loops or names nothing leaves the value a string, as an undeclared
type does (GLM reads an undeclared type as JSON: `GLM_EXPECTED`)."""
GLM_EXPECTED = {**EXPECTED, "loop": {"a": 1}, "gone": [1], "sup": [2]}

CALL, END_CALL = ((QWEN_IDS[t], t) for t in ("<tool_call>", "</tool_call>"))
CODER_BODY = "\n<function=move>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n"
                                             for k, v in WRITTEN.items()) + "</function>\n"


def test_qwen3_coder_referenced_parameters_parse_as_the_schema_they_name():
    toks = [CALL, *((None, piece) for piece in split(CODER_BODY, range(0, len(CODER_BODY), 7))), END_CALL]
    f = fold(check_chunking_and_truncation("qwen3_coder", QWEN_IDS, "CONTENT", toks, TOOLS, exact_bytes=False))
    assert [(name, json.loads(args), ended) for name, args, ended in f.calls] == [("move", EXPECTED, True)]
    assert f.content == f.malformed == ""


def test_qwen3_coder_referenced_parameters_parse_the_same_however_the_stream_is_cut():
    for cut in range(len(CODER_BODY) + 1):
        f = fold(run(machine("qwen3_coder", QWEN_IDS, "CONTENT", TOOLS), [CALL, *split(CODER_BODY, [cut]), END_CALL]))
        assert [(name, json.loads(args)) for name, args, _ in f.calls] == [("move", EXPECTED)], cut


def test_glm_referenced_arguments_parse_as_the_schema_they_name():
    tag = lambda t: (GLM_IDS[t], t)  # noqa: E731
    toks = [tag("<tool_call>"), (None, "move\n")]
    for k, v in WRITTEN.items():
        toks += [tag("<arg_key>"), (None, k), tag("</arg_key>"), (None, "\n"), tag("<arg_value>"), (None, v),
                 tag("</arg_value>"), (None, "\n")]
    toks.append(tag("</tool_call>"))
    f = fold(check_chunking_and_truncation("glm45", GLM_IDS, "CONTENT", toks, TOOLS, exact_bytes=False))
    assert [(name, json.loads(args), ended) for name, args, ended in f.calls] == [("move", GLM_EXPECTED, True)]


def chain(n: int, fan_out: int) -> dict:
    """Parameters whose ``x`` names D0, each Dk any of ``fan_out`` references to Dk+1, and Dn an integer."""
    defs = {f"D{k}": {"anyOf": [{"$ref": f"#/$defs/D{k + 1}"}] * fan_out} for k in range(n)}
    return {"type": "object", "$defs": {**defs, f"D{n}": {"type": "integer"}},
            "properties": {"x": {"$ref": "#/$defs/D0"}}}


def test_references_are_followed_once_each_and_a_chain_too_deep_for_a_real_schema_is_a_string():
    for params, value in ((chain(30, 2), 5), (chain(2000, 1), "5")):   # 2**30 paths; 2000 references deep
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        body = "\n<function=f>\n<parameter=x>\n5\n</parameter>\n</function>\n"
        f = fold(run(machine("qwen3_coder", QWEN_IDS, "CONTENT", tools), [CALL, body, END_CALL]))
        assert [(name, json.loads(args)) for name, args, _ in f.calls] == [("f", {"x": value})]
