"""The device abstraction the executor streams through.

Two implementations of one interface:

- ``CudaDevice``: a copy stream each way beside the compute stream, CUDA events to order
  them, pinned host memory so copies are truly asynchronous, and the caching allocator as
  the slot pool (``record_stream`` keeps a slot from being reused while a copy or kernel
  still reads it). Double buffering falls out of the schedule: the passes issue layer k+1's
  loads before layer k computes.
- ``CpuStandInDevice``: runs the same schedule on a machine without a GPU. "Device" tensors
  are separate copies in host RAM, accounted by an ``ArenaTracker``, so every load, evict and
  offload really happens and the device-side peak is measured. Where a program does not
  measure its peak (the Inductor lowering) and nothing updates a parameter while the program
  runs (no overlapped optimizer), the copies would only burn time: the "device" is host
  memory, so the executor shares the host tensor instead (``share`` / ``hand_over``).

Both count the bytes moved each way, per layer.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time
import weakref
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from megacompile.core import torch_compat as compat
from megacompile.core.host_memory import check_host_allocation
from megacompile.runtime import trace
from megacompile.runtime.host_arena import LandingBuffers
from megacompile.runtime.host_lead import HostLead
from megacompile.runtime.pinned_memory import PinnedHostBudget
from megacompile.runtime.tracker import ArenaTracker, CudaTracker
from megacompile.runtime.weight_copies import WeightCopies


@dataclasses.dataclass
class TransferStats:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_by_layer: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(int))
    d2h_by_layer: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(int))

    def add(self, direction: str, layer: str | None, nbytes: int) -> None:
        key = layer or "(glue)"
        if direction == "h2d":
            self.h2d_bytes += nbytes
            self.h2d_by_layer[key] += nbytes
        else:
            self.d2h_bytes += nbytes
            self.d2h_by_layer[key] += nbytes


class StreamingDevice:
    kind = "abstract"
    # Whether the device's memory is the host's own (the CPU stand-in): then a load can share
    # the host tensor instead of copying it, where nothing depends on the copy being separate.
    shares_host_memory = False
    # Runtime-trace lanes of the memory ops' issuing side (see runtime/trace.py).
    trace_copy_lanes = {"load": "h2d", "offload": "d2h"}

    # Page-lock the persistent bf16 weight copies (CUDA: their loads are then true DMAs).
    page_locks_weight_copies = False

    def __init__(self) -> None:
        self.stats = TransferStats()
        # Transient host copies the program makes (bf16 gradients before their fp32 cast):
        # live and peak bytes.
        self.host_staging = ArenaTracker()
        # Host memory this device page-locks, and the cap on it (option pinned_host_memory).
        self.pinned = PinnedHostBudget()
        # The bf16 copies of host weights that loads carry (runtime/weight_copies.py).
        self.weight_copies = WeightCopies(page_lock=self.page_locks_weight_copies, pinned=self.pinned)
        # Bytes of the host buffers offloaded activations and returned gradients land in
        # (runtime/host_arena.py), live now.
        self.host_buffer_bytes = 0
        # Returned gradients land in exact-size buffers reused every step where the device
        # would otherwise take a page-locked block per copy (CUDA: torch's pinned caching
        # allocator rounds each up to a power of two and never frees it). On the stand-in the
        # C heap reuses freed gradients' memory as well, and measured less RSS without it
        # (benchmarks/host_memory.py: 15.6 against 16.9 B/param).
        self.landing = LandingBuffers(self.host_buffer) if self.page_locks_weight_copies else None

    def reset_stats(self) -> None:
        self.stats = TransferStats()

    # The executor calls these for the memory ops. ``track=False``: the caller does not
    # measure this program's peak (the stand-in's inductor lowering), so skip the accounting.
    def load(self, host: torch.Tensor, name: str, layer: str | None, track: bool = True) -> torch.Tensor:
        raise NotImplementedError

    def offload(self, device_tensor: torch.Tensor, name: str, layer: str | None,
                into: torch.Tensor | None = None, after: Callable[[], None] | None = None) -> torch.Tensor:
        """Copies ``device_tensor`` to the host: into ``into`` (a view of an offload arena,
        same shape and strides) where given, else into a host tensor of its own. ``after``:
        device work the copy follows (a gradient's all-reduce), called in the copy's stream
        context before it is issued."""
        raise NotImplementedError

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of exactly ``nbytes`` (uint8) kept across steps: an offload arena."""
        check_host_allocation(nbytes, "the host buffer offloaded activations land in (one per forward "
                                      "whose backward has not run yet)",
                              "Set option host_activation_budget below what is available (0 keeps every "
                              "activation on the device): the planner then takes the fastest plan within "
                              "memory_budget that puts no more on the host. Or free host memory")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.host_buffer_bytes += nbytes
        weakref.finalize(buffer, self._host_buffer_freed, nbytes)
        return buffer

    def _host_buffer_freed(self, nbytes: int) -> None:
        self.host_buffer_bytes -= nbytes

    def before_host_buffer_reuse(self) -> None:
        """Called before a host buffer is written again: reads of it still in flight end first."""

    def share(self, host: torch.Tensor, name: str, layer: str | None) -> torch.Tensor:
        """A load without a copy (only where ``shares_host_memory``): a tensor over the host
        tensor's own memory, its bytes still counted as the schedule's host-to-device traffic."""
        raise NotImplementedError(f"the {self.kind} device cannot share host memory")

    def hand_over(self, device_tensor: torch.Tensor, name: str, layer: str | None,
                  after: Callable[[], None] | None = None) -> torch.Tensor:
        """An offload without a copy (only where ``shares_host_memory``), counted like ``share``."""
        raise NotImplementedError(f"the {self.kind} device cannot share host memory")

    def wait(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def evict(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def completion(self, host: torch.Tensor):
        """For an offloaded tensor: a callable that blocks until its copy has landed (any
        thread may call it), or None when it already has. Takes over the tensor's ``wait``."""
        return None

    def track(self, value) -> None:
        """Account device-side tensors the compute produced (no-op where the allocator knows)."""

    def synchronize(self) -> None:
        pass

    def layer_started(self, limit: int | None) -> None:
        """The program is about to enqueue a new layer's compute: where work runs after it is
        issued, wait while more than ``limit`` layers are outstanding (runtime/host_lead.py)."""

    def after_failure(self) -> None:
        """Called while a failed program's values are still referenced, before they are freed."""

    def loads_done(self, tensors=None) -> None:
        """Returns once every load issued so far that read the host memory of ``tensors``
        (None: every load) has read it: the host optimizer calls it before it rewrites
        weights (or their copies) in place."""


class CpuStandInDevice(StreamingDevice):
    kind = "cpu"
    shares_host_memory = True

    def __init__(self) -> None:
        super().__init__()
        self.tracker = ArenaTracker()
        self.torch_device = torch.device("cpu")

    def load(self, host, name, layer, track=True):
        dev = host.clone(memory_format=torch.preserve_format)
        if track:
            self.tracker.track(dev)
        self.stats.add("h2d", layer, host.numel() * host.element_size())
        return dev

    def offload(self, device_tensor, name, layer, into=None, after=None):
        if after is not None:
            after()  # synchronous here, like the copy
        host = device_tensor.clone(memory_format=torch.preserve_format) if into is None else into.copy_(device_tensor)
        self.stats.add("d2h", layer, device_tensor.numel() * device_tensor.element_size())
        return host

    def share(self, host, name, layer):
        self.stats.add("h2d", layer, host.numel() * host.element_size())
        # A new tensor object over the same memory (and version counter): the program may
        # drop or wrap it without touching the caller's tensor.
        return host.detach()

    def hand_over(self, device_tensor, name, layer, after=None):
        if after is not None:
            after()
        self.stats.add("d2h", layer, device_tensor.numel() * device_tensor.element_size())
        return device_tensor

    def wait(self, t):
        return None  # copies on the stand-in are synchronous

    def evict(self, t):
        return None  # the executor drops its reference; the tracker sees the free

    def track(self, value):
        if isinstance(value, torch.Tensor):
            self.tracker.track(value)
        elif isinstance(value, (tuple, list)):
            for v in value:
                self.track(v)


class CudaDevice(StreamingDevice):
    kind = "cuda"
    page_locks_weight_copies = True
    # Issuing a copy only enqueues it; the copy's own time comes from CUDA events.
    trace_copy_lanes = {"load": "h2d enqueue", "offload": "d2h enqueue"}

    def __init__(self, index: int | None = None) -> None:
        super().__init__()
        self.torch_device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.tracker = CudaTracker(self.torch_device)
        from megacompile.runtime import fused_head_triton  # lazy: imports Triton (optional), for CUDA only

        fused_head_triton.register_for_cuda()
        self.h2d_stream = torch.cuda.Stream(self.torch_device)
        self.d2h_stream = torch.cuda.Stream(self.torch_device)
        # Copy-completion events by tensor, weakly held so a dropped tensor drops its event.
        self._events = WeakIdKeyDictionary()
        # Shared-memory buffers page-locked in place (by address; they live as long as the job).
        self._registered_shared: set[int] = set()
        # Host storage address -> the event of the last load that read it (loads_done).
        self._last_read: dict[int, torch.cuda.Event] = {}
        # The layers the host has enqueued ahead of the compute stream (option host_lead_layers).
        self.lead = HostLead()

    def _pinned_source(self, host: torch.Tensor) -> torch.Tensor:
        if host.is_pinned() or host.device.type != "cpu":
            return host  # already pinned, or a user input that already lives on a GPU
        storage = host.untyped_storage()
        if storage.is_shared():
            # Memory other processes map (a data-parallel host's one copy of the weights,
            # runtime/shared_parameters.py): page-locked in place, the whole buffer once, never
            # moved into private pinned memory (that would take it out of the shared buffer).
            if storage.data_ptr() not in self._registered_shared and self.pinned.try_pin(storage.nbytes()):
                compat.register_host_storage(storage)
                self._registered_shared.add(storage.data_ptr())
            return host
        nbytes = host.numel() * host.element_size()
        if not self.pinned.try_pin(nbytes):
            return host  # over the pinned-memory cap: a synchronous copy from pageable memory
        if isinstance(host, torch.nn.Parameter) or host.is_leaf:
            # Host-resident parameters live in pinned memory from their first load on, so
            # every later copy is a true asynchronous DMA (values are unchanged).
            try:
                host.data = host.data.pin_memory()
                weakref.finalize(host, self.pinned.release, nbytes)
                return host
            except RuntimeError:
                pass
        staged = host.pin_memory()
        weakref.finalize(staged, self.pinned.release, nbytes)
        return staged

    def load(self, host, name, layer, track=True):
        src = self._pinned_source(host)
        recorder = trace.active()
        compute = torch.cuda.current_stream(self.torch_device)
        # Allocated on the compute stream, like everything else the step allocates: the caching
        # allocator keeps one pool per stream, and a second pool for loads would reserve its own
        # peak beside the compute pool's (reserved 1.28x the budget on the H100, 2026-11-24).
        dev = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.torch_device)
        # The block may come from a tensor that compute work still queued reads: the copy
        # starts after that work. Loads are issued at most prefetch_depth layers ahead of
        # their use, so this is the overlap the plan counts on.
        self.h2d_stream.wait_stream(compute)
        with torch.cuda.stream(self.h2d_stream):
            copy_start = _timing_event(self.h2d_stream) if recorder is not None else None
            dev.copy_(src, non_blocking=True)
            event = _host_waited_event(recorder is not None)
            event.record(self.h2d_stream)
        self._events[dev] = event
        if src is host:  # the copy reads the host tensor's own memory (not a staged copy of it)
            self._last_read[host.untyped_storage().data_ptr()] = event
        nbytes = host.numel() * host.element_size()
        self.stats.add("h2d", layer, nbytes)
        if recorder is not None:
            recorder.add_cuda_copy("h2d", name, {"layer": layer, "bytes": nbytes}, copy_start, event)
        return dev

    def host_buffer(self, nbytes):
        buffer = super().host_buffer(nbytes)
        if self.pinned.try_pin(nbytes):  # else pageable: its copies are synchronous, never wrong
            compat.register_host_memory(buffer)
            weakref.finalize(buffer, compat.unregister_host_memory, buffer.data_ptr())
            weakref.finalize(buffer, self.pinned.release, nbytes)
        return buffer

    def before_host_buffer_reuse(self):
        # The backward's loads read the buffer on the h2d stream, possibly still after the
        # last reference to its values was dropped: the next offloads into it come after them.
        self.d2h_stream.wait_stream(self.h2d_stream)

    def offload(self, device_tensor, name, layer, into=None, after=None):
        if device_tensor.device.type == "cpu":
            if after is not None:
                after()
            return device_tensor
        nbytes = device_tensor.numel() * device_tensor.element_size()
        if into is not None:
            host = into
        else:
            pin = self.pinned.try_pin(nbytes)
            host = torch.empty_strided(device_tensor.shape, device_tensor.stride(), dtype=device_tensor.dtype,
                                       device="cpu", pin_memory=pin)
            if pin:
                weakref.finalize(host, self.pinned.release, nbytes)
        compute = torch.cuda.current_stream(self.torch_device)
        self.d2h_stream.wait_stream(compute)
        if into is not None:
            # Host memory a load may still be reading (a weight's bf16 copy a gradient lands
            # in, its layer's load possibly issued after the compute that made the gradient).
            last_read = self._last_read.get(into.untyped_storage().data_ptr())
            if last_read is not None:
                self.d2h_stream.wait_event(last_read)
        recorder = trace.active()
        with torch.cuda.stream(self.d2h_stream):
            if after is not None:
                # A collective's wait here makes the copy stream wait for it (NCCL: an event on
                # its own stream); compute goes on with the layers before.
                after()
            # Recorded after the waits: the event marks when the copy can start.
            copy_start = _timing_event(self.d2h_stream) if recorder is not None else None
            host.copy_(device_tensor, non_blocking=True)
            event = _host_waited_event(recorder is not None)
            event.record(self.d2h_stream)
        # The device copy must not be reused before the DMA has read it.
        device_tensor.record_stream(self.d2h_stream)
        self._events[host] = event
        self.stats.add("d2h", layer, nbytes)
        if recorder is not None:
            recorder.add_cuda_copy("d2h", name, {"layer": layer, "bytes": nbytes}, copy_start, event)
        return host

    def wait(self, t):
        event = self._events.pop(t, None)
        if event is None:
            return
        if t.is_cuda:
            # Allocated on the compute stream (``load``): once compute waits for the copy, every
            # later use and the free are ordered after it.
            torch.cuda.current_stream(self.torch_device).wait_event(event)
        else:
            # A host tensor: the CPU is about to read it, so it waits for the device here.
            if event.query():
                return
            recorder = trace.active()
            if recorder is None:
                event.synchronize()
            else:
                start = time.perf_counter_ns()
                event.synchronize()
                recorder.add_blocked(start, time.perf_counter_ns())

    def evict(self, t):
        # A load never waited for (no graph does that; a guard): its block goes back to the
        # compute stream's pool, so compute must not reuse it before the copy has landed.
        if isinstance(t, torch.Tensor) and t.is_cuda and t in self._events:
            self.wait(t)
        return None  # the allocator returns the slot once the last reference is dropped

    def after_failure(self):
        # A failed program drops loads it never waited for: their copies finish first.
        self.h2d_stream.synchronize()
        self.lead.forget()

    def layer_started(self, limit):
        if limit is None:
            return
        mark = _host_waited_event(False)
        mark.record(torch.cuda.current_stream(self.torch_device))
        recorder = trace.active()
        self.lead.layer_started(mark, limit, on_blocked=recorder.add_throttle if recorder is not None else None)

    def completion(self, host):
        event = self._events.pop(host, None)  # popped here, on the thread that recorded it
        return None if event is None else functools.partial(_wait_for, event)

    def synchronize(self):
        torch.cuda.synchronize(self.torch_device)

    def loads_done(self, tensors=None):
        if tensors is None:
            self.h2d_stream.synchronize()
            return
        # Only the loads that read these tensors: the h2d stream also holds loads issued for
        # layers ahead, which wait for compute to get there (``load``).
        for t in tensors:
            event = self._last_read.get(t.untyped_storage().data_ptr())
            if event is not None:
                _wait_for(event)


def _wait_for(event: "torch.cuda.Event") -> None:
    """Blocks until ``event`` has happened. ``query()`` first: it keeps the GIL, where
    ``synchronize()`` gives it up and must take it back, which costs a thread up to the
    interpreter's switch interval while another thread runs Python
    (``benchmarks/gil_handback.py``). The host optimizer's worker checks a layer's copies, long
    landed where it is the bottleneck, dozens of times a layer while the driving thread issues
    the next layers."""
    if not event.query():
        event.synchronize()


def _host_waited_event(timing: bool) -> "torch.cuda.Event":
    """An event a host thread may wait for. Blocking: the waiting thread sleeps instead of
    spinning on a core (CUDA spins by default with fewer contexts than cores), and the host
    AdamW's threads, which update layers while the driving thread and the optimizer's own
    thread wait for copies, get every core. A wait here is a layer's copy or compute (ms), so
    the wake-up's tens of microseconds do not show."""
    return torch.cuda.Event(enable_timing=timing, blocking=True)


def _timing_event(stream) -> "torch.cuda.Event":
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


_DEVICES: dict[str, StreamingDevice] = {}


def get_device(kind: str) -> StreamingDevice:
    """One device object per kind for the process (streams and trackers are shared)."""
    if kind not in _DEVICES:
        _DEVICES[kind] = CudaDevice() if kind == "cuda" else CpuStandInDevice()
    return _DEVICES[kind]


def existing_device(kind: str) -> StreamingDevice | None:
    """The process's device of this kind if a program has used it, else None (creates nothing)."""
    return _DEVICES.get(kind)


def forget_weight_copies() -> None:
    """Drops every persistent bf16 weight copy (the next load of each weight makes it again).
    For weights written in a way their version counter does not see, e.g. ``p.data.mul_()``."""
    for device in _DEVICES.values():
        device.weight_copies.forget()
