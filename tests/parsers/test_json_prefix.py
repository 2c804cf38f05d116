"""`JsonObjectPrefix`: every valid JSON object passes whole under any chunking, and a broken text stops at the same
character however it is chunked, leaving a prefix the anthropic SDK's partial parser reads."""
from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from ember.parsers.json_prefix import JsonObjectPrefix

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


def _accepted(text: str, cuts: list[int]) -> str:
    prefix = JsonObjectPrefix()
    bounds = [0, *sorted({c for c in cuts if c < len(text)}), len(text)]
    return "".join(text[a:a + prefix.feed(text[a:b])] for a, b in zip(bounds, bounds[1:]))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _json, max_size=5), st.booleans(), st.sampled_from([None, 2]),
       st.lists(st.integers(min_value=1, max_value=200), max_size=8))
def test_a_valid_object_passes_whole_under_any_chunking(value, ascii_only, indent, cuts):
    text = " " + json.dumps(value, ensure_ascii=ascii_only, indent=indent) + "\n"
    assert _accepted(text, cuts) == text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}[]",:0123456789.eE+-tfnrulasx \\\x01\'', max_size=30),
       st.lists(st.integers(min_value=1, max_value=30), max_size=6))
def test_a_broken_text_stops_at_the_same_character_under_any_chunking(text, cuts):
    from jiter import from_json

    whole = _accepted(text, [])
    assert _accepted(text, cuts) == whole and text.startswith(whole)
    if whole.strip():
        from_json(whole.encode(), partial_mode=True)  # raises on a prefix no JSON value continues


def test_what_breaks_an_object():
    for text, kept in [('{"city": Paris}', '{"city": '), ("[1, 2]", ""), ('"Paris"', ""), ("{'a': 1}", "{"),
                       ('{"a": 1,}', '{"a": 1,'), ('{"a": True}', '{"a": '), ('{"a": 01}', '{"a": 0'),
                       ('{"a": "x\x01"}', '{"a": "x'), ('{"a": "\\q"}', '{"a": "\\'), ('{"a": 1} x', '{"a": 1} ')]:
        assert _accepted(text, []) == kept, text
