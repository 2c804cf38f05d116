"""XML-style tool calls (Qwen3-Coder, GLM-4.5, MiniMax-M2) cut by the length limit at every character: the call is
returned as far as it streamed, with no close-tag markup in its values and no non-string value turned into a string,
and feeding one token at a time gives what one feed gives."""
from __future__ import annotations

import json

import pytest

from ember.parsers.pipeline import parse_all
from ember.parsers.result import fold
from tests.parsers.test_pipeline import C, chatml, pipe, setup as family_setup

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "n": {"type": "integer"}}}}}]
FULL = '{"city": "Paris", "n": 42}'
CALLS = {  # (opener, body, closer, the value close tag as the template writes it)
    "qwen3_coder": ("<tool_call>", "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=n>\n42\n</parameter>\n</function>\n", "</tool_call>", "\n</parameter>"),
    "glm45": ("<tool_call>", "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>n</arg_key>\n<arg_value>42</arg_value>\n", "</tool_call>", "</arg_value>"),
    "minimax_m2": ("<minimax:tool_call>", '\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                   '<parameter name="n">42</parameter>\n</invoke>\n', "</minimax:tool_call>", "</parameter>"),
}


def char_tokens(s, *parts: str) -> list[int]:
    """A delimiter that is one token as that token, other text one token per character (a cut at every character)."""
    tok = chatml()[0]
    out: list[int] = []
    for p in parts:
        i = s.delimiter_ids.get(p)
        out += [i] if i is not None else [t for ch in p for t in tok.encode(ch, add_special_tokens=False).ids]
    return out


def cut_arguments(args: str) -> dict:
    """The parameters of a cut call's arguments (a JSON object's prefix)."""
    for end in ("", "}", '"}'):
        try:
            return json.loads((args or "{") + end)
        except ValueError:
            pass
    raise AssertionError(f"not a JSON object's prefix: {args!r}")


@pytest.mark.parametrize("profile", list(CALLS))
def test_calls_cut_at_every_character_hold_no_markup_and_only_typed_values(profile):
    s = family_setup(profile)
    opener, body, closer, close_tag = CALLS[profile]
    ids = char_tokens(s, opener, body, closer)
    opened = len(char_tokens(s, opener))       # MiniMax's opener is text in this vocabulary: cut inside, it is content
    whole = parse_all(pipe(s, C, tools=TOOLS), ids)
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("get_weather", FULL)]
    seen_partial_tag = False
    for k in range(len(ids) + 1):
        got = parse_all(pipe(s, C, tools=TOOLS), ids[:k], "length")
        p = pipe(s, C, tools=TOOLS)
        assert fold([e for i in ids[:k] for e in p.feed([i]).events] + p.finish("length")) == got, k
        assert got.malformed == [] and (got.content == "" or k < opened), k
        if not got.tool_calls:
            continue
        (call,) = got.tool_calls
        assert "<" not in call.arguments and FULL.startswith(call.arguments), (k, call.arguments)
        params = cut_arguments(call.arguments)
        assert list(params) == ["city", "n"][:len(params)], (k, params)
        assert "Paris".startswith(params.get("city", "")), (k, params)
        if "n" in params:
            assert type(params["n"]) is int and "42".startswith(str(params["n"])), (k, params)
        tail = got.dropped[-1].text if got.dropped else ""
        if len(tail) > 1 and close_tag.startswith(tail):   # cut inside the value's close tag: that text is Dropped
            seen_partial_tag = True
    assert seen_partial_tag
