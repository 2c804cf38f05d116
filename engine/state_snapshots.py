"""Prefix caching for models with recurrent state (Qwen3-Next, Qwen3.5): saved states at block boundaries.

Cached KV blocks let a new request skip a shared prefix, but a recurrent layer also needs its state after that
prefix. `StateSnapshots` keeps up to ``count`` saved states in extra state slots, each registered under the prefix-cache
hash of the block that ends where it was taken (so equal keys mean equal prefixes). The scheduler ends a prompt's
prefill chunk at the prompt's last full-block boundary and asks for a save there. Past that, a running sequence
keeps one rolling **output snapshot**: each time a step ends on a block boundary inside its output, the state there
replaces its previous one, so when it finishes, the state at the last block boundary of prompt + reply is saved (a
conversation's next turn, which repeats the reply, resumes from there). Output snapshots take free slots or each
other's, never a prompt snapshot's. An admission uses the longest prefix that both the KV cache and a snapshot
cover, and asks for a restore into its slot. The model restores before computing each layer and saves after the
step's forward; a save becomes visible to lookups only after its step ran (`commit`), and a failed step's saves
are dropped (`discard_pending`). Least recently used snapshots are replaced first.
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
        self._output: set[bytes] = set()  # keys of output snapshots (saved or pending)
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

    def reserve(self, key: bytes, output: bool = False, replaces: bytes | None = None) -> int | None:
        """A slot to save the state ending at block ``key`` into this step (None when it is saved or pending
        already, or no slot may be taken). A prompt snapshot replaces the least recently used snapshot when all
        slots are taken; an ``output`` snapshot takes the slot of ``replaces`` (its sequence's previous one) where
        that is still saved, else a free slot, else the least recently used output snapshot's."""
        if key in self._saved or key in self._pending:
            return None
        if replaces is not None and replaces in self._saved:
            slot = self._saved.pop(replaces)
            self._output.discard(replaces)
        elif self._free:
            slot = self._free.pop()
        elif output:
            victim = next((k for k in self._saved if k in self._output), None)
            if victim is None:
                return None
            slot = self._saved.pop(victim)
            self._output.discard(victim)
        elif self._saved:
            victim, slot = self._saved.popitem(last=False)
            self._output.discard(victim)
        else:  # every slot is pending this step
            return None
        self._pending[key] = slot
        if output:
            self._output.add(key)
        self.num_saves += 1
        return slot

    def commit(self) -> None:
        """The step that saved the pending states has run: they can be restored from now on."""
        self._saved.update(self._pending)
        self._pending.clear()

    def discard_pending(self) -> None:
        """The step that was to save the pending states failed: their slots hold nothing and become free."""
        for key, slot in self._pending.items():
            self._output.discard(key)
            self._free.append(slot)
        self.num_saves -= len(self._pending)
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._saved)
