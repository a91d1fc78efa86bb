"""megatrain's runtime spans as ``torch.profiler`` ranges (and NVTX ranges on CUDA).

While a torch profiler records (``torch.profiler.profile``, ``emit_nvtx``), every span the
runtime trace knows (each program run, each instruction: compute ops and segments, loads,
offloads, waits, evicts; the host optimizer's updates) also opens a ``record_function``
range named ``"megatrain <lane>: <name>"``, so one profiler trace shows megatrain's lanes
around the kernels and copies they launched. Where CUDA is in use, the same range is pushed
to NVTX from any thread (Nsight Systems), unless ``emit_nvtx`` already turns this thread's
record_function ranges into NVTX ranges.

Nothing is entered when no profiler records: callers check ``profiling()`` (one attribute
read) first. ``torch.profiler`` records only the thread that started it; the host optimizer's
worker thread shows with ``experimental_config=torch.profiler._ExperimentalConfig(
profile_all_threads=True)`` (``torch_compat.profile_all_threads_config()``).
"""
from __future__ import annotations

from typing import Any

import torch

from megacompile.core import torch_compat as compat

PREFIX = "megatrain "

profiling = compat.profiler_enabled

# Looked up here so a test can count the ranges entered.
_record_function = torch.profiler.record_function


def range_name(lane: str, name: str) -> str:
    return f"{PREFIX}{lane}: {name}"


class ProfilerRange:
    """One open range; ``close()`` ends it on the thread that opened it."""

    __slots__ = ("_record", "_nvtx")

    def __init__(self, lane: str, name: str) -> None:
        label = range_name(lane, name)
        self._record = _record_function(label)
        self._record.__enter__()
        # CUDA initialised means the runtime streams through a GPU: Nsight shows NVTX ranges.
        self._nvtx = torch.cuda.is_initialized() and not compat.nvtx_profiler_on_this_thread()
        if self._nvtx:
            torch.cuda.nvtx.range_push(label)

    def close(self) -> None:
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        self._record.__exit__(None, None, None)

    def __enter__(self) -> "ProfilerRange":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
