"""Seed-OSS (`seed_oss`, vLLM's name too): `<seed:think>` opened by the model, then Qwen3-Coder's XML calls with no
newlines around values, one per `<seed:tool_call>` block, read by Qwen3-Coder's syntax with Seed's terminals. No Seed
vocabulary is under ../shared/data: a byte-level BPE tokenizer with Seed's special tokens as single tokens stands in.
The real template's tool-call turn is accepted by the forced-call grammar and parsed back into the same calls."""
from __future__ import annotations

import json

import pytest

from ember.grammar import GrammarBackend, compile_request
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import ParserSetup, parse_all
from ember.parsers.profiles import detect_profile, get_profile
from tests.conftest import shared_path
from tests.parsers.family_tokenizers import byte_bpe
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.parsers.result import fold

THINK, END_THINK, TC, ETC, EOS, BOS = "<seed:think>", "</seed:think>", "<seed:tool_call>", "</seed:tool_call>", \
    "<seed:eos>", "<seed:bos>"
SPECIALS = [THINK, END_THINK, TC, ETC, EOS, BOS, "<seed:cot_budget_reflect>", "</seed:cot_budget_reflect>"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def tok():
    return byte_bpe(SPECIALS)


@pytest.fixture(scope="module")
def setup(tok):
    return ParserSetup.from_tokenizer(tok, "seed_oss", drop_ids=[tok.token_to_id(EOS)])


def ids_of(tok, *parts: str) -> list[int]:
    return [i for p in parts for i in tok.encode(p, add_special_tokens=False).ids]


def call(name: str, **params: str) -> str:
    return (f"{TC}\n<function={name}>\n" + "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in params.items())
            + f"</function>\n{ETC}")


def test_the_delimiters_are_single_tokens_and_the_real_template_is_detected(tok, setup):
    p = get_profile("seed_oss")
    assert all(setup.delimiter_ids[p.terminals[n]] == tok.token_to_id(p.terminals[n]) for n in p.token_id_terminals)
    root = shared_path("templates")
    found = {str(f.relative_to(root)) for f in root.glob("*/*.jinja") if detect_profile(f.read_text()) == "seed_oss"}
    assert found == {"llama.cpp/ByteDance-Seed-OSS.jinja"}
    assert detect_profile(None, "seed_oss") == "seed_oss"


def test_a_thought_with_budget_reflections_then_calls_typed_by_the_schema(tok, setup):
    reply = (THINK + "Check the weather.<seed:cot_budget_reflect>Used 5 tokens.</seed:cot_budget_reflect>"
             + END_THINK + "Sure.\n" + call("get_weather", city="Paris\nCentre", days="3") + "\n"
             + call("get_weather", city="Rome") + EOS)
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS), ids_of(tok, reply))
    assert out.reasoning == "Check the weather.<seed:cot_budget_reflect>Used 5 tokens.</seed:cot_budget_reflect>"
    assert out.content == "Sure.\n" and out.malformed == []
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris\nCentre", "days": 3}), ("get_weather", {"city": "Rome"})]


def test_the_opener_spelled_in_pieces_is_ordinary_text(tok, setup):
    spelled = ids_of(tok, "<seed:") + ids_of(tok, "tool_call>\n<function=get_weather>\n</function>\n")
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS), ids_of(tok, "a ") + spelled)
    assert out.tool_calls == [] and out.content == "a <seed:tool_call>\n<function=get_weather>\n</function>\n"


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(1, 80), max_size=12))
def test_streaming_in_any_chunks_equals_the_final_parse(tok, setup, cuts):
    ids = ids_of(tok, THINK + "hmm" + END_THINK + "ok " + call("get_weather", city="Oslo", days="2") + " bye" + EOS)
    whole = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS), ids)
    pipe, events, at = setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS), [], 0
    for c in sorted(set(cuts)) + [len(ids)]:
        if c > at:
            events += pipe.feed(ids[at:c]).events
            at = c
    out = fold(events + pipe.finish("stop"))
    assert (out.reasoning, out.content, [(c.name, c.arguments) for c in out.tool_calls]) == (
        whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.tool_calls])


def test_the_templates_call_turn_passes_the_forced_grammar_and_parses_back(tok, setup):
    from transformers import PreTrainedTokenizerFast

    from ember.server.chat import render

    template = shared_path("templates", "llama.cpp", "ByteDance-Seed-OSS.jinja").read_text()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    user = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    turn = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]}
    prompt = render(hf, template, user, tools=TOOLS, add_generation_prompt=True)
    whole = render(hf, template, user + [turn], tools=TOOLS, add_generation_prompt=False)
    head = BOS + "assistant\n"  # the generation prompt's header; the turn renders its newline before the call
    assert prompt.endswith(head) and whole.startswith(prompt.removesuffix(head))
    reply = whole[whole.rindex(head) + len(head):]
    assert reply.startswith(f"{TC}\n<function=get_weather>\n") and reply.endswith(EOS)
    eos = [tok.token_to_id(EOS)]
    backend = GrammarBackend.from_tokenizer(tok, eos_ids=eos)
    plan = compile_request(setup.profile, InitialState.CONTENT, setup.delimiter_ids, tools=TOOLS,
                           tool_choice="required", parallel_tool_calls=False)
    constraint = backend.constraint(plan)
    assert all(constraint.accept_token(t) for t in ids_of(tok, reply))
    out = parse_all(setup.pipeline(initial=InitialState.CONTENT, tools=TOOLS), ids_of(tok, reply))
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris",
                                                                                            "days": 3})]
    wrong = backend.constraint(plan)
    assert not all(wrong.accept_token(t) for t in ids_of(tok, reply.replace(">3<", ">three<")))
