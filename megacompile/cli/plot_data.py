"""The numbers the pictures draw, taken from a compiled graph's record and a runtime trace.

Kept apart from the drawing (``plots.py``, matplotlib) so that what a picture shows can be
checked against the plan and the trace without reading pixels.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

from megacompile.core import ops
from megacompile.core.node_info import has_info, info
from megacompile.plan.memory_estimate import allocation_granularity, estimate_program_pair


@dataclasses.dataclass(frozen=True)
class MemoryTimeline:
    """Device bytes live after each node of one graph's step: its forward, then its backward."""

    label: str
    policy: str
    nodes: list[str]  # node names in program order, forward then backward
    phases: list[str]  # "forward" / "backward" per node
    planned: list[int]  # the memory estimate's live bytes (what the planner priced)
    measured: list[int | None]  # the last run's live bytes where the device measured them, else None
    budget: int | None
    peak_index: int
    peak_bytes: int
    # Stretches of the program where one layer's compute runs: (layer, first, last index).
    layers: list[tuple[str, int, int]]
    backward_start: int | None  # index of the backward's first node

    @property
    def is_measured(self) -> bool:
        return any(m is not None for m in self.measured)


_SEGMENT = re.compile(r"^segment\[(.+)\.\.(.+)\]$")


def _measured_by_node(log: list[tuple[str, int]]) -> dict[str, int]:
    """An instruction log as node name -> live bytes; a compiled segment counts for its last node."""
    by_node = {}
    for name, live in log:
        m = _SEGMENT.match(name)
        by_node[m.group(2) if m else name] = live
    return by_node


def memory_timeline(record) -> MemoryTimeline:
    """The timeline of a ``CompiledGraph`` with a plan (a training or inference graph)."""
    if record.plan is None or record.forward is None:
        raise ValueError(f"{record.label} has no device program (it runs on the host): no memory timeline")
    fw_curve: list = []
    bw_curve: list = []
    options = record.options
    estimate_program_pair(record.forward, record.backward, options.lowering,
                          allocation_granularity(options.device), curves=(fw_curve, bw_curve),
                          inputs_held=options.retain_graph)
    nodes, phases, planned, measured, layer_of = [], [], [], [], []
    for phase, gm, curve in (("forward", record.forward, fw_curve), ("backward", record.backward, bw_curve)):
        if gm is None:
            continue
        by_node = _measured_by_node(record.memory_logs.get(phase, []))
        current = None
        graph_nodes = {n.name: n for n in gm.graph.nodes}
        for name, live in curve:
            node = graph_nodes[name]
            nodes.append(name)
            phases.append(phase)
            planned.append(live)
            measured.append(by_node.get(name))
            # Shaded by the layer whose compute runs: a memory op (a load prefetched for the
            # next layer, an evict of the last) and a glue op (a gradient accumulation between
            # two of a layer's ops) belong to the stretch they run in.
            if node.op == "call_function" and not ops.is_memory_op(node) and has_info(node) and info(node).layer:
                current = info(node).layer
            layer_of.append(current if node.op == "call_function" else None)
    layers: list[tuple[str, int, int]] = []
    for i, layer in enumerate(layer_of):
        if layers and layers[-1][0] == layer and layers[-1][2] == i - 1:
            layers[-1] = (layer, layers[-1][1], i)
        elif layer is not None:
            layers.append((layer, i, i))
    peak_index = max(range(len(planned)), key=planned.__getitem__) if planned else 0
    return MemoryTimeline(
        label=record.label, policy=str(record.plan.policy), nodes=nodes, phases=phases, planned=planned,
        measured=measured, budget=options.memory_budget, peak_index=peak_index,
        peak_bytes=planned[peak_index] if planned else 0, layers=layers,
        backward_start=phases.index("backward") if "backward" in phases else None,
    )


# --- the runtime trace -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Lane:
    """One track of a runtime trace: its events as (start, duration, name), microseconds."""

    name: str
    spans: list[tuple[float, float, str]]


class TraceError(ValueError):
    """A file that is not a runtime trace; the message says what to give instead."""


def read_trace(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise TraceError(f"{os.fspath(path)!r} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{os.fspath(path)!r} is not JSON ({e}); give a file written by "
                         f"megacompile.trace_runtime(path)") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{os.fspath(path)!r} has no 'traceEvents' list: it is not a Chrome trace written by "
                         f"megacompile.trace_runtime(path)")
    return data


def last_step_window(trace: dict[str, Any]) -> tuple[float, float] | None:
    """(start, end) in microseconds of the trace's last training step: from the start of the
    last program run that has a backward after it (its forward), to the end of the trace.
    None when no backward ran (the whole trace is then one window)."""
    lanes = trace_lanes(trace)
    programs = next((lane.spans for lane in lanes if lane.name == "graphs"), [])
    backwards = [s for s in programs if s[2].endswith(" backward")]
    if not backwards:
        return None
    last_backward = max(backwards, key=lambda s: s[0])
    graph = last_backward[2][: -len(" backward")]
    forwards = [s for s in programs if s[2] == f"{graph} forward" and s[0] <= last_backward[0]]
    if not forwards:
        return None
    start = max(s[0] for s in forwards)
    end = max(s[0] + s[1] for lane in lanes for s in lane.spans)
    return start, end


def trace_lanes(trace: dict[str, Any], window: tuple[float, float] | None = None) -> list[Lane]:
    """The trace's tracks in their display order, each with its complete events; with a
    ``window``, only the events that start inside it."""
    names: dict[int, str] = {}
    order: dict[int, int] = {}
    spans: dict[int, list[tuple[float, float, str]]] = {}
    for event in trace["traceEvents"]:
        tid = event.get("tid")
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            names[tid] = event["args"]["name"]
        elif event.get("ph") == "M" and event.get("name") == "thread_sort_index":
            order[tid] = event["args"]["sort_index"]
        elif event.get("ph") == "X":
            start = float(event["ts"])
            if window is None or window[0] <= start <= window[1]:
                spans.setdefault(tid, []).append((start, float(event["dur"]), str(event.get("name", ""))))
    tids = sorted(spans, key=lambda t: (order.get(t, t), t))
    return [Lane(names.get(t, f"track {t}"), sorted(spans[t])) for t in tids]
