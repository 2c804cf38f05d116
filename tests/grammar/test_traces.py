"""Grammars fed real token traces (Qwen3 tokenizer; the demo model's where ../shared is absent).

Each test drives a request's `GrammarConstraint` token by token, as the engine does, and checks what a user would see:
which next tokens the mask allows, where the reasoning region ends, which tool calls the grammar lets through.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ember.grammar import GrammarError, compile_request
from ember.parsers.initial import InitialState, initial_state
from ember.parsers.profiles import get_profile
from ember.parsers.tokens import TokenBytes, profile_delimiter_ids
from tests.conftest import shared_path

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object",
                   "properties": {"location": {"type": "string"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                   "required": ["location", "unit"], "additionalProperties": False}}}
NYC_TIME = {"type": "function", "function": {
    "name": "get_current_time_nyc", "parameters": {"type": "object", "properties": {}}}}


class Trace:
    """A request's constraint plus the tokenizer helpers the tests need."""

    def __init__(self, tok, backend, plan) -> None:
        self.tok, self.backend, self.c = tok, backend, backend.constraint(plan)

    def feed(self, ids) -> "Trace":
        for k, t in enumerate(ids):
            assert self.c.accept_token(t), f"token {k} ({self.tok.decode([t])!r}) rejected: {self.c.error_message()}"
        return self

    def rejects(self, ids) -> bool:
        """Feeds ``ids`` and says whether one of them was rejected (the constraint then stays failed)."""
        return not all(self.c.accept_token(t) for t in ids)

    def allowed(self) -> torch.Tensor:
        v = self.backend.vocab_size
        bm = torch.zeros(1, (v + 31) // 32, dtype=torch.int32)
        self.c.fill_bitmask(bm, 0)
        bits = ((bm.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[:v]
        return bits.bool()


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def spelled(tok, *pieces: str) -> list[int]:
    """Each piece encoded on its own, so a delimiter written as pieces never becomes its added token."""
    return [i for p in pieces for i in enc(tok, p)]


def ids_of(tok, profile) -> dict[str, int]:
    return profile_delimiter_ids(tok, profile)


def tid(tok, text: str) -> int:
    return tok.convert_tokens_to_ids(text)


@pytest.fixture(scope="module")
def qwen3(hf_tok):
    p = get_profile("qwen3")
    return p, ids_of(hf_tok, p)


def test_spelled_close_stays_reasoning_and_only_the_token_ends_it(hf_tok, backend, qwen3):
    profile, ids = qwen3
    plan = compile_request(profile, InitialState.REASONING, ids,
                           response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}})
    close, eos = tid(hf_tok, "</think>"), tid(hf_tok, "<|im_end|>")
    reasoning = spelled(hf_tok, "Let me see", " </", "think", ">", " is just text, not the end")
    assert close not in reasoning
    t = Trace(hf_tok, backend, plan).feed(reasoning)
    word = enc(hf_tok, " more")[0]
    m = t.allowed()
    assert m[word] and m[close], "still reasoning: any text or the close token may follow"
    assert not m[eos] and not m[tid(hf_tok, "<tool_call>")], "no special token before the thought ends"
    t.feed([close])
    m = t.allowed()
    assert not m[word] and m[enc(hf_tok, "{")[0]], "after token 151668 only the JSON answer (or whitespace)"
    t.feed(enc(hf_tok, '\n\n{"a": 7}'))
    m = t.allowed()
    assert m[eos] and int(m.sum()) == len(backend.eos_ids), "after the closing brace only EOS"
    assert t.c.is_terminated()


def test_answer_may_contain_the_delimiter_text(hf_tok, backend, qwen3):
    profile, ids = qwen3
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    plan = compile_request(profile, InitialState.CONTENT, ids,
                           response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    t = Trace(hf_tok, backend, plan).feed(spelled(hf_tok, '{"s": "a ', "</", "think", '> b"}'))
    assert t.c.is_terminated()


def test_model_may_open_its_own_thought_only_at_the_start(hf_tok, backend, qwen3):
    profile, ids = qwen3
    plan = compile_request(profile, InitialState.CONTENT, ids, response_format={"type": "json_object"})
    open_, close = tid(hf_tok, "<think>"), tid(hf_tok, "</think>")
    t = Trace(hf_tok, backend, plan)
    m = t.allowed()
    assert m[open_] and m[enc(hf_tok, "{")[0]] and not m[close]
    t.feed([open_] + enc(hf_tok, "\nhmm\n") + [close] + enc(hf_tok, '\n\n{"k": '))
    assert not t.allowed()[open_]
    t.feed(enc(hf_tok, "1}"))
    assert t.c.is_terminated()
    assert not Trace(hf_tok, backend, plan).feed(enc(hf_tok, "{")).allowed()[open_]


@pytest.mark.parametrize("family", ["qwen3", "glm45"])
def test_whitespace_may_lead_the_models_own_thought(hf_tok, backend, family):
    """GLM-4.5 and Qwen3.5 start a reply with ``\n<think>``: the grammar lets the thought open after that whitespace
    (it used to refuse the newline, forcing the answer without a thought). Without a thought the JSON answer starts
    at its ``{``, as docs/api.md promises (strict output carries no whitespace but the separators)."""
    profile = get_profile(family)
    plan = compile_request(profile, InitialState.CONTENT, ids_of(hf_tok, profile),
                           response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}})
    open_, close = tid(hf_tok, "<think>"), tid(hf_tok, "</think>")
    t = Trace(hf_tok, backend, plan).feed(enc(hf_tok, "\n"))
    assert t.allowed()[open_] and not t.allowed()[enc(hf_tok, "{")[0]]
    t.feed([open_] + enc(hf_tok, "hmm") + [close] + enc(hf_tok, '\n{"a": 1}'))
    assert t.c.is_terminated()
    assert Trace(hf_tok, backend, plan).rejects(enc(hf_tok, '\n\n{"a": 2}'))
    assert Trace(hf_tok, backend, plan).feed(enc(hf_tok, '{"a": 2}')).c.is_terminated()


@pytest.mark.parametrize("family", ["qwen3", "glm45"])
def test_with_tools_whitespace_may_lead_a_call_but_not_a_formatted_answer(hf_tok, backend, family):
    """Tools (auto) beside a JSON answer: whitespace may lead the model's own thought or a tool call, but an answer
    that opens no thought starts at its ``{``, as without tools."""
    profile = get_profile(family)
    tools = [{"type": "function", "function": {"name": "get_w", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    plan = compile_request(profile, InitialState.CONTENT, ids_of(hf_tok, profile), tools=tools, tool_choice="auto",
                           response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}})
    assert Trace(hf_tok, backend, plan).rejects(enc(hf_tok, ' \r\n {"a": 2}'))
    assert Trace(hf_tok, backend, plan).feed(enc(hf_tok, '{"a": 2}')).c.is_terminated()
    t = Trace(hf_tok, backend, plan).feed(enc(hf_tok, "\n"))
    assert t.allowed()[tid(hf_tok, "<think>")] and t.allowed()[tid(hf_tok, "<tool_call>")]
    t.feed([tid(hf_tok, "<think>")] + enc(hf_tok, "hmm") + [tid(hf_tok, "</think>")] + enc(hf_tok, '\n{"a": 1}'))
    assert t.c.is_terminated()


@pytest.mark.parametrize("response_format", [{"type": "choice", "choice": ["yes", "no"]},
                                             {"type": "regex", "regex": "[0-9]{3}"}])
def test_an_exact_answer_has_no_leading_whitespace_without_a_thought(hf_tok, backend, response_format):
    """A hybrid model that may think but does not: a choice or regex answer is exactly it (whitespace before the
    model's own ``<think>`` stays allowed)."""
    profile = get_profile("qwen3")
    plan = compile_request(profile, InitialState.CONTENT, ids_of(hf_tok, profile), response_format=response_format)
    answer = "yes" if response_format["type"] == "choice" else "123"
    assert Trace(hf_tok, backend, plan).rejects(enc(hf_tok, "\n" + answer))
    t = Trace(hf_tok, backend, plan).feed(enc(hf_tok, answer))
    assert t.c.is_terminated()
    t = Trace(hf_tok, backend, plan).feed(enc(hf_tok, "\n"))
    assert t.allowed()[tid(hf_tok, "<think>")]


def test_thinking_budget_forces_the_close_delimiter(hf_tok, backend, qwen3):
    profile, ids = qwen3
    close = tid(hf_tok, "</think>")
    plan = compile_request(profile, InitialState.REASONING, ids, response_format={"type": "json_object"},
                           thinking_budget=3)
    t = Trace(hf_tok, backend, plan).feed(enc(hf_tok, "one two three")[:3])
    m = t.allowed()
    assert m[close] and int(m.sum()) == 1, "budget spent: only the close delimiter"
    assert t.rejects(enc(hf_tok, " four"))
    assert "budget" in t.c.error_message()
    t = Trace(hf_tok, backend, plan).feed(enc(hf_tok, "one two three")[:3] + [close])
    assert t.allowed()[enc(hf_tok, "{")[0]]

    free = compile_request(profile, InitialState.CONTENT, ids, thinking_budget=0)
    assert free.grammar is None, "a budget alone needs no grammar"
    t = Trace(hf_tok, backend, free)
    word = enc(hf_tok, "Hello")[0]
    assert t.allowed()[word], "no thought yet: anything goes"
    t.feed([tid(hf_tok, "<think>")])
    m = t.allowed()
    assert m[close] and int(m.sum()) == 1
    t.feed([close])
    assert t.allowed()[word]

    # A <tool_call> token inside the thought ends it for the parser, so it stops the budget's count too.
    tools = compile_request(profile, InitialState.REASONING, ids, tools=[NYC_TIME], thinking_budget=2)
    t = Trace(hf_tok, backend, tools).feed(enc(hf_tok, "Calling")[:1] + [tid(hf_tok, "<tool_call>")] +
                                           enc(hf_tok, '\n{"name": "get_current_time_nyc", "arguments": {}}\n'))
    assert t.allowed()[tid(hf_tok, "</tool_call>")]


def _prompt(tok, tail: str = "") -> list[int]:
    return enc(tok, "<|im_start|>user\nWhat time is it in New York?<|im_end|>\n<|im_start|>assistant\n" + tail)


def test_recorded_qwen3_tool_call_stream_is_accepted(hf_tok, backend, qwen3):
    rec = json.loads(shared_path("outputs", "dynamo", "derived", "stream_token_ids.json").read_text())
    stream = rec["qwen3-0.6B/chat_completion_stream_2bd5b0c6-1de1-4cfe-9f94-d682c4e44204.json"]
    ids_ = stream["token_ids"] + [stream["inferred_stop_token_id"]]
    profile, delims = qwen3
    initial = initial_state(_prompt(hf_tok), profile, TokenBytes.from_tokenizer(hf_tok), delims)
    assert initial is InitialState.CONTENT  # Qwen3 opens its thought itself
    choices = ["required", "auto", {"type": "function", "function": {"name": "get_current_time_nyc"}}]
    for choice in choices:
        plan = compile_request(profile, initial, delims, tools=[WEATHER, NYC_TIME], tool_choice=choice,
                               parallel_tool_calls=False)
        t = Trace(hf_tok, backend, plan).feed(ids_)
        assert t.c.matcher.is_stopped() and t.c.matcher.is_accepting(), choice

    # The same call to a tool the request does not offer, or to the other tool when one is named, is refused.
    start = ids_.index(tid(hf_tok, "<tool_call>"))
    wrong = ids_[:start + 1] + enc(hf_tok, '\n{"name": "get_current_time_la", "arguments": {}}')
    for choice in choices:
        plan = compile_request(profile, initial, delims, tools=[WEATHER, NYC_TIME], tool_choice=choice)
        assert Trace(hf_tok, backend, plan).rejects(wrong), choice
    named = compile_request(profile, initial, delims, tools=[WEATHER, NYC_TIME],
                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert Trace(hf_tok, backend, named).rejects(ids_)


def test_hermes_arguments_follow_the_schema_and_the_closer_is_a_token(hf_tok, backend, qwen3):
    profile, ids = qwen3
    call_open, call_close = tid(hf_tok, "<tool_call>"), tid(hf_tok, "</tool_call>")
    plan = compile_request(profile, InitialState.CONTENT, ids, tools=[WEATHER, NYC_TIME], tool_choice="required")
    good = enc(hf_tok, '\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n')
    t = Trace(hf_tok, backend, plan).feed([call_open] + good)
    m = t.allowed()
    assert m[call_close] and not m[enc(hf_tok, "</")[0]], "the call ends only with the </tool_call> token"
    t.feed([call_close] + enc(hf_tok, "\n") + [call_open])  # parallel calls allowed
    for bad in ['\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "kelvin"}}',
                '\n{"name": "get_weather", "arguments": {"location": 5, "unit": "celsius"}}',
                '\n{"name": "get_weather", "arguments": {"unit": "celsius"}}']:
        assert Trace(hf_tok, backend, plan).rejects([call_open] + enc(hf_tok, bad)), bad
    assert Trace(hf_tok, backend, plan).rejects(enc(hf_tok, "Sure, ")), "required: no free text first"

    single = compile_request(profile, InitialState.CONTENT, ids, tools=[WEATHER, NYC_TIME], tool_choice="required",
                             parallel_tool_calls=False)
    t = Trace(hf_tok, backend, single).feed([call_open] + good + [call_close])
    assert not t.allowed()[call_open]


def test_auto_with_strict_tools_leaves_text_free_but_constrains_calls(hf_tok, backend, qwen3):
    profile, ids = qwen3
    plan = compile_request(profile, InitialState.CONTENT, ids, tools=[WEATHER], tool_choice="auto")
    t = Trace(hf_tok, backend, plan).feed(enc(hf_tok, "I can look that up. "))
    assert t.allowed()[tid(hf_tok, "<|im_end|>")]
    t.feed([tid(hf_tok, "<tool_call>")])
    assert t.rejects(enc(hf_tok, '\n{"name": "other"'))
    assert compile_request(profile, InitialState.CONTENT, ids, tools=[NYC_TIME], tool_choice="auto") is None, \
        "auto without strict tools is free generation"
    assert compile_request(profile, InitialState.CONTENT, ids, tools=[WEATHER], tool_choice="none") is None


@pytest.fixture(scope="module")
def coder(hf_tok):
    p = get_profile("qwen3_coder")
    return p, ids_of(hf_tok, p)


def _xml(*params: tuple[str, str], name: str = "get_weather") -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"\n<function={name}>\n{body}</function>\n"


def test_qwen3_coder_parameters_any_order_once_each_required_present_typed(hf_tok, backend, coder):
    profile, ids = coder
    call_open, call_close = tid(hf_tok, "<tool_call>"), tid(hf_tok, "</tool_call>")
    plan = compile_request(profile, InitialState.REASONING, ids, tools=[WEATHER, NYC_TIME], tool_choice="required")
    prefix = enc(hf_tok, "plan") + [tid(hf_tok, "</think>")] + enc(hf_tok, "\n\n") + [call_open]

    ok = _xml(("days", "3"), ("unit", "celsius"), ("location", "San Francisco\nCA"))
    t = Trace(hf_tok, backend, plan).feed(prefix + enc(hf_tok, ok) + [call_close, tid(hf_tok, "<|im_end|>")])
    assert t.c.matcher.is_accepting()
    Trace(hf_tok, backend, plan).feed(prefix + enc(hf_tok, _xml(name="get_current_time_nyc")) + [call_close])

    bad = {
        "missing required unit": _xml(("location", "Paris")),
        "repeated parameter": _xml(("unit", "celsius"), ("unit", "celsius")),
        "enum value": _xml(("unit", "kelvin")),
        "integer above maximum": _xml(("days", "30")),
        "integer not a number": _xml(("days", "three")),
        "unknown parameter": _xml(("colour", "red")),
        "value holding the closer": _xml(("location", "a</parameter>b")),
        "unknown function": _xml(("x", "1"), name="get_time"),
    }
    for why, text in bad.items():
        assert Trace(hf_tok, backend, plan).rejects(prefix + enc(hf_tok, text) + [call_close]), why


def test_tool_schema_errors_name_tools_and_forced_calls_ignore_response_format(hf_tok, backend, qwen3):
    profile, ids = qwen3
    broken = {"type": "function", "function": {"name": "f", "strict": True,
                                               "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}
    with pytest.raises(GrammarError, match=r"^tools\[0\]\.function\.parameters .*nope"):  # named before compiling
        compile_request(profile, InitialState.CONTENT, ids, tools=[broken], tool_choice="required",
                        response_format={"type": "json_object"})
    fine = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    plan = compile_request(profile, InitialState.CONTENT, ids, tools=[fine], tool_choice="required",
                           response_format={"type": "json_object"})
    assert plan.field == "tools"


def test_response_format_regex_and_lark(hf_tok, backend, qwen3):
    profile, ids = qwen3
    eos = tid(hf_tok, "<|im_end|>")
    rx = compile_request(profile, InitialState.CONTENT, ids,
                         response_format={"type": "regex", "regex": r"\d{3}-[a-z]+"})
    Trace(hf_tok, backend, rx).feed(enc(hf_tok, "123-abc") + [eos])
    assert Trace(hf_tok, backend, rx).rejects(enc(hf_tok, "12a"))
    lark = compile_request(profile, InitialState.REASONING, ids,
                           response_format={"type": "grammar", "grammar": 'start: "yes" | "no" NUM\nNUM: /[0-9]+/\n'})
    t = Trace(hf_tok, backend, lark).feed(enc(hf_tok, "so") + [tid(hf_tok, "</think>")] + enc(hf_tok, "no42"))
    assert t.allowed()[eos]
    assert Trace(hf_tok, backend, lark).feed(enc(hf_tok, "so") + [tid(hf_tok, "</think>")]).rejects(
        enc(hf_tok, "maybe"))


def test_invalid_grammars_are_400s_naming_the_problem(hf_tok, backend, qwen3):
    profile, ids = qwen3

    def err(**kw) -> str:
        plan = compile_request(profile, InitialState.CONTENT, ids, **kw)
        with pytest.raises(GrammarError) as e:
            backend.validate(plan.grammar)
        return e.value.message

    m = err(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "strin"}, "strict": True}})
    assert "response_format" in m and "strin" in m and "%llguidance" not in m
    assert "Unknown format" in err(response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "format": "weird"}, "strict": True}})
    assert "unknown name" in err(response_format={"type": "grammar", "grammar": "start: foo\n"})
    assert len(err(response_format={"type": "grammar", "grammar": "start: <nope>\n"})) < 800
    lenient = compile_request(profile, InitialState.CONTENT, ids, response_format={
        "type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "weird"}}})
    backend.validate(lenient.grammar)  # strict false: unsupported keywords are ignored


@pytest.mark.parametrize("kw, field", [
    (dict(response_format={"type": "yaml"}), "response_format.type"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(response_format={"type": "regex", "regex": ""}), "response_format.regex"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
    (dict(tools=[WEATHER, WEATHER]), "not unique"),
    (dict(thinking_budget=-1), "thinking budget"),
])
def test_bad_requests_name_the_field(qwen3, kw, field):
    profile, ids = qwen3
    with pytest.raises(GrammarError, match=field.replace("[", r"\[").replace("]", r"\]")):
        compile_request(profile, InitialState.CONTENT, ids, **kw)


def test_anthropic_tool_choice_shapes_mean_the_same(qwen3):
    profile, ids = qwen3
    same = [({"type": "any"}, "required"), ({"type": "tool", "name": "get_weather"},
                                            {"type": "function", "function": {"name": "get_weather"}}),
            ({"type": "auto"}, "auto"), ({"type": "none"}, "none")]
    for anthropic, openai in same:
        a = compile_request(profile, InitialState.CONTENT, ids, tools=[WEATHER, NYC_TIME], tool_choice=anthropic)
        o = compile_request(profile, InitialState.CONTENT, ids, tools=[WEATHER, NYC_TIME], tool_choice=openai)
        assert a == o, anthropic


def test_tool_choice_on_a_family_without_tool_syntax_is_refused(hf_tok):
    p = get_profile("none")
    with pytest.raises(GrammarError, match="tool-call syntax"):
        compile_request(p, InitialState.CONTENT, {}, tools=[WEATHER], tool_choice="required")
    assert compile_request(p, InitialState.CONTENT, {}) is None


def test_a_rejected_token_ends_with_a_clear_error(hf_tok, backend, qwen3):
    profile, ids = qwen3
    plan = compile_request(profile, InitialState.CONTENT, ids, response_format={"type": "json_object"})
    t = Trace(hf_tok, backend, plan)
    bad = enc(hf_tok, "Hello")[0]
    assert not t.c.accept_token(bad)
    assert f"token {bad}" in t.c.error_message() and "rejected" in t.c.error_message()
    assert not t.c.accept_token(enc(hf_tok, "{")[0]), "a failed constraint stays failed"


def test_choices_are_independent_and_the_compiled_grammar_is_shared(hf_tok, backend, qwen3):
    profile, ids = qwen3
    plan = compile_request(profile, InitialState.CONTENT, ids, response_format={"type": "json_object"})
    a, b = Trace(hf_tok, backend, plan), Trace(hf_tok, backend, plan)
    assert a.c.matcher is not b.c.matcher
    a.feed(enc(hf_tok, '{"x": 1}'))
    assert a.c.is_terminated() and not b.c.is_terminated()
    assert b.allowed()[enc(hf_tok, "{")[0]]
    assert backend.cached(plan.grammar)


def test_parallel_filler_matches_each_constraint_alone(hf_tok, backend, qwen3):
    profile, ids = qwen3
    close = tid(hf_tok, "</think>")
    plans = [
        compile_request(profile, InitialState.REASONING, ids, response_format={"type": "json_object"}),
        compile_request(profile, InitialState.REASONING, ids, response_format={"type": "json_object"},
                        thinking_budget=1),
        compile_request(profile, InitialState.CONTENT, ids, tools=[WEATHER], tool_choice="required"),
        compile_request(profile, InitialState.REASONING, ids, thinking_budget=2),
    ]
    feeds = [enc(hf_tok, "x") + [close] + enc(hf_tok, '{"a'), enc(hf_tok, "x"), [], enc(hf_tok, "y")]
    cs = [Trace(hf_tok, backend, p).feed(f).c for p, f in zip(plans, feeds)]
    words = (backend.vocab_size + 31) // 32
    par = torch.zeros(len(cs), words, dtype=torch.int32)
    backend.bitmask_filler()(cs, par)
    for row, c in enumerate(cs):
        one = torch.zeros(1, words, dtype=torch.int32)
        c.fill_bitmask(one, 0)
        assert torch.equal(par[row], one[0]), row


@pytest.mark.parametrize("initial", [InitialState.REASONING, InitialState.CONTENT])
def test_grammar_and_parser_leave_reasoning_at_the_same_token(hf_tok, backend, initial):
    """I10: the tokens during which the grammar still allows the close delimiter are exactly the parser's reasoning
    tokens plus the close token itself; a spelled `</think>` moves neither."""
    from ember.parsers.pipeline import DELIMITER, ParserSetup

    setup = ParserSetup.from_tokenizer(hf_tok, "qwen3")
    open_, close = setup.delimiter_ids["<think>"], setup.delimiter_ids["</think>"]
    thought = spelled(hf_tok, "\nThe user wants JSON. ", "</", "think", ">", " written out is not the end.\n")
    ids = ([] if initial is InitialState.REASONING else [open_]) + thought + [close] + \
        enc(hf_tok, '\n\n{"a": 12}') + [tid(hf_tok, "<|im_end|>")]
    plan = compile_request(setup.profile, initial, setup.delimiter_ids, response_format={
        "type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}})
    t = Trace(hf_tok, backend, plan)
    grammar_reasoning = []
    for k, tok_id in enumerate(ids):
        if t.allowed()[close]:
            grammar_reasoning.append(k)
        t.feed([tok_id])
    channels = setup.pipeline(initial=initial).feed(ids).token_channels
    parser_reasoning = [k for k, ch in enumerate(channels) if ch == "reasoning"]
    switch = ids.index(close)
    assert channels[switch] == DELIMITER
    assert grammar_reasoning == parser_reasoning + [switch]
    assert len(parser_reasoning) == len(thought)


def test_a_close_delimiter_that_is_not_one_token_ends_reasoning_as_text_in_both(hf_tok, backend):
    """Where `</think>` is not a single token (DeepSeek-V3's vocabulary), grammar and parser both end the thought at
    its first spelling."""
    from ember.parsers.pipeline import ParserSetup, parse_all

    setup = ParserSetup.from_tokenizer(hf_tok, "qwen3")
    demoted = {t: i for t, i in setup.delimiter_ids.items() if t not in ("<think>", "</think>")}
    plan = compile_request(setup.profile, InitialState.REASONING, demoted, response_format={"type": "json_object"})
    thought, close = enc(hf_tok, "Let me think."), spelled(hf_tok, " </", "think", ">")
    t = Trace(hf_tok, backend, plan).feed(thought + close)
    assert not t.allowed()[enc(hf_tok, " more")[0]], "after the spelled close only the answer"
    t.feed(enc(hf_tok, '\n{"x": 1}'))
    assert t.c.is_terminated()
    pipe = dataclasses.replace(setup, delimiter_ids=demoted).pipeline(initial=InitialState.REASONING)
    parsed = parse_all(pipe, thought + close + enc(hf_tok, '\n{"x": 1}'))
    assert parsed.reasoning.strip() == "Let me think." and json.loads(parsed.content) == {"x": 1}
    with pytest.raises(GrammarError, match="single token"):
        compile_request(setup.profile, InitialState.REASONING, demoted, thinking_budget=4)
