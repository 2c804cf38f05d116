"""DeepSeek, GLM-4.5 and Kimi K2 syntaxes on random and hostile token streams made of their own markers (as token IDs
or spelled as text): never raise, the same events for every chunking, every call ended once, every byte kept (DeepSeek
and Kimi pass arguments through; only an argument-less call gains its `{}`)."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.parsers.profiles import get_profile
from tests.parsers.test_machine_common import fold, machine, merged, raw_text, run
from tests.parsers.test_machine_properties import PIECES, per_char

BODY_PIECES = ['{"a": ', '"x"}', "}", "[1, ", "function", "get_weather", "functions.f:0", "\n```json\n", "\n```",
               " ", "\n", "city", "3", "</arg_value>", "<arg_key>"]


def _ids(profile: str) -> dict[str, int]:
    p = get_profile(profile)
    return {t: 3000 + i for i, t in enumerate(sorted(p.terminals[n] for n in p.token_id_terminals))}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["deepseek_v3", "glm45", "kimi_k2"]), st.booleans(), st.sampled_from(["REASONING", "CONTENT"]),
       st.data())
def test_random_streams_never_raise_and_keep_every_byte(profile, by_id, initial, data):
    ids = _ids(profile)
    specials = [(ids[t] if by_id else None, t) for t in ids]
    piece = st.sampled_from(PIECES + BODY_PIECES).map(lambda t: (None, t))
    toks = data.draw(st.lists(st.one_of(piece, st.sampled_from(specials)), max_size=30))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"properties": {
        "city": {"type": "string"}, "n": {"type": "integer"}}}}}]
    known = ids if by_id else {}
    events = run(machine(profile, known, initial, tools), toks)
    assert merged(events) == merged(run(machine(profile, known, initial, tools), per_char(toks)))
    f = fold(events)
    assert all(ended for *_, ended in f.calls)
    if profile != "glm45":
        got, want = sorted(raw_text(events)), sorted("".join(t for _, t in toks))
        for _, args, _ in f.calls:
            if args == "{}" and got != want:
                got.remove("{")
                got.remove("}")
        assert got == want
