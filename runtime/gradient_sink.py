"""Where a program puts the values it returns as they reach the host: the gradient sink.

A backward returns its gradients on the host, each one from an ``offload`` (or, under bf16,
from the host cast that widens the offloaded bf16 copy to the fp32 gradient). The program asks
its sink, per returned value, whether the sink takes it over as it lands; what the sink does
not take the program keeps and returns.

``GradientSink`` itself is the default sink: it takes nothing, so every gradient is returned,
and a bf16 gradient is widened by the graph's own host cast. The overlapped optimizer's
``GradientLander`` (``megacompile.optimizer.overlap``) takes the gradients of the parameters
it updates, each as soon as its copy lands (a bf16 copy before its cast: the fused kernel
widens it exactly), and the program returns None for those.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass
class DeviceWork:
    """What a sink started on a gradient still on the device (``GradientSink.before_offload``)."""

    # Called before the copy is issued, in the copy's stream context (or by the sink itself
    # where there is no copy): orders what follows after the work.
    after: Callable[[], None]
    # False: this host does not need the value (it went to another rank): no copy is made and
    # the sink hears of it through ``not_copied``.
    copy: bool = True


class GradientSink:
    """Receives a program's returned host values by output position; the default takes none."""

    def owns(self, position: int) -> bool:
        """Whether the sink takes over the value returned at ``position``. Asked before
        ``take``, once per landing, so a copy's completion is only handed over when it is
        taken (on CUDA, handing it over moves the copy's event from the program's wait to the
        sink)."""
        return False

    def landing_place(self, position: int, like: torch.Tensor) -> torch.Tensor | None:
        """An ``owns`` position's value, still on the device, about to be copied to the host:
        host memory of the sink's own shaped like ``like`` for the copy to land in, or None
        (the program's landing buffers). The overlapped optimizer offers the weight's bf16
        copy, which its update rewrites anyway: the gradient then needs no host memory."""
        return None

    def before_offload(self, position: int, value: torch.Tensor, layer: str | None) -> DeviceWork | None:
        """An ``owns`` position's value, still on the device, just before the program copies
        it to the host (only where nothing else reads its memory after the copy): the sink may
        start work on it in place (data parallel: its all-reduce, or its reduce to the rank
        that updates it). Returns that work, or None."""
        return None

    def not_copied(self, position: int, layer: str | None, after: Callable[[], None]) -> None:
        """A ``before_offload`` position whose work said no copy: the program returns None
        there; ``after`` must still be called (it surfaces the work's failure)."""
        raise NotImplementedError(f"{type(self).__name__} declined the copy of position {position} but takes no notice")

    def take(self, position: int, host_grad: torch.Tensor, layer: str | None,
             ready: Callable[[], None] | None = None) -> None:
        """The value returned at ``position`` (an ``owns`` position) has landed on the host, in
        the order the program produces them: a gradient from its offload, the narrow copy of a
        gradient the graph widens on the host (its cast then does not run), or a gradient a
        host op made. ``ready()`` blocks until its copy is complete (None: it is). The program
        returns None at ``position``."""
        raise NotImplementedError(f"{type(self).__name__} owns position {position} but takes nothing")

    def widen(self, position: int, narrow: torch.Tensor, cast: Callable[[torch.Tensor], torch.Tensor],
              layer: str | None) -> torch.Tensor:
        """A gradient the sink did not take, at the graph's host cast that widens its landed
        narrow copy (bf16 -> fp32): returns the value the program returns at ``position``.
        ``cast`` runs the graph's cast on a tensor."""
        return cast(narrow)

    def finish(self, failed: bool = False) -> None:
        """The program is returning (``failed``: with an error): nothing may still be in flight."""

    def updated_before_failure(self) -> list[tuple[str | None, int]]:
        """After ``finish(failed=True)``: (layer, parameter count) of what the sink updated
        in this program run before the error (empty: nothing changed)."""
        return []
