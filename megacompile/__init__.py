"""megacompile: train models larger than GPU memory on one GPU, as a torch.compile backend.

    step = torch.compile(step, backend="megatrain", options={"device": "cuda", "memory_budget": "8GiB"})

The backend is registered through the ``torch_dynamo_backends`` entry point, so no import is
needed; importing this package registers it as well (for uninstalled checkouts).
The map of the package is in docs/architecture.md ("Where things live").
"""
from __future__ import annotations

from megacompile.backend import megatrain
from megacompile.capture.records import compiled_graphs
from megacompile.capture.repeated_layers import mark_repeated_layers, unmark_repeated_layers
from megacompile.checkpoint import load_optimizer_state_dict, optimizer_state_dict
from megacompile.core import ops  # noqa: F401  (registers the megatrain op library)
from megacompile.core.errors import (
    BudgetError,
    DataParallelError,
    GradientOutsideGraphsError,
    HostMemoryError,
    MegacompileError,
    OptionsError,
    PartialUpdateError,
    PlacementError,
    UnsupportedStepError,
)
from megacompile.core.torch_compat import register_dynamo_backend, register_torch_logs
from megacompile.distributed import data_parallel, no_sync
from megacompile.options import Options, parse_options
from megacompile.report import StepReport, last_report
from megacompile.runtime.device import forget_weight_copies
from megacompile.runtime.trace import trace_runtime

__all__ = [
    "BudgetError", "DataParallelError", "MegacompileError", "data_parallel", "no_sync",
    "load_optimizer_state_dict", "optimizer_state_dict",
    "compiled_graphs", "forget_weight_copies", "Options", "OptionsError",
    "GradientOutsideGraphsError", "HostMemoryError", "PartialUpdateError",
    "PlacementError", "StepReport", "last_report", "mark_repeated_layers", "megatrain", "parse_options",
    "trace_runtime", "unmark_repeated_layers", "UnsupportedStepError",
]

register_dynamo_backend(megatrain, "megatrain")
register_torch_logs()  # TORCH_LOGS="megatrain": docs/guide.md, "Logs"
