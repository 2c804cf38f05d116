"""The registry of saved recurrent states for prefix caching: a save is a hit only after its step ran, the longest
saved prefix wins, full slots give up the least recently used snapshot, and a sequence's rolling output snapshot
reuses its own slot and never displaces a prompt's."""
from __future__ import annotations

from ember.engine.state_snapshots import StateSnapshots


def test_a_pending_save_is_not_a_hit_until_committed():
    s = StateSnapshots(first_slot=5, count=2)
    slot = s.reserve(b"a")
    assert slot in (5, 6)
    assert s.longest([b"a"]) == (0, None)  # the step that fills the slot has not run
    assert s.reserve(b"a") is None  # already pending: not saved twice
    s.commit()
    assert s.longest([b"x", b"a"]) == (2, slot)
    assert s.reserve(b"a") is None


def test_the_longest_saved_prefix_wins():
    s = StateSnapshots(first_slot=0, count=3)
    a, b = s.reserve(b"h1"), s.reserve(b"h3")
    s.commit()
    assert s.longest([b"h1", b"h2", b"h3", b"h4"]) == (3, b)
    assert s.longest([b"h1", b"h2"]) == (1, a)
    assert s.longest([b"z"]) == (0, None)


def test_full_slots_replace_the_least_recently_used():
    s = StateSnapshots(first_slot=10, count=2)
    a, b = s.reserve(b"a"), s.reserve(b"b")
    s.commit()
    s.longest([b"a"])  # "a" used: "b" is now the oldest
    c = s.reserve(b"c")
    s.commit()
    assert c == b and len(s) == 2
    assert s.longest([b"b"]) == (0, None) and s.longest([b"a"]) == (1, a) and s.longest([b"c"]) == (1, c)


def test_no_slot_when_every_one_is_pending():
    s = StateSnapshots(first_slot=0, count=1)
    assert s.reserve(b"a") == 0
    assert s.reserve(b"b") is None  # the only slot is being filled this step
    s.commit()
    assert s.reserve(b"b") == 0 and s.num_saves == 2


def test_an_output_snapshot_rolls_in_its_own_slot_and_never_displaces_a_prompt_snapshot():
    s = StateSnapshots(first_slot=0, count=2)
    p = s.reserve(b"prompt")
    o1 = s.reserve(b"out-1", output=True)
    s.commit()
    assert s.reserve(b"out-2", output=True, replaces=b"out-1") == o1  # rolled forward in place
    s.commit()
    assert s.longest([b"out-1"]) == (0, None) and s.longest([b"x", b"out-2"]) == (2, o1)
    assert s.reserve(b"other-out", output=True) == o1  # full: it takes the oldest output snapshot's slot
    assert s.reserve(b"third-out", output=True) is None  # the rest is a prompt snapshot (or pending)
    s.commit()
    assert s.longest([b"prompt"]) == (1, p)  # now the most recently used
    assert s.reserve(b"prompt-2") == o1  # a prompt snapshot replaces the least recently used of any kind


def test_a_failed_steps_saves_are_dropped_and_their_slots_freed():
    s = StateSnapshots(first_slot=0, count=3)
    s.reserve(b"a")
    s.commit()
    s.reserve(b"b", output=True)
    s.reserve(b"c")
    s.discard_pending()
    s.commit()
    assert s.longest([b"b"]) == (0, None) and s.longest([b"c"]) == (0, None) and s.longest([b"a"])[0] == 1
    assert s.reserve(b"d") is not None and s.reserve(b"e") is not None  # the freed slots, not "a"'s
    s.commit()
    assert s.longest([b"a"])[0] == 1 and len(s) == 3
