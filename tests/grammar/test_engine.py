"""Structured output end to end: the engine samples a tiny random-weight Qwen3 through the grammar's bitmask.

The weights are random, so every valid answer is the grammar's doing. The model carries the real Qwen3 tokenizer
(151k tokens; the demo model where ../shared is absent), and every output is parsed back by the parsers' pipeline.
"""
from __future__ import annotations

import json
import random
import shutil

import jsonschema
import pytest

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from ember.engine.eos import end_of_turn_ids
from ember.grammar import compile_request, model_vocab_size
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import DELIMITER, ParserSetup, parse_all
from tests.grammar.conftest import QWEN3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, vocab_dir, hf_tok):
    """A 1-layer, 32-wide random Qwen3 whose vocabulary is the tokenizer's."""
    if not (QWEN3 / "tokenizer.json.gz").exists():
        from ember.engine import demo

        return demo.build(tmp_path_factory.mktemp("demo-model"))
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3")
    eos = [hf_tok.convert_tokens_to_ids("<|im_end|>"), hf_tok.convert_tokens_to_ids("<|endoftext|>")]
    cfg = Qwen3Config(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=2048, eos_token_id=eos[0], bos_token_id=eos[1])
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": eos[1]}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(vocab_dir / f, out / f)
    return out


@pytest.fixture(scope="module")
def engine(model_dir, backend):
    assert model_vocab_size(model_dir) == backend.vocab_size
    assert set(end_of_turn_ids(None, model_dir)) <= set(backend.eos_ids)
    return Engine.from_pretrained(model_dir, bitmask_filler=backend.bitmask_filler(), max_num_seqs=64,
                                  max_num_batched_tokens=4096, device="cpu", dtype="float32")


def run(engine, requests):
    """requests: (prompt_ids, SamplingParams, constraint) -> per request (token ids, finish_reason, error)."""
    rids = [engine.add_request(p, sp, constraint=c) for p, sp, c in requests]
    out = {r: [] for r in rids}
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                done[o.request_id] = (o.finish_reason, o.error)
    return [(out[r], *done[r]) for r in rids]


def prompt(tok, user: str, tail: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{tail}", add_special_tokens=False)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects with required fields, a nested object, enums, bounded numbers, short strings and short arrays (sizes
    bounded so that a random model's answers stay a few dozen tokens long)."""
    kinds = ["int", "num", "enum", "str", "bool"] + (["obj", "arr"] if depth == 0 else [])
    props, required = {}, []
    for k in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        lo = rng.randint(-20, 20)
        s = {"int": lambda: {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 50)},
             "num": lambda: {"type": "number", "minimum": lo, "maximum": lo + 10, "multipleOf": 0.5},
             "enum": lambda: {"enum": rng.sample(["red", "green", "a b", "é", 'q"t'], 3)},
             "str": lambda: {"type": "string", "maxLength": rng.randint(0, 5)},
             "bool": lambda: {"type": "boolean"},
             "obj": lambda: random_schema(rng, depth + 1),
             "arr": lambda: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                             "maxItems": rng.randint(0, 2)}}[kind]()
        name = f"{kind[0]}{k}"
        props[name] = s
        if rng.random() < 0.7:
            required.append(name)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def test_fifty_random_json_schemas_all_validate(engine, backend, hf_tok):
    setup = ParserSetup.from_tokenizer(hf_tok, "qwen3")
    rng = random.Random(1234)
    p = prompt(hf_tok, "Reply in JSON.", "<think>\n\n</think>\n\n")  # thinking off
    initial = setup.initial_state(p)
    assert initial is InitialState.CONTENT
    schemas = [random_schema(rng) for _ in range(50)]
    reqs = []
    for i, schema in enumerate(schemas):
        plan = compile_request(setup.profile, initial, setup.delimiter_ids, thinking=False, response_format={
            "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        reqs.append((p, SamplingParams(max_tokens=120, temperature=0.0), backend.constraint(plan)))
    results = run(engine, reqs)
    for schema, (ids, reason, error) in zip(schemas, results):
        assert reason == "stop" and error is None, (reason, error, hf_tok.decode(ids))
        parsed = parse_all(setup.pipeline(initial=initial), ids)
        assert parsed.reasoning == ""
        jsonschema.validate(json.loads(parsed.content), schema)


LITERAL_SPECIALS = {  # answer formats whose literal text spells added tokens, and the one answer each allows
    '{"tag": "<think>"}': {"type": "json_schema", "json_schema": {"strict": True, "schema": {
        "type": "object", "properties": {"tag": {"const": "<think>"}}, "required": ["tag"],
        "additionalProperties": False}}},
    '{"k": "a<|im_end|>b"}': {"type": "json_schema", "json_schema": {"strict": True, "schema": {
        "type": "object", "properties": {"k": {"enum": ["a<|im_end|>b"]}}, "required": ["k"],
        "additionalProperties": False}}},
    "<|endoftext|>": {"type": "choice", "choice": ["<|endoftext|>"]},
    "x<tool_call>y": {"type": "regex", "regex": "x<tool_call>y"},
    # the spelling appears only once the grammar runs: a regex escape, a character class, Lark literals side by side
    "a<|im_end|>b": {"type": "regex", "regex": r"a<\|im_end\|>b"},
    "x<think>y": {"type": "regex", "regex": "x<thin[k]>y"},
    "<|im_start|>z": {"type": "grammar", "grammar": 'start: "<" "|im_start|" ">z"'},
    '{"p": "<|im_end|>"}': {"type": "json_schema", "json_schema": {"strict": True, "schema": {
        "type": "object", "properties": {"p": {"type": "string", "pattern": "^<\\|im_end\\|>$"}}, "required": ["p"],
        "additionalProperties": False}}},
}


def test_literal_text_spelling_a_special_token_is_written_with_ordinary_tokens(engine, backend, hf_tok):
    """A const, choice or regex holding a delimiter's spelling: the answer is that text, in ordinary tokens (the
    delimiter counts only as its token), rather than a refused token and an error."""
    setup = ParserSetup.from_tokenizer(hf_tok, "qwen3")
    p = prompt(hf_tok, "Reply.", "<think>\n\n</think>\n\n")
    initial = setup.initial_state(p)
    reqs = [(p, SamplingParams(max_tokens=40, temperature=0.0), backend.constraint(compile_request(
        setup.profile, initial, setup.delimiter_ids, thinking=False, response_format=rf)))
        for rf in LITERAL_SPECIALS.values()]
    specials = set(hf_tok.all_special_ids) | set(hf_tok.added_tokens_decoder)
    for answer, (ids, reason, error) in zip(LITERAL_SPECIALS, run(engine, reqs)):
        assert reason == "stop" and error is None, (answer, error)
        assert not specials & (set(ids) - set(backend.eos_ids)), hf_tok.convert_ids_to_tokens(ids)
        assert parse_all(setup.pipeline(initial=initial), ids).content == answer
    plain = compile_request(setup.profile, initial, setup.delimiter_ids, thinking=False,
                            response_format={"type": "json_object"})
    assert backend._tokenizer_for(plain.grammar) is backend.ll_tokenizer  # the Python callback only where needed


DECOMPOSED = {  # answer formats whose literal text is not in NFC, which Qwen3's tokenizer composes as it encodes
    '{"name": "Cafe\u0301 au lait"}': {"type": "json_schema", "json_schema": {"strict": True, "schema": {
        "type": "object", "properties": {"name": {"enum": ["Cafe\u0301 au lait"]}}, "required": ["name"],
        "additionalProperties": False}}},
    "xe\u0301 ok": {"type": "regex", "regex": "xe\u0301 ok"},
    "A\u030a": {"type": "choice", "choice": ["A\u030a"]},
}


def test_literal_text_not_in_nfc_is_written_byte_for_byte(engine, backend, hf_tok):
    """`e` + U+0301 (macOS file names, NFD input) is ordinary text: the grammar forces those bytes, where Qwen3's
    tokenizer gave the tokens of `é` (other bytes, refused mid-answer or as an invalid grammar)."""
    setup = ParserSetup.from_tokenizer(hf_tok, "qwen3")
    p = prompt(hf_tok, "Reply.", "<think>\n\n</think>\n\n")
    initial = setup.initial_state(p)
    for rf in DECOMPOSED.values():
        backend.validate(compile_request(setup.profile, initial, setup.delimiter_ids, thinking=False,
                                         response_format=rf).grammar)
    reqs = [(p, SamplingParams(max_tokens=40, temperature=0.0), backend.constraint(compile_request(
        setup.profile, initial, setup.delimiter_ids, thinking=False, response_format=rf)))
        for rf in DECOMPOSED.values()]
    for answer, (ids, reason, error) in zip(DECOMPOSED, run(engine, reqs)):
        assert reason == "stop" and error is None, (answer, error)
        assert parse_all(setup.pipeline(initial=initial), ids).content == answer


def test_thinking_on_reasoning_ends_at_the_close_token_where_the_parser_switches(engine, backend, hf_tok):
    setup = ParserSetup.from_tokenizer(hf_tok, "qwen3")
    close = setup.delimiter_ids["</think>"]
    p = prompt(hf_tok, "Think, then reply in JSON.", "<think>\n")  # the template opened the thought
    initial = setup.initial_state(p)
    assert initial is InitialState.REASONING
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    reqs = []
    budgets = [1, 5, 12]
    for seed, budget in enumerate(budgets):
        plan = compile_request(setup.profile, initial, setup.delimiter_ids, thinking_budget=budget,
                               response_format={"type": "json_schema", "json_schema": {"schema": schema}})
        reqs.append((p, SamplingParams(max_tokens=120, temperature=0.0), backend.constraint(plan)))
    for budget, (ids, reason, error) in zip(budgets, run(engine, reqs)):
        assert reason == "stop" and error is None, error
        assert ids.index(close) == budget, "the random model never closes by itself: the budget does"
        pipe = setup.pipeline(initial=initial)
        step = pipe.feed(ids)
        channels = step.token_channels
        # The parser leaves reasoning exactly at the grammar's close token (I10).
        assert channels[budget] == DELIMITER and set(channels[:budget]) == {"reasoning"}
        assert "reasoning" not in channels[budget + 1:]
        parsed = parse_all(setup.pipeline(initial=initial), ids)
        assert parsed.reasoning.strip()
        jsonschema.validate(json.loads(parsed.content), schema)


TOOLS = [
    {"type": "function", "function": {"name": "set_alarm", "strict": True, "parameters": {
        "type": "object", "properties": {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "label": {"type": "string", "maxLength": 10},
            "repeat": {"type": "boolean"},
            "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 3}},
        "required": ["hour", "label"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_tool_choice_required_and_named_parse_back_with_valid_arguments(engine, backend, hf_tok):
    """Hermes JSON calls (qwen3) and XML calls (qwen3_coder), all in one batch."""
    choices = ["required", "required", {"type": "function", "function": {"name": "get_weather"}},
               {"type": "function", "function": {"name": "set_alarm"}}]
    reqs, cases = [], []
    for family in ("qwen3", "qwen3_coder"):
        setup = ParserSetup.from_tokenizer(hf_tok, family)
        for k, choice in enumerate(choices):
            p = prompt(hf_tok, f"Request {k}: set an alarm or check the weather.", "<think>\n\n</think>\n\n")
            initial = setup.initial_state(p)
            # One call each: a random model allowed parallel calls may call again forever instead of ending.
            plan = compile_request(setup.profile, initial, setup.delimiter_ids, tools=TOOLS, tool_choice=choice,
                                   parallel_tool_calls=False, thinking=False)
            reqs.append((p, SamplingParams(max_tokens=160, temperature=0.0), backend.constraint(plan)))
            cases.append((setup, initial, choice))
    for (setup, initial, choice), (ids, reason, error) in zip(cases, run(engine, reqs)):
        text = hf_tok.decode(ids)
        assert reason == "stop" and error is None, (error, text)
        parsed = parse_all(setup.pipeline(initial=initial, tools=TOOLS), ids)
        assert len(parsed.tool_calls) == 1 and not parsed.malformed, text
        assert parsed.content.strip() == ""
        if isinstance(choice, dict):
            assert [c.name for c in parsed.tool_calls] == [choice["function"]["name"]]
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if setup.profile.name == "qwen3_coder":
            assert "<function=" in text and "<parameter=" in text
        else:
            assert '{"name": ' in text


REF_TOOLS = [
    {"type": "function", "function": {"name": "ship", "strict": True, "parameters": {
        "type": "object",
        "$defs": {"City": {"type": "string", "enum": ["Oslo", "Rome"]},
                  "Stop": {"type": "object", "properties": {"at": {"$ref": "#/$defs/City"}}, "required": ["at"],
                           "additionalProperties": False}},
        "definitions": {"Zip": {"type": "integer", "minimum": 100, "maximum": 999}},
        "properties": {"city": {"$ref": "#/$defs/City"}, "zip": {"$ref": "#/definitions/Zip"},
                       "alt": {"type": "array", "items": {"$ref": "#/properties/zip"}, "maxItems": 2},
                       "via": {"$ref": "#/$defs/Stop"}},
        "required": ["city", "zip", "alt", "via"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "tree", "strict": True, "parameters": {
        "type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
        "required": ["v", "kids"], "additionalProperties": False}}},
]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_coder"])
def test_forced_calls_with_schema_references_generate_arguments_of_the_tools_own_schema(engine, backend, hf_tok,
                                                                                         family):
    """`$ref`s to `#/$defs`, `#/definitions`, `#/properties` and `#` (a tree) in forced calls, as Hermes JSON and as
    Qwen3-Coder XML parameters (where a parameter that is a bare `$ref` is typed by the schema it names: `via` is JSON
    of an object, `city` one of its strings)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in REF_TOOLS}
    setup = ParserSetup.from_tokenizer(hf_tok, family)
    reqs, cases = [], []
    for name in schemas:
        p = prompt(hf_tok, f"Call {name}.", "<think>\n\n</think>\n\n")
        initial = setup.initial_state(p)
        plan = compile_request(setup.profile, initial, setup.delimiter_ids, tools=REF_TOOLS,
                               tool_choice={"type": "function", "function": {"name": name}}, thinking=False)
        reqs.append((p, SamplingParams(max_tokens=200, temperature=0.0), backend.constraint(plan)))
        cases.append((initial, name))
    for (initial, name), (ids, reason, error) in zip(cases, run(engine, reqs)):
        text = hf_tok.decode(ids)
        if name == "tree" and reason == "length":
            # random weights may nest subtrees until max_tokens: each nested object is the tool's own node, never the
            # call wrapper that an unrebased "#" resolved to
            body = text.split("tree", 1)[1].split('"arguments":', 1)[-1]  # the arguments (Hermes) or parameters
            assert error is None and '"v"' in body and '"name"' not in body and '"arguments"' not in body, text
            continue
        assert reason == "stop" and error is None, (error, text)
        parsed = parse_all(setup.pipeline(initial=initial, tools=REF_TOOLS), ids)
        assert [c.name for c in parsed.tool_calls] == [name] and not parsed.malformed, text
        jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), schemas[name])
