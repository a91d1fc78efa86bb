"""Exact-size host buffers for a forward's offloaded activations, reused step after step.

Each offload used to allocate its own host tensor every step: on CUDA from torch's pinned
caching allocator, which rounds every block up to a power of two and keeps it for the life
of the process. A forward offloads the same values at every call, so one buffer laid out for
them does: an ``OffloadArena`` is one host allocation of exactly the bytes a call offloads
(each value at an offset rounded up to ``ALIGN``), page-locked in place on CUDA, and a call's
values are views of it at consecutive offsets.

A call leases an arena from its program's ``ArenaPool``. The arena is free again once nothing
but the pool holds its memory (the backward that read the values has dropped them): the pool
reads the storage's reference count, which every view and alias of it holds. A forward that
runs again before its backward (several micro-batches' forwards first, activations kept
alive) finds no free arena and gets another one, so a value is never overwritten while
something can still read it. An arena too small for a call (the first call, whose sizes are
not known yet, or larger inputs under dynamic shapes) leaves the rest to separate
allocations and is replaced by one of the size that call needed.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import torch

from megacompile.core import torch_compat as compat

# Offsets are multiples of this (a cache line; covers every dtype's alignment).
ALIGN = 64


def storage_span_bytes(shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of storage a tensor of this shape and stride reaches (0 for an empty one)."""
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * dtype.itemsize


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _dense_stride(like: torch.Tensor) -> tuple[int, ...]:
    """``like``'s strides where they cover its storage densely, else contiguous ones (as
    ``clone()`` lays out an expanded or gapped tensor): a view written by ``copy_`` must not
    overlap itself."""
    if storage_span_bytes(like.shape, like.stride(), like.dtype) == like.numel() * like.element_size():
        return like.stride()
    stride, step = [], 1
    for size in reversed(like.shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def arena_bytes(values: list) -> int:
    """The arena one call needs for values shaped like ``values`` (tensors or fake tensors of
    the traced graph), or 0 where a size is symbolic (dynamic shapes: the first call tells)."""
    total = 0
    for v in values:
        if not isinstance(v, torch.Tensor) or not all(isinstance(d, int) for d in (*v.shape, *v.stride())):
            return 0
        total += _aligned(storage_span_bytes(v.shape, _dense_stride(v), v.dtype))
    return total


@dataclasses.dataclass
class ArenaStats:
    """What a program's pool did (``OffloadArena`` allocations and the values they held)."""

    arenas_made: int = 0  # buffers allocated over the program's life (1 in a steady loop)
    bytes_made: int = 0
    leases: int = 0  # calls that took an arena
    placed: int = 0  # values written into an arena
    spilled: int = 0  # values that did not fit and were allocated on their own


class OffloadArena:
    """One host buffer, carved in order by the call that leases it."""

    def __init__(self, nbytes: int, allocate: Callable[[int], torch.Tensor]) -> None:
        self.buffer = allocate(nbytes)
        self.capacity = nbytes
        self._baseline = compat.storage_use_count(self.buffer)  # the references of an unleased arena

    def free(self) -> bool:
        """Whether nothing outside the pool still refers to the buffer's memory."""
        return compat.storage_use_count(self.buffer) <= self._baseline


class ArenaLease:
    """One call's use of an arena (or of none): where each offloaded value goes."""

    def __init__(self, arena: OffloadArena | None) -> None:
        self.arena = arena
        self.used = 0  # bytes of the arena handed out
        self.needed = 0  # bytes the call asked for (more than the arena's: some values spilled)
        self.placed = 0
        self.spilled = 0

    def place(self, like: torch.Tensor) -> torch.Tensor | None:
        """A view of the arena shaped and strided like ``like``, or None where it does not fit
        (the caller allocates the value on its own)."""
        if like.device.type == "meta":  # a plan traced without memory: nothing to place
            return None
        stride = _dense_stride(like)
        span = storage_span_bytes(like.shape, stride, like.dtype)
        self.needed += _aligned(span)
        if self.arena is None or span == 0 or self.used + span > self.arena.capacity:
            self.spilled += 1
            return None
        flat = self.arena.buffer[self.used:self.used + span].view(like.dtype)
        self.used += _aligned(span)
        self.placed += 1
        return flat.as_strided(like.shape, stride)


class ArenaPool:
    """A program's arenas: each call leases a free one, or a new one of the size calls need
    (``size``: what the traced shapes say, 0 if symbolic: then the calls tell).
    ``allocate(nbytes)`` makes a buffer (the device's: page-locked on CUDA); ``before_reuse()``
    orders a reused buffer's new writes after the reads still in flight from it (CUDA: the
    copy streams)."""

    def __init__(self, allocate: Callable[[int], torch.Tensor], before_reuse: Callable[[], None],
                 size: int = 0) -> None:
        self._allocate = allocate
        self._before_reuse = before_reuse
        self._arenas: list[OffloadArena] = []
        self._size = size  # bytes one call needs: from the traced shapes, or learned from the calls
        self._lock = threading.Lock()
        self.stats = ArenaStats()

    @property
    def nbytes(self) -> int:
        """Host bytes the pool's buffers hold now."""
        with self._lock:
            return sum(a.capacity for a in self._arenas)

    def lease(self) -> ArenaLease:
        """Where one call's offloaded values go: a free arena, a new one, or none before any
        call has told how many bytes a call needs."""
        with self._lock:
            self.stats.leases += 1
            if self._size == 0:
                return ArenaLease(None)
            for arena in list(self._arenas):
                if not arena.free():
                    continue
                if arena.capacity < self._size:  # a later call needed more: replace it
                    self._arenas.remove(arena)
                    continue
                self._before_reuse()
                return ArenaLease(arena)
            arena = OffloadArena(self._size, self._allocate)
            self.stats.arenas_made += 1
            self.stats.bytes_made += self._size
            self._arenas.append(arena)
            return ArenaLease(arena)

    def finished(self, lease: ArenaLease) -> None:
        """A call ended: its needs size the next arena made."""
        with self._lock:
            self._size = max(self._size, lease.needed)
            self.stats.placed += lease.placed
            self.stats.spilled += lease.spilled


class LandingBuffers:
    """Exact-size host buffers the gradients of a backward land in, reused step after step.

    A returned gradient's copy to the host used to allocate a host tensor per copy per step:
    on CUDA from torch's pinned caching allocator (power-of-two blocks kept for the life of
    the process), on the host from the C heap, which keeps freed pages (a step's landed
    gradients stayed in the RSS). A parameter's gradient has the same size every step, so
    ``take`` hands out a view of a buffer of exactly its size that nothing else refers to any
    more (the same reference count ``OffloadArena.free`` reads: the host optimizer, the sink
    or ``param.grad`` may still hold last step's), or allocates one (the device's
    ``host_buffer``: page-locked in place on CUDA). The pool grows to the most gradients of a
    size alive at once: a few layers' with the overlapped optimizer, every one where
    ``param.grad`` keeps them."""

    def __init__(self, allocate: Callable[[int], torch.Tensor]) -> None:
        self._allocate = allocate
        self._buffers: dict[int, list[OffloadArena]] = {}
        self._lock = threading.Lock()
        self.made = 0  # buffers allocated
        self.reused = 0  # views handed out of a buffer made before

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.capacity for bufs in self._buffers.values() for b in bufs)

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """A host view shaped and strided like ``like`` over a free buffer of its size, or
        None where ``like`` does not cover its storage densely (the caller allocates)."""
        if like.device.type == "meta":
            return None
        stride = like.stride()
        span = storage_span_bytes(like.shape, stride, like.dtype)
        if span == 0 or span != like.numel() * like.element_size():
            return None
        with self._lock:
            buffers = self._buffers.setdefault(span, [])
            buffer = next((b for b in buffers if b.free()), None)
            if buffer is None:
                buffer = OffloadArena(span, self._allocate)
                buffers.append(buffer)
                self.made += 1
            else:
                self.reused += 1
            # The view is made under the lock: from here its reference marks the buffer taken.
            return buffer.buffer.view(like.dtype).as_strided(like.shape, stride)
