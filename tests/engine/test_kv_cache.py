"""The KV block allocator: reference counts, prefix cache hits and LRU eviction of unreferenced cached blocks."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.engine.kv_cache import KVCacheManager, block_hash
from ember.engine.params import SamplingParams
from ember.engine.sequence import Sequence

BS = 16


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams())


def admit(kv: KVCacheManager, s: Sequence) -> int:
    """Admit ``s`` with its prefix hits, compute its whole prompt, register full blocks; returns the hit tokens."""
    hits = kv.lookup(s)
    cached = len(hits) * kv.block_size
    assert kv.allocate_slots(s, s.num_tokens - cached, hits)
    s.num_computed_tokens = s.num_tokens
    kv.cache_full_blocks(s)
    return cached


def test_second_request_reuses_a_64_token_prefix_and_shares_its_blocks():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    prefix = list(range(1000, 1064))
    a, b = seq("a", prefix + [1, 2, 3]), seq("b", prefix + [7, 8, 9, 10, 11])
    assert admit(kv, a) == 0
    assert admit(kv, b) == 64
    assert kv.prefix_hits == 64
    assert kv.prefix_queries == a.num_tokens + b.num_tokens
    assert b.block_ids[:4] == a.block_ids[:4]
    assert all(kv.ref_count(blk) == 2 for blk in a.block_ids[:4])
    assert b.block_ids[4] != a.block_ids[4] and kv.ref_count(b.block_ids[4]) == 1
    kv.check_integrity([a, b])


def test_last_prompt_token_is_never_served_from_cache():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    prompt = list(range(64))
    admit(kv, seq("a", prompt))
    again = seq("b", prompt)
    assert len(kv.lookup(again)) == 3  # 48 tokens: the 64th token must be computed to get logits
    assert admit(kv, again) == 48
    assert admit(kv, seq("c", prompt + [5])) == 64


@settings(max_examples=60, deadline=None)
@given(cached=st.lists(st.integers(0, 3), min_size=0, max_size=80),
       query=st.lists(st.integers(0, 3), min_size=1, max_size=80))
def test_hits_are_a_block_aligned_token_prefix_shorter_than_the_query(cached, query):
    kv = KVCacheManager(num_blocks=64, block_size=4)
    if cached:
        admit(kv, seq("a", cached))
    q = seq("q", query)
    hits = kv.lookup(q)
    n = len(hits) * 4
    assert n <= len(query) - 1
    assert query[:n] == cached[:n]
    # the longest chain: the next block is not a cached prefix of ``cached``'s full computed blocks
    next_block_full_in_cached = len(cached) >= n + 4 and query[:n + 4] == cached[:n + 4]
    assert not (next_block_full_in_cached and n + 4 <= len(query) - 1)


def test_only_full_computed_blocks_are_cached():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = seq("a", list(range(40)))
    assert kv.allocate_slots(a, 40)
    assert len(a.block_ids) == 3
    a.num_computed_tokens = 20
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 1
    a.num_computed_tokens = 40
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 2  # the third block holds 8 of 16 tokens
    assert [kv.is_cached(blk) for blk in a.block_ids] == [True, True, False]


def test_equal_block_tokens_under_a_different_parent_do_not_hit():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, seq("a", [1, 1, 1, 1, 2, 2, 2, 2, 0]))
    assert kv.lookup(seq("b", [9, 9, 9, 9, 2, 2, 2, 2, 0])) == []
    assert len(kv.lookup(seq("c", [1, 1, 1, 1, 2, 2, 2, 3, 0]))) == 1
    assert block_hash(b"x", [1, 2]) != block_hash(b"x", [2, 1]) != block_hash(b"y", [1, 2])


def test_freed_cached_blocks_stay_reusable_and_are_evicted_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = seq("a", list(range(17)))  # 4 full blocks + 1 partial
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 6 and kv.num_evictable_blocks == 4
    assert kv.usage() == 0.0
    # the first request's blocks come back, no recompute
    b = seq("b", list(range(17)))
    assert admit(kv, b) == 16
    kv.free(b)
    # take fresh blocks: the 2 plain free ones first, then evict the tail of the freed chain
    filler = seq("f", [99] * 12)
    assert kv.allocate_slots(filler, 12)
    assert kv.num_evictions == 1
    assert len(kv.lookup(seq("c", list(range(17))))) == 3
    kv.check_integrity([filler])


def test_allocation_that_does_not_fit_changes_nothing_and_respects_the_reserve():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = seq("a", list(range(10)))
    assert not kv.allocate_slots(a, 10, reserve=2)  # 3 blocks + 2 reserved > 4
    assert a.block_ids == [] and kv.num_free_blocks == 4
    assert kv.allocate_slots(a, 10, reserve=1)
    assert kv.num_free_blocks == 1 and kv.usage() == 0.75
    b = seq("b", list(range(8)))
    assert not kv.allocate_slots(b, 8)
    assert b.block_ids == [] and kv.num_free_blocks == 1
    kv.check_integrity([a])


def test_free_returns_every_block_and_shared_blocks_only_when_the_last_holder_leaves():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a, b = seq("a", list(range(13))), seq("b", list(range(13)))
    admit(kv, a)
    admit(kv, b)
    shared = a.block_ids[:3]
    kv.free(a)
    assert all(kv.ref_count(blk) == 1 for blk in shared)
    kv.check_integrity([b])
    kv.free(b)
    assert kv.num_free_blocks == 10 and b.block_ids == []
    kv.check_integrity([])


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    admit(kv, seq("a", list(range(20))))
    assert admit(kv, seq("b", list(range(20)))) == 0
    assert kv.num_cached_blocks == 0 and kv.prefix_hits == 0


def test_integrity_check_catches_a_leaked_reference():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = seq("a", list(range(6)))
    assert kv.allocate_slots(a, 6)
    with pytest.raises(AssertionError, match="ref count"):
        kv.check_integrity([])  # a's blocks are held but no live sequence is named


def test_a_hash_collision_never_serves_another_prompts_kv(monkeypatch):
    import ember.engine.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "block_hash", lambda parent, token_ids: b"every block collides")
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admit(kv, seq("a", [1, 2, 3, 4, 5]))
    assert kv.lookup(seq("b", [6, 7, 8, 9, 5])) == []  # the stored tokens differ: no hit
    assert len(kv.lookup(seq("c", [1, 2, 3, 4, 5]))) == 1
