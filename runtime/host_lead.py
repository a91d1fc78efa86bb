"""How far the thread that drives the programs may run ahead of the device (option ``host_lead_layers``).

On CUDA the host thread only enqueues: kernels and copies run later, on the streams. Left
alone it runs as far ahead as the driver lets it: on an H100 at Llama-2-7B's shape the
backward's program ran 18 layers ahead of the GPU (docs/results.md). That has three costs:
- Everything the host does for those layers is held at once: landing buffers for 18 layers'
  gradients (GiBs of RSS at 7B), and the pinned copies of their offloads.
- Once the CUDA launch queue is full, each launch blocks inside a compiled segment (a hundred
  times its launch time). A trace then cannot tell the host's own work from its waiting on
  the device.
- A value the host needs (the loss) costs a wait for everything enqueued before it.

``HostLead`` bounds that. Before the host enqueues the first compute of a layer, the device
records a mark (a CUDA event) on the compute stream. Once more than ``limit`` layers' marks
are outstanding, the host waits for the oldest: the device has then at least started the
layer ``limit`` back, and ``limit`` layers of work stay queued ahead of it. That is enough to
keep a GPU busy whose layers take milliseconds, while the host spends well under a
millisecond to launch one. The time the host spends waiting here is recorded as
"throttled", apart from the instructions' own time (``trace.TraceRecorder.host_thread_summary``).

The mark is anything with ``query()`` (done yet?) and ``synchronize()`` (block until done),
as ``torch.cuda.Event`` has; the CPU stand-in runs its work where it is issued and keeps no
marks.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable


class HostLead:
    """The marks of the layers the host has started and the device may not have: oldest first."""

    def __init__(self) -> None:
        self._marks: collections.deque = collections.deque()
        self.throttles = 0  # waits that blocked
        self.throttled_ns = 0  # time blocked in them

    def layer_started(self, mark: Any, limit: int | None,
                      on_blocked: Callable[[int, int], None] | None = None) -> None:
        """The host is about to enqueue a new layer's compute; ``mark`` was recorded on the
        device just before it. With ``limit`` layers already outstanding ahead of this one,
        waits until the device has reached the oldest of them. ``on_blocked(start_ns,
        end_ns)`` is told of each wait that blocked. ``limit`` None: never waits."""
        self._marks.append(mark)
        if limit is None:
            self._marks.clear()  # nothing will be waited for: keep no marks alive
            return
        while len(self._marks) > limit:
            oldest = self._marks.popleft()
            if oldest.query():
                continue
            start = time.perf_counter_ns()
            oldest.synchronize()
            end = time.perf_counter_ns()
            self.throttles += 1
            self.throttled_ns += end - start
            if on_blocked is not None:
                on_blocked(start, end)

    @property
    def outstanding(self) -> int:
        """Marks kept: the layers started whose marks the host has not waited for."""
        return len(self._marks)

    def forget(self) -> None:
        """Drops every mark (after a failed run: its work is abandoned or finished)."""
        self._marks.clear()
