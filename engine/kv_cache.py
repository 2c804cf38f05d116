"""Block allocator for the paged KV cache, with reference counts and a prefix cache.

Every block is in exactly one of three states:

- **free**: unreferenced and holding nothing reusable;
- **evictable**: unreferenced but registered in the prefix cache (its KV can be reused by a later request until it is
  evicted, least recently freed first, when a fresh block is needed);
- **in use**: referenced by ``ref_count >= 1`` live sequences (a prefix block shared by two sequences has 2).

Only full blocks are cached. A block's key chains the parent block's key with the block's token IDs through sha256,
so equal keys mean equal prefixes; the tokens are also kept on the block and compared on lookup.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable

from ember.engine.sequence import Sequence

ROOT_HASH = b"ember-prefix-cache-v1"  # the parent of a sequence's first block, without adapter or salt


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes, token_ids: Iterable[int]) -> bytes:
    """The prefix-cache key of a full block: sha256 over the parent's key and the block's token IDs (int64 LE)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def salted_root(root: bytes, salt: str) -> bytes:
    """The prefix-cache root of requests carrying ``salt`` (vLLM's ``cache_salt``): their blocks hash apart from
    every other root's, so only requests with the same salt share cached KV."""
    return hashlib.sha256(root + b"\x00cache_salt\x00" + salt.encode()).digest()


class _Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None


class KVCacheManager:
    """Hands out KV blocks to sequences; ``seq.block_ids`` is the block table it maintains."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._cached: dict[bytes, int] = {}
        self.prefix_hits = 0  # tokens served from the cache, cumulative
        self.prefix_queries = 0  # tokens looked up at a first admission (not a preempted one's), cumulative
        self.num_evictions = 0

    # ---- state -------------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus cached-but-unreferenced (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks in use by live sequences."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def is_cached(self, block_id: int) -> bool:
        return self._blocks[block_id].hash is not None

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache ------------------------------------------------------------------------------------------

    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """``seq.block_hashes`` extended to cover its first ``num_full_blocks`` blocks."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else (seq.cache_root or ROOT_HASH)
            hashes.append(block_hash(parent, seq.token_ids_slice(i * bs, (i + 1) * bs)))
        return hashes

    def block_hash(self, seq: Sequence, num_blocks: int) -> bytes:
        """The prefix-cache key of ``seq``'s first ``num_blocks`` full blocks (the hash of the last of them)."""
        return self._hashes(seq, num_blocks)[num_blocks - 1]

    def lookup(self, seq: Sequence) -> list[int]:
        """Block IDs of the longest chain of cached full blocks that starts ``seq``'s tokens.

        Never covers the whole sequence: at most ``(num_tokens - 1) // block_size`` blocks, so the last token is
        always computed (its logits are needed). Changes nothing.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        bs = self.block_size
        hits: list[int] = []
        for i in range(max_blocks):
            h = self._hashes(seq, i + 1)[i]
            block_id = self._cached.get(h)
            if block_id is None:
                break
            if self._blocks[block_id].token_ids != tuple(seq.token_ids_slice(i * bs, (i + 1) * bs)):
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s blocks that are full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block = self._blocks[seq.block_ids[i]]
            if block.hash is None and hashes[i] not in self._cached:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids_slice(i * bs, (i + 1) * bs))
                self._cached[hashes[i]] = block.block_id
            # else: another sequence computed the same block first; this copy stays private and is freed plainly
        seq.num_registered_blocks = num_full

    # ---- allocation --------------------------------------------------------------------------------------------

    def num_blocks_to_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> int:
        """Blocks ``allocate_slots`` would take from the free count (fresh ones plus evictable prefix hits)."""
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        fresh = max(0, self.blocks_for(num_tokens) - len(seq.block_ids) - len(computed_blocks))
        revived = sum(1 for b in computed_blocks if self._blocks[b].ref_count == 0)
        return fresh + revived

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None,
                       reserve: int = 0) -> bool:
        """Make ``seq.block_ids`` cover ``num_new_tokens`` positions past its computed ones.

        ``computed_blocks`` (from ``lookup``, at admission only) are prefix hits appended first; the caller then
        counts their tokens as computed. Fails, changing nothing, unless at least ``reserve`` blocks stay free after.
        """
        block_ids = seq.block_ids
        bs = self.block_size
        if not computed_blocks and block_ids:  # the common case: a running sequence, often within its last block
            total = (seq.num_computed_tokens + num_new_tokens + bs - 1) // bs
            missing = total - len(block_ids)
            if missing <= 0:
                return True
            if missing + reserve > len(self._free) + len(self._evictable):
                return False
            for _ in range(missing):
                block_ids.append(self._take_fresh())
            return True
        computed_blocks = computed_blocks or []
        needed = self.num_blocks_to_allocate(seq, num_new_tokens, computed_blocks)
        if needed + reserve > self.num_free_blocks:
            return False
        if (not block_ids and seq.num_computed_tokens == 0 and seq.num_preemptions == 0
                and self.enable_prefix_caching and not seq.computes_whole_prompt):
            # a first admission that looked the prefix up (vLLM leaves out a preempted request's, and one that may
            # not read the cache: prompt logprobs, a pooling over every position)
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(computed_blocks) * bs
        for block_id in computed_blocks:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
            block_ids.append(block_id)
        if computed_blocks:
            seq.num_registered_blocks = len(block_ids)
        total = self.blocks_for(seq.num_computed_tokens + len(computed_blocks) * bs + num_new_tokens)
        while len(block_ids) < total:
            block_ids.append(self._take_fresh())
        return True

    def _take_fresh(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block = self._blocks[block_id]
            del self._cached[block.hash]
            block.hash = None
            block.token_ids = None
            self.num_evictions += 1
        self._blocks[block_id].ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references to its blocks; cached ones become evictable, tail blocks first in LRU order."""
        for block_id in reversed(seq.block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)
        seq.block_ids = []
        seq.num_registered_blocks = 0

    # ---- invariants --------------------------------------------------------------------------------------------

    def check_integrity(self, live: Iterable[Sequence] | None = None) -> None:
        """Raise AssertionError unless free + evictable + in-use == total and the bookkeeping agrees.

        With ``live`` (every sequence holding blocks), also check that each block's ref count equals the number of
        live block tables that hold it.
        """
        def check(cond: bool, what: str) -> None:
            if not cond:
                raise AssertionError(f"KV cache integrity: {what}")

        free, evictable = set(self._free), set(self._evictable)
        check(len(free) == len(self._free), "a block is twice in the free list")
        check(not free & evictable, "a block is both free and evictable")
        in_use = [b for b in self._blocks if b.ref_count > 0]
        check(len(free) + len(evictable) + len(in_use) == self.num_blocks,
              f"free {len(free)} + evictable {len(evictable)} + in use {len(in_use)} != {self.num_blocks}")
        for b in self._blocks:
            check(b.ref_count >= 0, f"block {b.block_id} has ref count {b.ref_count}")
            if b.block_id in free:
                check(b.ref_count == 0 and b.hash is None, f"free block {b.block_id} is referenced or cached")
            if b.block_id in evictable:
                check(b.ref_count == 0 and b.hash is not None, f"evictable block {b.block_id} is held or uncached")
            if b.hash is not None:
                check(self._cached.get(b.hash) == b.block_id, f"cached block {b.block_id} is missing from the map")
        for h, block_id in self._cached.items():
            check(self._blocks[block_id].hash == h, f"map entry points at block {block_id} with another hash")
        if live is not None:
            counts = [0] * self.num_blocks
            for seq in live:
                for block_id in seq.block_ids:
                    counts[block_id] += 1
            for b in self._blocks:
                check(counts[b.block_id] == b.ref_count,
                      f"block {b.block_id} has ref count {b.ref_count} but {counts[b.block_id]} live holders")
