"""A backward called with ``retain_graph=True``: the saved activations stay on the device.

The plan frees each saved activation at its last read in the backward. Under
``loss.backward(retain_graph=True)`` (a second backward through the same graph, several losses
one after another, Reformer's reversible layers inside their own backward) autograd holds every
saved tensor until the graph itself is freed, so nothing the plan frees early is freed and the
backward peaks above its plan. Option ``retain_graph=True`` makes the planner price the backward
with its inputs held to its end (``estimate_program_pair(inputs_held=True)``). Without it the plan cannot
know how the backward will be called; its program can, when it starts: then that peak is estimated
once per graph, the report notes it, and where it is over the budget a warning says what to change
(the backward still runs: the forward already did, and updates may have landed).
"""
from __future__ import annotations

import warnings
from typing import Callable

from megacompile.capture.records import CompiledGraph
from megacompile.core import torch_compat as compat
from megacompile.core.units import format_bytes
from megacompile.plan.memory_estimate import allocation_granularity, estimate_program_pair


def retained_backward_peak(record: CompiledGraph) -> int:
    """The backward's peak with every input (saved activation, incoming gradient) held to its end,
    on top of what the step's earlier graphs held when it was planned."""
    options = record.options
    _, held = estimate_program_pair(record.forward, record.backward, options.lowering,
                                    allocation_granularity(options.device), inputs_held=True)
    return record.planned_on_top_of + held.peak_bytes


def retained_graph_check(record: CompiledGraph) -> Callable[[list], None]:
    """The check a backward program runs at its start: the first time it retains the graph, records
    the peak with the inputs held (the report notes it) and warns if that is over ``memory_budget``."""
    checked = False

    def check(args: list) -> None:
        nonlocal checked
        if checked or not compat.backward_keeps_graph():
            return
        checked = True
        need = record.retained_backward_peak = retained_backward_peak(record)
        budget = record.options.memory_budget
        if budget is not None and need > budget:
            warnings.warn(
                f"megatrain: {record.label}'s backward runs with retain_graph=True, so autograd keeps its saved "
                f"activations on the device until the graph is freed, where the plan frees each at its last read. "
                f"With them held it needs up to {format_bytes(need)} ({need} bytes), over memory_budget="
                f"{format_bytes(budget)}. Set option retain_graph=True (the planner then plans for them held), or "
                f"run one backward without retain_graph (sum the losses first).",
                stacklevel=1)  # autograd calls the backward: no user frame to point at

    return check
