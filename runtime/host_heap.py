"""Gives the C heap's freed pages back to the OS after each step, off the step's thread.

A step allocates and frees host tensors (batches, gradients on their way to the optimizer,
the stand-in's device values, Python objects). glibc's allocator keeps freed pages of its heap
for reuse instead of returning them, and its mmap threshold grows with the sizes it has freed,
so more of the next step's tensors come from the heap too: what the process holds (RSS) ends
up well above what it uses. On the CPU stand-in a bf16 Llama's RSS settled 1.4 to 2.2 bytes
per parameter above the training state (benchmarks/host_memory.py); at 7B that is 10 to 15
GiB of a host that the state nearly fills.

``release_soon()`` asks glibc to return the free pages (``malloc_trim(0)``) on a thread of its
own, once per step (the backward's end), so the step does not wait for it; a request made
while the last one still runs is dropped. ``stats()`` says how many trims ran, the bytes the
last one returned (the fall of RSS across it) and its seconds. Where the C library has no
``malloc_trim`` (musl, macOS) nothing runs and ``available()`` is False.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import threading
import time


@dataclasses.dataclass
class HeapStats:
    trims: int = 0
    last_released_bytes: int = 0  # RSS before the last trim minus RSS after it (0 if it rose)
    last_seconds: float = 0.0


def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_lock = threading.Lock()
_busy = False
_stats = HeapStats()


def available() -> bool:
    return _TRIM is not None


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def release_now() -> int:
    """Trims the heap on this thread; the bytes RSS fell by."""
    if _TRIM is None:
        return 0
    before, start = rss_bytes(), time.perf_counter()
    _TRIM(0)
    released = max(0, before - rss_bytes())
    with _lock:
        _stats.trims += 1
        _stats.last_released_bytes = released
        _stats.last_seconds = time.perf_counter() - start
    return released


def _run() -> None:
    global _busy
    try:
        release_now()
    finally:
        with _lock:
            _busy = False


def release_soon() -> bool:
    """Starts a trim on a background thread unless one is running; True if it started one."""
    global _busy
    if _TRIM is None:
        return False
    with _lock:
        if _busy:
            return False
        _busy = True
    threading.Thread(target=_run, name="megatrain-heap-trim", daemon=True).start()
    return True


def wait(timeout: float = 30.0) -> None:
    """Until no trim runs (tests, and a report that wants the last one's numbers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with _lock:
            if not _busy:
                return
        time.sleep(0.001)


def stats() -> HeapStats:
    with _lock:
        return dataclasses.replace(_stats)
