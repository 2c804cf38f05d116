"""vLLM's structural tags: free text in which a trigger must go on as one of its structures (begin, JSON of the
schema, end). A text trigger ends the free text at its first occurrence; a one-token trigger (Qwen3's `<tool_call>`)
counts only as that token, as the parsers read delimiters."""
from __future__ import annotations

import pytest

from ember.grammar import GrammarError, compile_request
from ember.parsers.initial import InitialState
from ember.parsers.profiles import get_profile
from ember.parsers.tokens import resolve_delimiters

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}


def _plan(rf: dict):
    return compile_request(get_profile("none"), InitialState.CONTENT, {}, response_format=rf)


def _accepts(hf_tok, backend, plan, pieces: list, eos: bool = True) -> bool:
    """Every token passes: text pieces tokenized, ints as token IDs, then (``eos``) the end of turn."""
    c = backend.constraint(plan)
    ids = [t for p in pieces for t in ([p] if isinstance(p, int) else hf_tok.encode(p, add_special_tokens=False))]
    if eos:
        ids.append(backend.eos_ids[0])
    return all(c.accept_token(t) for t in ids)


TEXT_TAG = {"type": "structural_tag", "triggers": ["<function="],
            "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
                           {"begin": "<function=get_time>", "schema": TIME, "end": "</function>"}]}


def test_text_triggers_force_one_of_their_structures(hf_tok, backend):
    plan = _plan(TEXT_TAG)
    ok = ['Let me check. <function=get_weather>{"city": "Paris"}</function> and ',
          '<function=get_time>{"tz": "CET"}</function> done.']
    assert _accepts(hf_tok, backend, plan, ok)
    assert _accepts(hf_tok, backend, plan, ["No call at all, just text."])
    assert not _accepts(hf_tok, backend, plan, ['<function=get_weather>{"city": 3}</function>'])
    assert not _accepts(hf_tok, backend, plan, ['<function=get_news>{"q": "x"}</function>'])
    assert not _accepts(hf_tok, backend, plan, ['<function=get_time>{"tz": "PST"}</function>'])
    assert not _accepts(hf_tok, backend, plan, ['<function=get_weather>{"city": "Paris"}'])  # no end


def test_a_one_token_trigger_counts_only_as_that_token(hf_tok, backend):
    from ember.server.admission import with_token_ids

    rf = with_token_ids({"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
        {"begin": "<tool_call>\n", "schema": WEATHER, "end": "\n</tool_call>"}]}, hf_tok)
    ids = resolve_delimiters(hf_tok, ["<tool_call>", "</tool_call>"])
    if None in ids.values():
        pytest.skip("this vocabulary has no <tool_call> token")
    assert rf["token_ids"] == ids
    plan = _plan(rf)
    call = [ids["<tool_call>"], '\n{"city": "Rome"}\n', ids["</tool_call>"]]
    assert _accepts(hf_tok, backend, plan, ["Sure: ", *call, " Done."])
    assert not _accepts(hf_tok, backend, plan, ["Sure: ", ids["<tool_call>"], "hello"], eos=False)
    spelled = '<tool_call>\n{"city": 4}\n</tool_call>'  # the same text in pieces is ordinary text
    assert _accepts(hf_tok, backend, plan, ["Sure: ", *[hf_tok.encode(ch, add_special_tokens=False)[0]
                                                         for ch in spelled]])


@pytest.mark.parametrize("rf,match", [
    ({"triggers": [], "structures": [{"begin": "<f>", "schema": {}, "end": ""}]}, "triggers must be"),
    ({"triggers": ["<f"], "structures": []}, "structures must be"),
    ({"triggers": ["<f"], "structures": [{"begin": "<g>", "schema": {}, "end": ""}]}, "starts with none"),
    ({"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": [], "end": ""}]}, "schema must be"),
    ({"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {}}]}, "begin and end strings"),
])
def test_malformed_tags_are_grammar_errors_naming_the_field(rf, match):
    with pytest.raises(GrammarError, match=match) as e:
        _plan({"type": "structural_tag", "param": "structured_outputs.structural_tag", **rf})
    assert e.value.message.startswith("structured_outputs.structural_tag")


def test_a_trigger_that_starts_with_an_added_token_is_opened_by_that_token(hf_tok, backend):
    """``"<tool_call>\\n"`` (vLLM's examples for Qwen): the token opens the structure and the newline must follow."""
    from ember.server.admission import with_token_ids

    ids = resolve_delimiters(hf_tok, ["<tool_call>", "</tool_call>"])
    if None in ids.values():
        pytest.skip("this vocabulary has no <tool_call> token")
    rf = with_token_ids({"type": "structural_tag", "triggers": ["<tool_call>\n"], "structures": [
        {"begin": "<tool_call>\n", "schema": WEATHER, "end": "\n</tool_call>"}]}, hf_tok)
    plan = _plan(rf)
    call = [ids["<tool_call>"], '\n{"city": "Rome"}\n', ids["</tool_call>"]]
    assert _accepts(hf_tok, backend, plan, ["Sure: ", *call, " Done."])
    assert _accepts(hf_tok, backend, plan, ["No call."])
    assert not _accepts(hf_tok, backend, plan, ["Sure: ", ids["<tool_call>"], '{"city": "Rome"}'], eos=False)
    assert not _accepts(hf_tok, backend, plan, ["Sure: ", ids["<tool_call>"], '\n{"city": 4}\n',
                                                ids["</tool_call>"]])
    with pytest.raises(GrammarError, match="after text") as e:
        _plan(with_token_ids({"type": "structural_tag", "triggers": ["\n<tool_call>"], "structures": [
            {"begin": "\n<tool_call>\n", "schema": WEATHER, "end": "\n</tool_call>"}]}, hf_tok))
    assert e.value.message.startswith("response_format.triggers")
