"""Per-step host -> device uploads without host synchronisation: persistent pinned host buffers, non-blocking copies.

A `Staging` is a growable 1-D host buffer (pinned when the device is CUDA; pinning is meaningless on a CPU) and its
device twin. A step fills the host buffer through a persistent numpy view (no tensor is read back), then `upload`
copies the filled prefix with ``non_blocking=True`` and returns a view of the device buffer. On a CPU the device
buffer is the host buffer itself (nothing to copy).

Reuse rule: the host buffer must not be refilled while an earlier copy out of it may still be pending. `upload`
records a CUDA event after its copy and the next `host` call waits on it if it has not completed; in the steady
state the engine has already read the step's sampled tokens (which waits for the whole step), so nothing waits.
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
        self._event: torch.cuda.Event | None = None
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self._host = torch.empty(capacity, dtype=self.dtype, pin_memory=self._pin)
        self._np = self._host.numpy()
        self._dev = torch.empty(capacity, dtype=self.dtype, device=self.device) if self._pin else self._host

    @property
    def capacity(self) -> int:
        return self._host.shape[0]

    def host(self, n: int) -> np.ndarray:
        """The numpy view of the first ``n`` host elements, to fill (after any pending copy out of them)."""
        return self._reserve(n)[1]

    def host_tensor(self, n: int) -> torch.Tensor:
        """`host` as a torch tensor (for fillers that take one, e.g. llguidance's bitmask)."""
        return self._reserve(n)[0]

    def _reserve(self, n: int) -> tuple[torch.Tensor, np.ndarray]:
        if self._event is not None:
            if not self._event.query():  # only a step that read nothing back can get here with a copy in flight
                self._event.synchronize()
            self._event = None
        if n > self.capacity:
            self._alloc(1 << (n - 1).bit_length())
        return self._host[:n], self._np[:n]

    def upload(self, n: int) -> torch.Tensor:
        """The first ``n`` elements on the device (a non-blocking copy from pinned memory on CUDA)."""
        if not self._pin:
            return self._dev[:n]
        dev = self._dev[:n]
        dev.copy_(self._host[:n], non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(self.device))
        return dev
