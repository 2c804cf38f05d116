"""Stop strings: cut or kept, withheld while partial, independent of chunking."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from ember.parsers.stop import StopMatcher


def run(stops, chunks, include=False):
    m = StopMatcher(stops, include)
    out = []
    for c in chunks:
        out.append(m.feed(c))
        if m.stopped:
            break
    out.append(m.flush())
    return "".join(out), m


def reference(text: str, stops, include: bool) -> tuple[str, str | None]:
    """The stop string complete first in the whole text (earliest end, then longest), cut there."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s and s in text]
    if not found:
        return text, None
    end, neg, s = min(found)
    return (text[:end] if include else text[:end + neg]), s


def test_cut_at_the_stop_string():
    text, m = run(["\n\n"], ["Hello", " world\n", "\nMore text"])
    assert text == "Hello world" and m.stopped and m.matched == "\n\n"


def test_include_stop_str_in_output_keeps_it():
    text, m = run(["END"], ["abc E", "N", "Dxyz"], include=True)
    assert text == "abc END" and m.stopped


def test_partial_match_is_withheld_then_released():
    m = StopMatcher(["</answer>"])
    assert m.feed("value </ans") == "value " and m.held == "</ans"
    assert m.feed("wer? no") == "</answer? no" and not m.stopped
    assert m.feed("tail </") == "tail " and m.flush() == "</"


def test_no_stops_passes_text_through():
    m = StopMatcher([])
    assert m.feed("anything") == "anything" and m.flush() == "" and not m.stopped


def test_nothing_after_a_match_is_released():
    m = StopMatcher(["STOP"])
    assert m.feed("aSTOPb") == "a"
    assert m.feed("more") == "" and m.flush() == ""


def test_first_completed_stop_wins():
    assert run(["abcd", "bc"], ["abcd"])[0] == "a"
    assert run(["abcd", "bc"], ["a", "b", "c", "d"])[0] == "a"
    assert run(["bcd", "abcd"], ["xabcd"])[0] == "x"


ALPHA = st.text(alphabet="ab\n😊", max_size=30)


@settings(max_examples=400, deadline=None)
@given(ALPHA, st.lists(st.text(alphabet="ab\n😊", min_size=1, max_size=4), max_size=3), st.booleans(), st.data())
def test_any_chunking_equals_the_whole_text_reference(text, stops, include, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    got, m = run(stops, chunks, include)
    want, matched = reference(text, stops, include)
    assert got == want
    assert m.matched == matched
