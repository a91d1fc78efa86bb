"""Python's cycle collector, paused while megatrain compiles.

A compile creates hundreds of thousands of objects that live on (fx nodes and their meta,
fake tensors, the programs' instructions). Each collection their allocations trigger walks
them all again, and a full collection lands somewhere in the compile at random (what it
cost: benchmarks/compile_time.py --breakdown, 'collector on' row). The backend
pauses the collector while AOTAutograd traces and megatrain partitions (``backend.megatrain``)
and while a rewritten graph becomes a program (``capture.TrainingCompiler``'s compile
callbacks). Cycles made meanwhile are collected as usual once it runs again; peak memory was
the same. A collector the caller had switched off stays off.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def cycle_collector_paused():
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
