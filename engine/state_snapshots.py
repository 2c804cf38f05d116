"""Prefix caching for models with recurrent state (Qwen3-Next, Qwen3.5): saved states at block boundaries.

Cached KV blocks let a new request skip a shared prefix, but a recurrent layer also needs its state after that
prefix. `StateSnapshots` keeps up to ``count`` saved states in extra state slots, each registered under the prefix-cache
hash of the block that ends where it was taken (so equal keys mean equal prefixes). The scheduler ends a prompt's
prefill chunk at the prompt's last full-block boundary and asks for a save there; an admission uses the longest
prefix that both the KV cache and a snapshot cover, and asks for a restore into its slot. The model copies states
(restore before, save after computing each layer); a save becomes visible to lookups only after its step ran
(`commit`). Least recently used snapshots are replaced first.
"""
from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    """Which saved state (slot) holds the recurrent state after which cached block (hash); LRU."""

    def __init__(self, first_slot: int, count: int) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.first_slot, self.count = first_slot, count
        self._saved: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._pending: dict[bytes, int] = {}
        self._free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self.num_restores = 0  # counted by the scheduler, for admissions that used one
        self.num_saves = 0

    def longest(self, hashes: list[bytes]) -> tuple[int, int | None]:
        """``(k, slot)``: the most leading blocks of ``hashes`` whose end has a saved state, and its slot
        (``(0, None)`` when none has); marks it used."""
        for k in range(len(hashes), 0, -1):
            slot = self._saved.get(hashes[k - 1])
            if slot is not None:
                self._saved.move_to_end(hashes[k - 1])
                return k, slot
        return 0, None

    def reserve(self, key: bytes) -> int | None:
        """A slot to save the state ending at block ``key`` into this step (None when it is saved or pending
        already); replaces the least recently used snapshot when all slots are taken."""
        if key in self._saved or key in self._pending:
            return None
        if self._free:
            slot = self._free.pop()
        elif self._saved:
            slot = self._saved.popitem(last=False)[1]
        else:  # every slot is pending this step
            return None
        self._pending[key] = slot
        self.num_saves += 1
        return slot

    def commit(self) -> None:
        """The step that saved the pending states has run: they can be restored from now on."""
        self._saved.update(self._pending)
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._saved)
