"""Persistent bf16 copies of host weights: what a load carries under ``precision="bf16"``.

Autocast casts each fp32 weight to bf16 before its matmul; ``host_casts`` runs that cast on
the host so the load carries 2 bytes per element. Made afresh before every load, the casts
held the host thread for most of a bf16 step (docs/results.md). Instead each weight
has one bf16 copy, made at its first load and kept: the host optimizer rewrites it in the same
pass as its update (``fused_adam_step(bf16_copies=...)``), and a load takes it as it is.

A copy is current while its weight's version counter is the one recorded when the copy was
written: every in-place write through torch bumps it (the host Adam kernel too), so a stock
optimizer, ``load_state_dict`` or a user's ``p.mul_()`` make the next load rewrite the copy in
place (the same buffer, no allocation). Writes that bypass the counter (``p.data.mul_()``)
are not seen: ``megacompile.forget_weight_copies()`` drops every copy after such a write.

On CUDA each copy is exactly its size and page-locked in place (``cudaHostRegister``), so the
load is a true asynchronous copy with no staging buffer.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from megacompile.core import torch_compat as compat
from megacompile.core.host_memory import check_host_allocation
from megacompile.runtime.pinned_memory import PinnedHostBudget


@dataclasses.dataclass(eq=False)
class _Copy:
    tensor: torch.Tensor
    version: int  # the weight's version counter when ``tensor`` was written
    data_ptr: int  # the weight's storage then (a ``.data`` swap makes it another weight)
    # Lent to the host optimizer: the weight's gradient landed in it, and the update that
    # rewrites it is due (until then a load would recast it: ``version`` is stale).
    lent: bool = False


@dataclasses.dataclass
class WeightCopyStats:
    made: int = 0  # copies allocated (first load of a weight)
    recast: int = 0  # loads that found the weight changed and rewrote its copy
    written_by_optimizer: int = 0  # copies the host optimizer rewrote with its update
    reused: int = 0  # loads that took a current copy as it was
    lent: int = 0  # copies a gradient landed in before the update that rewrote them


class WeightCopies:
    """One low-precision copy per host weight, held while the weight lives."""

    def __init__(self, page_lock: bool, pinned: PinnedHostBudget | None = None) -> None:
        self.page_lock = page_lock
        self.pinned = pinned  # the device's cap on page-locked bytes (None: no cap)
        self.stats = WeightCopyStats()
        self._copies: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._lock = threading.Lock()

    def get(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The copy of ``weight`` in ``dtype``, rewritten first if the weight changed."""
        with self._lock:
            entry = self._copies.get(weight)
            if entry is not None and entry.tensor.dtype != dtype:
                entry = None  # one copy per weight; another dtype replaces it
            if entry is None:
                entry = self._make(weight, dtype)
                self.stats.made += 1
            elif entry.lent or entry.version != compat.tensor_version(weight) or entry.data_ptr != weight.data_ptr():
                # (lent: holds a gradient whose update never ran, e.g. the step failed)
                with torch.no_grad():
                    entry.tensor.copy_(weight)
                entry.lent = False
                self.stats.recast += 1
            else:
                self.stats.reused += 1
                return entry.tensor
            entry.version, entry.data_ptr = compat.tensor_version(weight), weight.data_ptr()
            return entry.tensor

    def _make(self, weight: torch.Tensor, dtype: torch.dtype) -> _Copy:
        check_host_allocation(weight.numel() * dtype.itemsize, f"the {dtype} copy of a weight of shape "
                              f"{tuple(weight.shape)} (precision='bf16' keeps one per weight on the host)")
        copy = torch.empty(weight.shape, dtype=dtype)  # contiguous: what the kernel writes
        with torch.no_grad():
            copy.copy_(weight)
        nbytes = copy.numel() * copy.element_size()
        if self.page_lock and (self.pinned is None or self.pinned.try_pin(nbytes)):
            compat.register_host_memory(copy)
            weakref.finalize(copy, compat.unregister_host_memory, copy.data_ptr())
            if self.pinned is not None:
                weakref.finalize(copy, self.pinned.release, nbytes)
        entry = _Copy(copy, compat.tensor_version(weight), weight.data_ptr())
        self._copies[weight] = entry
        return entry

    def _current(self, p: torch.Tensor) -> _Copy | None:
        e = self._copies.get(p)
        current = (e is not None and e.tensor.dtype == torch.bfloat16 and e.tensor.is_contiguous()
                   and e.version == compat.tensor_version(p) and e.data_ptr == p.data_ptr())
        return e if current else None

    def for_update(self, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """For each of ``params`` the host optimizer is about to update, its current bf16 copy
        (to rewrite in the same pass; one ``lend`` gave it is current too), or None: no copy
        (a weight no load casts, e.g. a norm's) or a stale one (rewritten at its next load
        instead)."""
        with self._lock:
            found = []
            for p in params:
                e = self._copies.get(p)
                if e is not None and not e.lent:
                    e = self._current(p)
                found.append(e.tensor if e is not None else None)
            return found

    def lend(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The current bf16 copy of ``weight`` for its bf16 gradient to land in, or None.
        Only for a gradient the host optimizer updates ``weight`` with in this step, after
        which no load reads the old weight: the update reads the gradient and rewrites the
        copy element by element in one pass (``fused_adam_step``), so the gradient takes no
        host memory of its own. Until ``updated`` the copy is stale: a load recasts it."""
        with self._lock:
            e = self._current(weight)
            if e is None:
                return None
            e.lent, e.version = True, -1
            self.stats.lent += 1
            return e.tensor

    def updated(self, params: list[torch.Tensor]) -> None:
        """``params`` were updated and their copies written in the same pass: current again."""
        with self._lock:
            for p in params:
                entry = self._copies[p]
                entry.version, entry.data_ptr = compat.tensor_version(p), p.data_ptr()
                entry.lent = False
            self.stats.written_by_optimizer += len(params)

    def nbytes(self, params: list[torch.Tensor]) -> int:
        with self._lock:
            entries = (self._copies.get(p) for p in params)
            return sum(e.tensor.untyped_storage().nbytes() for e in entries if e is not None)

    def forget(self) -> None:
        with self._lock:
            self._copies = WeakIdKeyDictionary()
