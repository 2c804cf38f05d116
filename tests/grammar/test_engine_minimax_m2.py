"""Forced tool calls in MiniMax-M2's syntax: the grammar takes what the real MiniMax-M2 chat template renders for an
assistant turn with tool calls (several invokes in one `<minimax:tool_call>` block), the `minimax_m2` parser reads the
same calls back, and values of the wrong type, extra invokes and unwritable parameter names are refused. No MiniMax
vocabulary is under ../shared/data: a byte-level BPE tokenizer with MiniMax's special tokens stands in for it."""
from __future__ import annotations

import json

import pytest

from ember.grammar import GrammarBackend, GrammarError, compile_request
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import ParserSetup, parse_all
from tests.conftest import shared_path
from tests.parsers.test_tools_minimax_m2 import EOT, SPECIALS, invoke

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "hourly": {"type": "boolean"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "opts": {"type": "object", "properties": {"lang": {"type": "string"}}},
            "hours": {"type": "array", "items": {"type": "integer"}}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer"}, "label": {"type": "string"}},
        "required": ["hour"]}}},
]
CALLS = [("get_weather", {"city": 'Zürich "old" <town>', "days": 3, "hourly": True, "unit": "celsius",
                          "opts": {"lang": "de"}, "hours": [9, 12]}),
         ("set_alarm", {"hour": 7, "label": "wake up"})]
NAMED = {"type": "function", "function": {"name": "set_alarm"}}


@pytest.fixture(scope="module")
def mm():
    """The stand-in tokenizer, its parser setup and grammar backend (`[e~[` ends the turn, as MiniMax's EOS)."""
    from tests.parsers.family_tokenizers import byte_bpe

    tok = byte_bpe(SPECIALS)
    eos = [tok.token_to_id(EOT)]
    return tok, ParserSetup.from_tokenizer(tok, "minimax_m2", drop_ids=eos), GrammarBackend.from_tokenizer(
        tok, eos_ids=eos)


def _plan(setup, choice, parallel: bool = True, tools=TOOLS):
    return compile_request(setup.profile, InitialState.REASONING, setup.delimiter_ids, tools=tools,
                           tool_choice=choice, parallel_tool_calls=parallel)


def _accepted(tok, backend, plan, reply: str) -> bool:
    """Every token of ``reply`` passes, its final end of turn included (allowed only where the grammar may end)."""
    assert reply.endswith(EOT)
    c = backend.constraint(plan)
    return all(c.accept_token(t) for t in tok.encode(reply, add_special_tokens=False).ids)


def _rendered_reply(tok) -> tuple[str, str]:
    """(prompt, reply): the real template's generation prompt, and what it renders after it for an assistant turn
    with a thought and ``CALLS``."""
    from transformers import PreTrainedTokenizerFast

    from ember.server.chat import render

    template = shared_path("templates", "llama.cpp", "MiniMax-M2.jinja").read_text()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    user = [{"role": "user", "content": "Weather in Zürich, and wake me at 7?"}]
    turn = {"role": "assistant", "content": "", "reasoning_content": "Two tools are needed.",
            "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                           for i, (n, a) in enumerate(CALLS)]}
    prompt = render(hf, template, user, tools=TOOLS)
    full = render(hf, template, user + [turn], tools=TOOLS, add_generation_prompt=False)
    assert full.startswith(prompt) and prompt.endswith("]~b]ai\n<think>\n")
    return prompt, full[len(prompt):].rstrip("\n")


def test_the_rendered_template_turn_is_accepted_and_parses_back_into_the_same_calls(mm):
    tok, setup, backend = mm
    prompt, reply = _rendered_reply(tok)
    assert reply.endswith("</minimax:tool_call>" + EOT) and reply.count("<invoke name=") == 2
    initial = setup.initial_state(tok.encode(prompt, add_special_tokens=False).ids)
    assert initial is InitialState.REASONING
    plan = _plan(setup, "required")
    assert _accepted(tok, backend, plan, reply)
    out = parse_all(setup.pipeline(initial=initial, tools=TOOLS), tok.encode(reply, add_special_tokens=False).ids)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == CALLS
    assert (out.reasoning, out.content, out.malformed) == ("Two tools are needed.\n", "", [])


def test_named_and_single_call_choices_take_exactly_one_invoke(mm):
    tok, setup, backend = mm
    one = "ok\n</think>\n\n\n<minimax:tool_call>\n" + invoke("set_alarm", hour="7") + "</minimax:tool_call>" + EOT
    two = one.replace("</minimax:tool_call>", invoke("set_alarm", hour="8") + "</minimax:tool_call>")
    for plan in (_plan(setup, NAMED), _plan(setup, "required", parallel=False)):
        backend.validate(plan.grammar)
        assert _accepted(tok, backend, plan, one)
        assert not _accepted(tok, backend, plan, two)
    assert _accepted(tok, backend, _plan(setup, "required"), two)
    assert not _accepted(tok, backend, _plan(setup, NAMED), one.replace("set_alarm", "get_weather")
                         .replace('"hour">7', '"city">Oslo'))


def test_auto_with_a_strict_tool_leaves_text_free_and_takes_one_block(mm):
    tok, setup, backend = mm
    plan = _plan(setup, "auto")
    block = ("<minimax:tool_call>\n" + invoke("get_weather", city="Oslo") + invoke("set_alarm", hour="6")
             + "</minimax:tool_call>")
    assert _accepted(tok, backend, plan, "ok\n</think>\n\nIt is sunny." + EOT)
    assert _accepted(tok, backend, plan, "ok\n</think>\n\nLet me check.\n" + block + EOT)
    assert not _accepted(tok, backend, plan, "ok\n</think>\n\nLet me check.\n" + block + "\n" + block + EOT)


@pytest.mark.parametrize("bad", ['"days">three<', '"days">30<', '"hourly">yes<', '"unit">kelvin<', '"hours">[9, "x"]<',
                                 '"opts">{"lang": 1}<', '"colour">red<'])
def test_values_of_the_wrong_type_are_refused(mm, bad):
    tok, setup, backend = mm
    good = ("ok\n</think>\n\n<minimax:tool_call>\n" + invoke("get_weather", city="Oslo", days="3") +
            "</minimax:tool_call>" + EOT)
    plan = _plan(setup, "required")
    assert _accepted(tok, backend, plan, good)
    key, value = bad[1:-1].split('">')
    attempt = good.replace('<parameter name="days">3<', f'<parameter name="{key}">{value}<')
    assert attempt != good and not _accepted(tok, backend, plan, attempt)


def test_parameter_names_that_cannot_be_written_are_refused(mm):
    _, setup, _ = mm
    for name in ('a"b', "a>b", "a\nb", ""):
        tools = [{"type": "function", "function": {"name": "odd_tool", "parameters": {
            "type": "object", "properties": {name: {"type": "string"}}}}}]
        with pytest.raises(GrammarError, match="odd_tool"):
            _plan(setup, "required", tools=tools)


def test_an_enum_value_holding_the_text_closer_is_refused_strict_and_left_out_lenient(mm):
    """`</parameter>` is text in this format, and the parser ends a value at its first one: an enum value holding it
    came back as `""` (breaking the strict schema) with the rest leaked into content. Strict: a 400 naming the
    parameter; lenient: the value is left out of the choices."""
    tok, setup, backend = mm

    def tools(strict: bool) -> list[dict]:
        return [{"type": "function", "function": {"name": "f", "strict": strict, "parameters": {
            "type": "object", "properties": {"mode": {"type": "string", "enum": ["a</parameter>b", "ok"]}},
            "required": ["mode"], "additionalProperties": False}}}]

    with pytest.raises(GrammarError, match=r"tools\[0\]\.function\.parameters\.properties\.mode: value "
                                           r"'a</parameter>b' cannot be written"):
        _plan(setup, "required", tools=tools(True))
    plan = _plan(setup, "required", tools=tools(False))
    reply = "ok\n</think>\n\n<minimax:tool_call>\n" + invoke("f", mode="{}") + "</minimax:tool_call>" + EOT
    assert _accepted(tok, backend, plan, reply.replace("{}", "ok"))
    assert not _accepted(tok, backend, plan, reply.replace("{}", "a</parameter>b"))
    assert not _accepted(tok, backend, plan, reply.replace("{}", ""))
