"""Stop strings: cut or kept, withheld while partial, independent of chunking; text of the tokens up to min_tokens
cannot end a match."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from ember.parsers.stop import StopMatcher, StopStrings


def run(stops, chunks, include=False):
    m = StopMatcher(stops, include)
    out = []
    for c in chunks:
        out.append(m.feed(c))
        if m.stopped:
            break
    out.append(m.flush())
    return "".join(out), m


def reference(text: str, stops, include: bool, quiet: int = 0) -> tuple[str, str | None]:
    """The stop string complete first in the whole text (earliest end, then first listed) past its first ``quiet``
    characters, cut there."""
    starts = {s: text.find(s, max(0, quiet - len(s) + 1)) for s in stops if s}
    order = {s: n for n, s in reversed(list(enumerate(stops)))}
    found = [(i + len(s), order[s], s) for s, i in starts.items() if i >= 0]
    if not found:
        return text, None
    end, _, s = min(found)
    return (text[:end] if include else text[:end - len(s)]), s


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
    assert run(["bcd", "abcd"], ["xabcd"])[0] == "xa"  # the same end: the first listed, as vLLM picks
    assert run(["abcd", "bcd"], ["xab", "cd"])[0] == "x"


def test_a_long_stop_string_costs_linear_memory_and_time():
    """A 60k-character stop string (a client's mistake or an attack) must not build its prefixes (that took 2.5 GB
    and seconds per choice); a near miss is withheld and released whole."""
    import tracemalloc

    tracemalloc.start()
    m = StopMatcher(["x" * 60_000 + "y"])
    out = "".join(m.feed("x" * 50) for _ in range(1000))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert out == "" and m.held == "x" * 50_000 and peak < 20_000_000
    assert m.feed("xz") == "x" * 50_001 + "z" and not m.stopped


def test_thousands_of_stop_strings_sharing_first_characters_match_as_the_reference():
    """20k stop strings whose first characters are common letters (each character fed cost a step per stop string
    that could start there: a stream of such a request stalled every other client for seconds); one automaton,
    shared by two choices that read different text."""
    import random
    import string

    letters = string.ascii_letters + ' .,"'
    stops = [letters[i % len(letters)] + "QQ" + letters[i * 7 % len(letters)] + str(i) for i in range(20_000)]
    shared = StopStrings(stops)
    rng = random.Random(0)
    def noise(n: int) -> str:
        return "".join(rng.choice(letters + "Q0123456789") for _ in range(n))

    near = stops[rng.randrange(len(stops))]
    texts = [noise(3000), noise(1500) + stops[rng.randrange(len(stops))] + noise(1500),
             noise(2000) + near[:-1] + "!" + near + noise(900), noise(3000)]
    matchers = [StopMatcher(shared) for _ in texts]
    outs: list[list[str]] = [[] for _ in texts]
    for i in range(0, 3000, 3):  # the choices' tokens interleaved, as a request's steps come
        for text, m, out in zip(texts, matchers, outs):
            if not m.stopped:
                out.append(m.feed(text[i:i + 3]))
    for text, m, out in zip(texts, matchers, outs):
        assert ("".join(out) + m.flush(), m.matched) == reference(text, stops, False)
    assert sum(m.stopped for m in matchers) >= 2


ALPHA = st.text(alphabet="ab\n😊", max_size=30)


@settings(max_examples=400, deadline=None)
@given(ALPHA, st.lists(st.text(alphabet="ab\n😊", min_size=1, max_size=4), max_size=6), st.booleans(), st.data())
def test_any_chunking_equals_the_whole_text_reference(text, stops, include, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    got, m = run(stops, chunks, include)
    want, matched = reference(text, stops, include)
    assert got == want
    assert m.matched == matched


def test_a_stop_string_ending_within_the_min_tokens_text_does_not_stop():
    m = StopMatcher(["\n\n", "ab"])
    assert m.feed("x\n\ny a", check=False) == "x\n\ny " and not m.stopped and m.held == "a"
    assert m.feed("b", check=True) == "" and m.matched == "ab"  # began in the unchecked text, ends in checked


@settings(max_examples=300, deadline=None)
@given(ALPHA, st.lists(st.text(alphabet="ab\n😊", min_size=1, max_size=4), max_size=3), st.booleans(), st.data())
def test_any_chunking_with_an_unchecked_start_equals_the_reference(text, stops, include, data):
    quiet = data.draw(st.integers(0, len(text)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)) + [quiet])
    m, out = StopMatcher(stops, include), []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        out.append(m.feed(text[a:b], check=b > quiet))
        if m.stopped:
            break
    out.append(m.flush())
    assert ("".join(out), m.matched) == reference(text, stops, include, quiet)
