"""megacompile: train models larger than GPU memory on one GPU, as a torch.compile backend.

    step = torch.compile(step, backend="megatrain", options={"device": "cuda", "memory_budget": "8GiB"})

The backend is registered through the ``torch_dynamo_backends`` entry point, so no import is
needed; importing this package registers it as well (for uninstalled checkouts).
"""
from __future__ import annotations

from . import ops  # noqa: F401  (registers the megatrain op library)
from .backend import megatrain
from .errors import BudgetError, MegacompileError, OptionsError, PlacementError
from .options import Options, parse_options
from .repeats import mark_repeated_layers, unmark_repeated_layers
from .report import StepReport, last_report
from .runtime.trace import trace_runtime

__all__ = [
    "BudgetError", "MegacompileError", "Options", "OptionsError", "PlacementError", "StepReport",
    "last_report", "mark_repeated_layers", "megatrain", "parse_options", "trace_runtime",
    "unmark_repeated_layers",
]


def _register_backend() -> None:
    from ._torch_compat import register_dynamo_backend

    register_dynamo_backend(megatrain, "megatrain")


_register_backend()
