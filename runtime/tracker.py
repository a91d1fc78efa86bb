"""Measures the peak device-resident bytes of a step.

On CUDA the caching allocator knows (``max_memory_allocated``). The CPU stand-in has no
separate allocator, so ``ArenaTracker`` accounts every device-side tensor the executor
produces: it registers the tensor's storage and gets a finalizer callback when the storage
is really freed (wherever the last reference was, the executor, an autograd context or the
user), so the peak is measured from actual lifetimes, not from the plan.
"""
from __future__ import annotations

import threading
import weakref

import torch


class ArenaTracker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # storage data_ptr -> bytes
        self.current = 0
        self.peak = 0

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = storage.data_ptr()
        if nbytes == 0:
            return
        with self._lock:
            if key in self._live:
                return
            self._live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        # Storage Python objects are preserved for the StorageImpl's whole life, so this
        # fires exactly when the memory is released.
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            nbytes = self._live.pop(key, 0)
            self.current -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current

    def peak_since_reset(self) -> int:
        return self.peak

    def reserved_peak(self) -> None:
        return None  # host memory the stand-in frees at once: no allocator cache to report


class CudaTracker:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._baseline = 0

    def track(self, t: torch.Tensor) -> None:  # the allocator sees everything already
        return None

    @property
    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self._baseline

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        self._baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_since_reset(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self._baseline

    def reserved_peak(self) -> int:
        """The most the caching allocator reserved since the reset (whole device, not less a
        baseline: it is what the GPU shows)."""
        return torch.cuda.max_memory_reserved(self.device)
