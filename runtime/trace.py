"""A Chrome trace of the runtime's lanes: ``megacompile.trace_runtime(path)``.

    with megacompile.trace_runtime("step.json"):
        step(x, y)
    # open step.json in chrome://tracing or https://ui.perfetto.dev

While a trace is active, every ``StreamingProgram`` instruction (op, compiled segment,
load, offload, wait), each graph run as a whole, and the host optimizer graph are recorded
with their start and duration; on exit the events are written as Chrome trace JSON
(``traceEvents``, complete events ``"ph": "X"``, timestamps in microseconds). One process,
one track (``tid``) per lane:

- ``compute``: ops and Inductor segments (on CUDA: the CPU time to launch them; the kernels
  run asynchronously on the compute stream);
- ``h2d`` / ``d2h``: parameter and activation loads, gradient and activation offloads. On the
  CPU stand-in the copy happens where it is issued. On CUDA these lanes hold the copies'
  real times from CUDA events on the copy streams, and ``h2d enqueue`` / ``d2h enqueue`` the
  CPU time to issue them;
- ``wait``: the compute side waiting for a copy;
- ``host blocked``: the program's thread blocked on the device (a wait for a copy it reads;
  the bound on how far it runs ahead, option ``host_lead_layers``);
- ``host optimizer``: the optimizer graph run on the host;
- ``graphs``: one event per forward / backward program run, enclosing its instructions.

``span(lane, name, **args)`` records any other piece of work, from any thread (a second
thread's work gets its own track, ``"host optimizer [worker-1]"``). While a
``torch.profiler`` records, the same spans are its ``record_function`` ranges
(``runtime/profiler_ranges.py``); this trace is for machines without CUPTI or a profiler.
With neither active, ``span`` and the executor's checks cost a global and an attribute read.
``evict`` (a device copy's release point) and ``host`` (other host graphs) are lanes too.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from typing import Any, Iterator

import torch

from megacompile.runtime import profiler_ranges

# The active recorder, or None. Read without a lock: a reference read is atomic, and a
# recorder that ends while a span is open still accepts the event (it is simply not written).
_ACTIVE: "TraceRecorder | _Fanout | None" = None
_ACTIVE_LOCK = threading.Lock()

_STREAM_THREAD = -1  # the "thread" of events timed on CUDA streams

LANE_ORDER = ("graphs", "compute", "h2d enqueue", "h2d", "d2h enqueue", "d2h", "wait", "evict", "host blocked",
              "host optimizer", "host")


class TraceRecorder:
    """Collects complete events; thread-safe."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._events: list[dict] = []
        self._tracks: dict[tuple[str, int], int] = {}  # (lane, thread ident) -> tid
        self._track_names: dict[int, str] = {}
        self._cuda_copies: list[tuple] = []  # (lane, name, args, start event, end event)
        self._cuda_origin: tuple | None = None  # (reference CUDA event, its CPU time in ns)
        self.t0_ns = time.perf_counter_ns()
        # The thread that runs the programs: its instructions by kind, and its time in them.
        self._instructions: collections.Counter = collections.Counter()
        self._instruction_ns = 0
        self._instruction_ns_by_kind: collections.Counter = collections.Counter()
        self._program_ns = 0
        # Of that thread's time, what it spent blocked on the device: inside instructions
        # (a wait for a copy to the host it is about to read) and between them (the bound on
        # how far it may run ahead, runtime/host_lead.py).
        self._blocked_ns = 0
        self._throttled_ns = 0

    # --- recording --------------------------------------------------------------------------
    def _tid(self, lane: str, thread: int) -> int:
        key = (lane, thread)
        tid = self._tracks.get(key)
        if tid is None:
            # The main thread (and the CUDA copy streams) get the lane's own track; any other
            # thread its own, so that events on one track never overlap.
            main = thread in (threading.main_thread().ident, _STREAM_THREAD)
            name = lane if main else f"{lane} [{threading.current_thread().name}]"
            order = LANE_ORDER.index(lane) if lane in LANE_ORDER else len(LANE_ORDER)
            tid = 1 + order * 1000 + sum(1 for k in self._tracks if k[0] == lane)
            self._tracks[key] = tid
            self._track_names[tid] = name
        return tid

    def add(self, lane: str, name: str, start_ns: int, end_ns: int, args: dict | None = None) -> None:
        thread = threading.get_ident()
        with self._lock:
            tid = self._tid(lane, thread)
            self._events.append({
                "name": name, "ph": "X", "pid": 1, "tid": tid,
                "ts": (start_ns - self.t0_ns) / 1e3, "dur": max(end_ns - start_ns, 0) / 1e3,
                "args": args or {},
            })

    def add_instruction(self, lane: str, name: str, start_ns: int, end_ns: int, args: dict) -> None:
        """A program instruction the executor ran (``args["kind"]``: op, segment, load, ...)."""
        with self._lock:
            self._instructions[args["kind"]] += 1
            self._instruction_ns += max(end_ns - start_ns, 0)
            self._instruction_ns_by_kind[args["kind"]] += max(end_ns - start_ns, 0)
        self.add(lane, name, start_ns, end_ns, args)

    def add_blocked(self, start_ns: int, end_ns: int) -> None:
        """Inside an instruction, the program's thread blocked until the device had done
        something (a copy to the host landed): waiting, not the host's own work."""
        with self._lock:
            self._blocked_ns += max(end_ns - start_ns, 0)
        self.add("host blocked", "blocked on the device", start_ns, end_ns)

    def add_throttle(self, start_ns: int, end_ns: int) -> None:
        """Between instructions, the program's thread waited for the device to catch up
        (option host_lead_layers)."""
        with self._lock:
            self._throttled_ns += max(end_ns - start_ns, 0)
        self.add("host blocked", "host lead: waiting for the device", start_ns, end_ns)

    def add_program(self, name: str, start_ns: int, end_ns: int, args: dict | None = None) -> None:
        """One run of a forward or backward program, enclosing its instructions."""
        with self._lock:
            self._program_ns += max(end_ns - start_ns, 0)
        self.add("graphs", name, start_ns, end_ns, args)

    def host_thread_summary(self) -> dict[str, Any]:
        """The thread that drives the programs, over the traced block: ``program_s`` (time
        inside forward / backward programs), ``busy_s`` (inside their instructions: launching
        ops and segments, issuing copies, host ops, waits; on CUDA the kernels and copies run
        asynchronously, so the rest of ``program_s`` is the thread waiting on the device or
        on the host optimizer), ``busy_fraction``, ``instructions`` run, by kind (``op``:
        one aten op through Python dispatch; ``segment``: a compiled segment), and
        ``busy_s_by_kind``: the thread's time in each kind (where the busy time goes: a kind
        whose share is far above its count's is blocking, not launching).
        Of the busy time, ``blocked_s`` is spent blocked on the device inside instructions (a
        wait for a copy the host reads) and ``working_s`` is the rest, the thread's own work
        (``working_fraction`` of ``program_s``); ``throttled_s`` is time between instructions
        waiting for the device to catch up (option ``host_lead_layers``). A launch that
        blocks on a full CUDA launch queue still counts as work: bound the lead to avoid it."""
        with self._lock:
            program = self._program_ns / 1e9
            busy = self._instruction_ns / 1e9
            blocked = min(self._blocked_ns / 1e9, busy)
            working = busy - blocked
            return {"program_s": program, "busy_s": busy, "busy_fraction": busy / program if program else 0.0,
                    "blocked_s": blocked, "working_s": working,
                    "working_fraction": working / program if program else 0.0,
                    "throttled_s": self._throttled_ns / 1e9,
                    "instructions": dict(self._instructions),
                    "busy_s_by_kind": {k: ns / 1e9 for k, ns in self._instruction_ns_by_kind.items()}}

    def add_cuda_copy(self, lane: str, name: str, args: dict, start_event, end_event) -> None:
        """A copy on a CUDA stream between two timing events, resolved when the trace is written."""
        with self._lock:
            if self._cuda_origin is None:
                origin = torch.cuda.Event(enable_timing=True)
                origin.record()
                origin.synchronize()
                self._cuda_origin = (origin, time.perf_counter_ns())
            self._cuda_copies.append((lane, name, args, start_event, end_event))

    # --- writing ----------------------------------------------------------------------------
    def _resolve_cuda_copies(self) -> None:
        if not self._cuda_copies:
            return

        torch.cuda.synchronize()
        origin, origin_ns = self._cuda_origin
        for lane, name, args, start, end in self._cuda_copies:
            # elapsed_time is in milliseconds between two recorded events.
            start_ns = origin_ns + int(origin.elapsed_time(start) * 1e6)
            end_ns = origin_ns + int(origin.elapsed_time(end) * 1e6)
            self._events.append({
                "name": name, "ph": "X", "pid": 1, "tid": self._tid(lane, _STREAM_THREAD),
                "ts": (start_ns - self.t0_ns) / 1e3, "dur": max(end_ns - start_ns, 0) / 1e3, "args": args,
            })
        self._cuda_copies.clear()

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            self._resolve_cuda_copies()
            meta = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "megatrain runtime"}}]
            for tid, name in sorted(self._track_names.items()):
                meta.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
                meta.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                             "args": {"sort_index": tid}})
            events = sorted(self._events, key=lambda e: (e["tid"], e["ts"]))
            return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def write(self) -> None:
        data = self.to_json()
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(data, f)


class _Fanout:
    """Traces open inside one another (a script's own ``trace_runtime`` inside the one
    ``megacompile inspect --plot`` records): every event goes to each of them."""

    def __init__(self, recorders: tuple[TraceRecorder, ...]) -> None:
        self.recorders = recorders

    def add(self, *args: Any) -> None:
        for r in self.recorders:
            r.add(*args)

    def add_instruction(self, *args: Any) -> None:
        for r in self.recorders:
            r.add_instruction(*args)

    def add_program(self, *args: Any) -> None:
        for r in self.recorders:
            r.add_program(*args)

    def add_blocked(self, *args: Any) -> None:
        for r in self.recorders:
            r.add_blocked(*args)

    def add_throttle(self, *args: Any) -> None:
        for r in self.recorders:
            r.add_throttle(*args)

    def add_cuda_copy(self, *args: Any) -> None:
        for r in self.recorders:
            r.add_cuda_copy(*args)


_OPEN: list[TraceRecorder] = []  # the traces open now, outermost first


def active() -> "TraceRecorder | _Fanout | None":
    """What records events now, or None (the executor reads this once per run)."""
    return _ACTIVE


@contextlib.contextmanager
def trace_runtime(path: str | os.PathLike) -> Iterator[TraceRecorder]:
    """Record the runtime's lanes while the block runs; write Chrome trace JSON to ``path`` on exit.

    Traces nest: inside another trace's block, both record what runs (each file has its own
    events, timed from its own start).
    """
    global _ACTIVE
    recorder = TraceRecorder(path)
    with _ACTIVE_LOCK:
        _OPEN.append(recorder)
        _ACTIVE = recorder if len(_OPEN) == 1 else _Fanout(tuple(_OPEN))
    try:
        yield recorder
    finally:
        with _ACTIVE_LOCK:
            _OPEN.remove(recorder)
            _ACTIVE = None if not _OPEN else _OPEN[0] if len(_OPEN) == 1 else _Fanout(tuple(_OPEN))
        recorder.write()


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL_SPAN = _NullSpan()


class _Span:
    __slots__ = ("recorder", "lane", "name", "args", "start", "range")

    def __init__(self, recorder: TraceRecorder | None, lane: str, name: str, args: dict) -> None:
        self.recorder, self.lane, self.name, self.args = recorder, lane, name, args

    def __enter__(self) -> None:
        self.start = time.perf_counter_ns()
        self.range = profiler_ranges.ProfilerRange(self.lane, self.name) if profiler_ranges.profiling() else None

    def __exit__(self, *exc: Any) -> None:
        if self.range is not None:
            self.range.close()
        if self.recorder is not None:
            self.recorder.add(self.lane, self.name, self.start, time.perf_counter_ns(), self.args)


def span(lane: str, name: str, **args: Any):
    """A context manager recording ``name`` on ``lane`` while a trace is active (any thread),
    and opening a ``torch.profiler`` range while a profiler records (``profiler_ranges``).

    ``args`` appear in the event's details (layer, bytes, ...). With neither active it
    returns a shared no-op context manager.
    """
    recorder = _ACTIVE
    if recorder is None and not profiler_ranges.profiling():
        return _NULL_SPAN
    return _Span(recorder, lane, name, args)
