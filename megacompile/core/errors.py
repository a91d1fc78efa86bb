"""The errors megacompile raises to users.

They derive from Dynamo's pass-through exception base so that an error raised while the
backend compiles reaches the user as itself (``except megacompile.BudgetError``), not wrapped
in ``BackendCompilerFailed``.
"""
from __future__ import annotations

from megacompile.core import torch_compat as _torch_compat

_PassThrough = _torch_compat.passthrough_exception_base()


class MegacompileError(_PassThrough):
    def __init__(self, message: str):
        super().__init__(message, first_useful_frame=None)


class OptionsError(MegacompileError, ValueError):
    """An unknown option or a bad value; the message lists the valid choices."""


class BudgetError(MegacompileError, ValueError):
    """The model cannot be trained under the device memory budget.

    ``minimum_budget`` is the smallest budget the planner could meet and ``limiting_layer``
    the layer whose working set sets it. ``streaming_floor`` (bytes, where the planner
    computed it) is what streaming layer by layer needs at least (``plan/streaming_floor.py``).
    ``token_chunked_minimum`` (where it is lower): the smallest budget with each layer's
    per-token runs in chunks (option ``token_chunks``; "auto" chunks at such a budget).
    ``least_host_activation_bytes`` (where plans fit the budget but not ``host_activation_budget``):
    the least activations any of them puts on the host, the cap that would do.
    """

    def __init__(self, message: str, minimum_budget: int, limiting_layer: str,
                 streaming_floor: int | None = None, token_chunked_minimum: int | None = None,
                 least_host_activation_bytes: int | None = None):
        super().__init__(message)
        self.minimum_budget = minimum_budget
        self.limiting_layer = limiting_layer
        self.streaming_floor = streaming_floor
        self.token_chunked_minimum = token_chunked_minimum
        self.least_host_activation_bytes = least_host_activation_bytes


class PartialUpdateError(MegacompileError, RuntimeError):
    """A step failed after the overlapped host optimizer had updated some layers.

    ``updated`` lists (layer, parameter count) of what was updated in the failed step: those
    parameters and their optimizer state are one step ahead of the others (restore a
    checkpoint, or accept it). ``error`` is the error that stopped the step (the autograd
    engine does not keep ``__cause__`` across its threads)."""

    def __init__(self, message: str, updated: list[tuple[str | None, int]], error: BaseException | None = None):
        super().__init__(message)
        self.updated = updated
        self.error = error


class GradientOutsideGraphsError(MegacompileError, RuntimeError):
    """The overlapped host optimizer updated parameters from the gradient megatrain's graphs
    computed, and code outside them (eager code between graph breaks, a ``torch._dynamo.disable``
    function) added more to it in the same backward: this step's update of those parameters is
    not eager's. From now on megatrain leaves them to ``step()``. ``shapes``: theirs."""

    def __init__(self, message: str, shapes: list[tuple[int, ...]]):
        super().__init__(message)
        self.shapes = shapes


class HostMemoryError(MegacompileError, MemoryError):
    """The host cannot hold what megatrain is about to allocate (``core/host_memory.py``);
    raised before anything is allocated."""

    def __init__(self, message: str, needed_bytes: int, available_bytes: int):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


class PlacementError(MegacompileError, ValueError):
    """Parameters are not where megatrain needs them (it keeps them in host memory)."""


class UnsupportedStepError(MegacompileError, NotImplementedError):
    """The step uses something megatrain cannot stream (e.g. an embedding with sparse
    gradients); raised before anything runs, the message says what to change."""


class DataParallelError(MegacompileError, RuntimeError):
    """A data-parallel setup that cannot work, or a collective that failed (a rank exited,
    timed out, or ran a different step); the message says what to change."""


class UnsupportedGraph(Exception):
    """Raised inside the backend when the passes cannot handle a graph.

    Never reaches the user: the backend catches it, warns once with the reason, and falls
    back to plain compilation of that graph.
    """
