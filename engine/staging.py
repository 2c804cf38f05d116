"""Per-step host -> device uploads without host synchronisation: persistent pinned host buffers, non-blocking copies.

A `Staging` is a growable 1-D host buffer (pinned when the device is CUDA; pinning is meaningless on a CPU) and its
device twin. A step fills the host buffer through a persistent numpy view (no tensor is read back), then `upload`
copies the filled prefix with ``non_blocking=True`` and returns a view of the device buffer. On a CPU the device
buffer is the host buffer itself (nothing to copy).

Reuse rule: a host buffer must not be refilled while an earlier copy out of it may still be pending. On CUDA there
are two host buffers, used in turn: `upload` records a CUDA event after its copy, and a `host` call waits on the
event of the buffer it is about to refill (the copy before last) if that has not completed. The engine reads each
step's sampled tokens before it prepares the step after next (with asynchronous scheduling, the next step is
prepared while this one runs), so in the steady state nothing waits. The device buffer is one: copies into it and
the kernels that read it are ordered on the stream.
"""
from __future__ import annotations

import numpy as np
import torch


class Staging:
    """A host buffer and its device copy, grown on demand (to the next power of two)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int = 256) -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        n = 2 if self._pin else 1
        self._hosts: list[torch.Tensor] = [torch.empty(0, dtype=dtype)] * n
        self._nps: list[np.ndarray] = [self._hosts[0].numpy()] * n
        self._events: list[torch.cuda.Event | None] = [None] * n
        self._turn = 0
        self._dev = torch.empty(0, dtype=dtype, device=self.device) if self._pin else None
        for i in range(n):
            self._alloc(i, capacity)

    def _alloc(self, i: int, capacity: int) -> None:
        self._hosts[i] = torch.empty(capacity, dtype=self.dtype, pin_memory=self._pin)
        self._nps[i] = self._hosts[i].numpy()
        if self._pin and self._dev.shape[0] < capacity:
            self._dev = torch.empty(capacity, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self._hosts[self._turn].shape[0]

    def host(self, n: int) -> np.ndarray:
        """The numpy view of the first ``n`` host elements, to fill (after any pending copy out of them)."""
        return self._reserve(n)[1]

    def host_tensor(self, n: int) -> torch.Tensor:
        """`host` as a torch tensor (for fillers that take one, e.g. llguidance's bitmask)."""
        return self._reserve(n)[0]

    def _reserve(self, n: int) -> tuple[torch.Tensor, np.ndarray]:
        i = self._turn = (self._turn + 1) % len(self._hosts)
        event = self._events[i]
        if event is not None:
            if not event.query():  # only a step that read nothing back for two steps can get here with a copy pending
                event.synchronize()
            self._events[i] = None
        if n > self._hosts[i].shape[0]:
            self._alloc(i, 1 << (n - 1).bit_length())
        return self._hosts[i][:n], self._nps[i][:n]

    def upload(self, n: int) -> torch.Tensor:
        """The first ``n`` elements of the buffer `host` last returned, on the device (a non-blocking copy from
        pinned memory on CUDA)."""
        host = self._hosts[self._turn]
        if not self._pin:
            return host[:n]
        dev = self._dev[:n]
        dev.copy_(host[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._events[self._turn] = event
        return dev
