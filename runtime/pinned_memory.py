"""How much host memory the runtime page-locks, and a cap on it (option ``pinned_host_memory``).

Page-locked (pinned) host memory is what makes a host<->device copy a true asynchronous DMA,
but it cannot be swapped or reclaimed: pinning most of a host's RAM starves everything else
on it (the data loader, the page cache, other ranks). Every pin the CUDA runtime makes asks
this budget first: parameters pinned in place at their first load, the page-locked bf16
weight copies, the host buffers offloaded activations and gradients land in. Past the cap a
tensor stays in pageable memory: its copies are then synchronous on the host thread (slower,
never wrong). Without a cap nothing is refused; the counters still say what is pinned.
"""
from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass
class PinnedHostBudget:
    cap: int | None = None  # bytes; None: no cap
    pinned: int = 0  # bytes pinned now
    peak: int = 0
    refused: int = 0  # bytes left pageable because the cap was reached (cumulative)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def limit(self, cap: int | None) -> None:
        """Caps pinned bytes at ``cap`` (the smallest cap any compiled step asked for wins:
        the budget is the process's, shared by every program on the device)."""
        if cap is not None:
            with self._lock:
                self.cap = cap if self.cap is None else min(self.cap, cap)

    def try_pin(self, nbytes: int) -> bool:
        """Reserves ``nbytes`` of pinned memory if the cap allows; the caller pins only then."""
        with self._lock:
            if self.cap is not None and self.pinned + nbytes > self.cap:
                self.refused += nbytes
                return False
            self.pinned += nbytes
            self.peak = max(self.peak, self.pinned)
            return True

    def release(self, nbytes: int) -> None:
        """Pinned memory reserved with ``try_pin`` was freed (called by a finalizer, any thread)."""
        with self._lock:
            self.pinned -= nbytes
