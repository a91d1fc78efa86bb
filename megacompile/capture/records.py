"""What megatrain compiled, kept with the function it was compiled for.

Each graph Dynamo hands the backend becomes a ``CompiledGraph``: its options, plan, rewritten
programs and the per-pass snapshots ``megacompile inspect`` prints. Records belong to the user's
function (``compiled_graphs(step)``, the way ``thunder.last_traces(fn)`` works), found from the
code object Dynamo was compiling; a graph after a graph break belongs to the function it
was cut from. They live as long as that function's code does, not as long as the process.
``recording()`` collects every record made while it is open, for a caller that runs code it
did not write (``megacompile inspect``, a test).
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import weakref
from typing import Any, Iterator

import torch
import torch.fx as fx

from megacompile.core import torch_compat as compat
from megacompile.core.node_info import info
from megacompile.core.units import format_bytes
from megacompile.options import Options
from megacompile.plan.training_plan import TrainingPlan
from megacompile.report import LayerRow, StepReport
from megacompile.runtime.device import existing_device


@dataclasses.dataclass
class CompileTimes:
    """Where compiling one graph went (wall seconds; ``StepReport.compile_times``)."""
    capture_s: float = 0.0  # AOTAutograd's trace of the joint graph: the backend's start to the planner's
    planning_s: float = 0.0  # the planner: every candidate plan built and priced
    plans_built: int = 0
    lowering_s: float = 0.0  # the chosen programs turned into streaming programs


@dataclasses.dataclass
class CompiledGraph:
    label: str
    options: Options
    snapshots: list = dataclasses.field(default_factory=list)
    plan: TrainingPlan | None = None
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    param_bytes_by_layer: dict = dataclasses.field(default_factory=dict)
    # Device bytes the step's earlier graphs held when this one was planned (it fits beside them).
    planned_on_top_of: int = 0
    # The graph's parameters (weakly: the record must not keep a model alive), by input index.
    param_refs: dict = dataclasses.field(default_factory=dict)
    # Inductor lowering: how many distinct segments were compiled and how many repeats reused
    # one (runtime.segment_cache.SegmentCacheStats).
    segment_stats: Any = None
    # Under `megacompile inspect`, where the device measures: "forward" / "backward" -> the
    # last run's (instruction name, device bytes live after it) (``StreamingProgram.memory_log``).
    memory_logs: dict = dataclasses.field(default_factory=dict)
    # Where its backward ran with retain_graph=True: its peak with the saved activations held to the
    # end (``retained_graph.py``), which is what the device sees then; None where it never did.
    retained_backward_peak: int | None = None
    compile_times: CompileTimes = dataclasses.field(default_factory=CompileTimes)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.params())

    def params(self) -> list[torch.Tensor]:
        return [p for p in (ref() for ref in self.param_refs.values()) if p is not None]

    def host_bytes(self, optimizer) -> dict[str, int]:
        """What this graph's parameters hold in host memory between steps (``host_bytes_of``)."""
        return host_bytes_of([self], optimizer)

    @property
    def measures_peak(self) -> bool:
        # CUDA: the allocator measures everything. CPU stand-in: only the eager lowering
        # hands every device-side tensor to the tracker.
        return self.options.device == "cuda" or self.options.lowering == "eager"

    def make_step_report(self, graphs: list["CompiledGraph"], held_at_start: list[int], calls: list[int],
                         peaks: list[int], **kw) -> StepReport:
        """The report of a step made of ``graphs`` (this one first, in the order they started;
        ``calls``: how often each ran; ``peaks``: the most its planned peak and what it ran
        beside came to): this graph's report, or every graph's merged into one
        (``_merge_step_reports``)."""
        if len(graphs) == 1 and calls == [1]:
            return self.make_report(**kw)
        reports = [g.make_report(**kw) for g in graphs]
        host = host_bytes_of(graphs, kw.get("optimizer"))
        overlap = kw.get("overlap")
        if overlap is not None and overlap["overlapped"]:
            host["gradients"] = max(0, host["gradients"] - overlap["consumed_grad_bytes"])
        num_params = sum({id(p): p.numel() for g in graphs for p in g.params()}.values())
        return _merge_step_reports(graphs, reports, held_at_start, calls, peaks, host, num_params)

    def make_report(self, stats, measured: int | None, host_graphs: list[str], optimizer=None,
                    staging_peak: int = 0, overlap: dict | None = None, reserved: int | None = None,
                    pinned: tuple[int, int | None] = (0, None), offload_arena_bytes: int = 0,
                    gradient_landing_bytes: int = 0) -> StepReport:
        """The step's report from its transfer counters (``device.stats``), measured peaks, the
        optimizer whose state counts as host memory, and the overlapped optimizer's stats."""
        plan = self.plan
        layers: dict[str, LayerRow] = {}

        def row(name: str | None) -> LayerRow:
            key = name or "(glue)"
            if key not in layers:
                layers[key] = LayerRow(key)
            return layers[key]

        for layer, nbytes in self.param_bytes_by_layer.items():
            row(layer).param_bytes += nbytes
        for layer, nbytes in stats.h2d_by_layer.items():
            row(layer).h2d_bytes = nbytes
        for layer, nbytes in stats.d2h_by_layer.items():
            row(layer).d2h_bytes = nbytes
        if self.forward is not None:
            saved = set(plan.saved_values)
            for node in self.forward.graph.nodes:
                if node.name in saved and info(node).placement == "device":
                    row(info(node).layer).saved_activation_bytes += info(node).nbytes_hint
        if self.backward is not None:
            for node in self.backward.graph.nodes:
                if node.op == "call_function" and info(node).phase == "recompute":
                    row(info(node).layer).recomputed_ops += 1
        for est, attr in ((plan.forward, "planned_forward_peak"), (plan.backward, "planned_backward_peak")):
            if est is not None:
                for layer, peak in est.per_layer_peak.items():
                    setattr(row(layer), attr, peak)
        host = self.host_bytes(optimizer)
        if overlap is not None and overlap["overlapped"]:
            # Updated as they landed: those gradients were consumed, not kept (the in-flight
            # peak is ``optimizer["peak_pending_grad_bytes"]``).
            host["gradients"] = max(0, host["gradients"] - overlap["consumed_grad_bytes"])
        num_params = self.num_params
        return StepReport(
            device=self.options.device,
            precision=self.options.precision,
            host_bytes=host,
            host_bytes_per_param=sum(host.values()) / num_params if num_params else 0.0,
            host_staging_peak_bytes=staging_peak,
            lowering=self.options.lowering,
            memory_budget=self.options.memory_budget,
            policy=plan.policy,
            planned_peak_device_bytes=plan.peak_bytes,
            measured_peak_device_bytes=measured,
            measured_reserved_device_bytes=reserved,
            pinned_host_bytes=pinned[0],
            pinned_host_cap=pinned[1],
            offload_arena_bytes=offload_arena_bytes,
            gradient_landing_bytes=gradient_landing_bytes,
            h2d_bytes=stats.h2d_bytes,
            d2h_bytes=stats.d2h_bytes,
            recomputed_ops=list(plan.recomputed_ops),
            layers=list(layers.values()),
            graphs=[self.label],
            host_graphs=host_graphs,
            notes=([plan.reason] if plan.reason else []) + ([
                f"the backward ran with retain_graph=True: autograd held the saved activations to its end, "
                f"up to {format_bytes(self.retained_backward_peak)} on the device"
                + (" (planned so: option retain_graph)" if self.options.retain_graph else
                   " where the plan frees them (option retain_graph plans for it)")]
                if self.retained_backward_peak is not None else []),
            optimizer=overlap,
            segments=dataclasses.asdict(self.segment_stats) if self.segment_stats is not None else None,
            compile_times={**dataclasses.asdict(self.compile_times),
                           "segments_s": self.segment_stats.compile_seconds if self.segment_stats is not None else 0.0},
        )


def host_bytes_of(graphs: list[CompiledGraph], optimizer) -> dict[str, int]:
    """What the parameters of ``graphs`` hold in host memory between steps, by kind, counted
    from the tensors themselves (each parameter once, however many graphs read it): the (fp32
    master) weights, the gradients the backward hands to ``param.grad`` (their dtype and size,
    from the backward program), the optimizer's state tensors for these parameters, and the
    bf16 copies loads carry (``precision="bf16"``; runtime/weight_copies.py)."""
    params: dict[int, torch.Tensor] = {}
    grads: dict[int, int] = {}
    for graph in graphs:
        by_position = {i: ref() for i, ref in graph.param_refs.items()}
        params.update({id(p): p for p in by_position.values() if p is not None})
        if graph.backward is not None:
            output = next(iter(graph.backward.graph.find_nodes(op="output")))
            for index, out in enumerate(output.args[0]):
                p = by_position.get(index)
                if p is not None and isinstance(out, fx.Node):
                    grads[id(p)] = max(grads.get(id(p), 0), info(out).nbytes_hint)
    unique = list(params.values())
    states = 0
    if optimizer is not None:
        for p in unique:
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    states += value.untyped_storage().nbytes()
    device = existing_device(graphs[0].options.device)
    return {
        # By storage: parameters that are views of one buffer (a data-parallel node's shared
        # weights, runtime/shared_parameters.py) hold it once.
        "weights": sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in unique}.values()),
        "gradients": sum(grads.values()),
        "optimizer_states": states,
        "bf16_weight_copies": device.weight_copies.nbytes(unique) if device is not None else 0,
    }


def _merge_step_reports(graphs: list[CompiledGraph], reports: list[StepReport], held_at_start: list[int],
                        calls: list[int], peaks: list[int], host: dict[str, int], num_params: int) -> StepReport:
    """One report for a step Dynamo split into several graphs, or in which a graph ran several
    times before its backward: each call ran on top of what the earlier ones held on the device
    until their backward (``held_at_start``: the most any call of the graph started beside)."""
    first = reports[0]
    layers: dict[str, LayerRow] = {}
    for r in reports:
        for row in r.layers:
            merged = layers.setdefault(row.layer, LayerRow(row.layer, h2d_bytes=row.h2d_bytes, d2h_bytes=row.d2h_bytes))
            merged.param_bytes += row.param_bytes
            merged.saved_activation_bytes += row.saved_activation_bytes
            merged.recomputed_ops += row.recomputed_ops
            merged.planned_forward_peak = max(merged.planned_forward_peak, row.planned_forward_peak)
            merged.planned_backward_peak = max(merged.planned_backward_peak, row.planned_backward_peak)
    notes = []
    for g, r, held, n_calls in zip(graphs, reports, held_at_start, calls):
        notes += [f"{g.label}: {n}" for n in r.notes]
        if n_calls > 1:
            notes.append(f"{g.label} ran {n_calls} times in the step before its backward")
        if held:
            notes.append(f"{g.label} runs on top of {format_bytes(held)} the step's earlier graphs hold on the "
                         f"device until their backward (planned peak {format_bytes(r.planned_peak_device_bytes)} "
                         f"+ that)")
    segments = None
    if any(r.segments for r in reports):
        segments = {k: sum((r.segments or {}).get(k, 0) for r in reports)
                    for k in ("compiled", "reused", "compile_seconds")}
    compile_times = {k: sum(r.compile_times.get(k, 0) for r in reports if r.compile_times)
                     for k in first.compile_times or {}}
    return dataclasses.replace(
        first,
        policy=" | ".join(f"{g.label}: {r.policy}" for g, r in zip(graphs, reports)),
        planned_peak_device_bytes=max(peaks),
        recomputed_ops=[op for r in reports for op in r.recomputed_ops],
        layers=list(layers.values()),
        graphs=[g.label for g in graphs],
        notes=notes,
        host_bytes=host,
        host_bytes_per_param=sum(host.values()) / num_params if num_params else 0.0,
        segments=segments,
        compile_times=compile_times or None,
    )


_lock = threading.Lock()
# The function's code object, or the module for a compiled module -> its records.
_by_owner: "weakref.WeakKeyDictionary[Any, list[CompiledGraph]]" = weakref.WeakKeyDictionary()
# (file, first line, name) of every function compiled so far -> the function its records go
# to. Dynamo runs a compiled frame as a new code object with the same three, so a frame on
# the stack is recognised by them.
_roots_by_site: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()
_open_recordings: list[list[CompiledGraph]] = []


def _site(code) -> tuple:
    return (code.co_filename, code.co_firstlineno, code.co_name)


def _outermost_compiled_caller():
    """The outermost compiled function on the stack: a frame Dynamo compiles while another
    compiled function runs (``opt.step()`` after the graph break at ``backward()``) belongs to it."""
    root = None
    frame = sys._getframe(2)
    while frame is not None:
        root = _roots_by_site.get(_site(frame.f_code), root)
        frame = frame.f_back
    return root


def add(record: CompiledGraph) -> None:
    """Files a record under the user function being compiled, and with every open recording."""
    owner = compat.compiling_owner()
    with _lock:
        if owner is not None:  # a direct backend call (no Dynamo compile running) goes to open recordings only
            root = _outermost_compiled_caller() or owner
            if hasattr(owner, "co_name"):
                _roots_by_site.setdefault(_site(owner), root)
            _by_owner.setdefault(root, []).append(record)
        for recording_list in _open_recordings:
            recording_list.append(record)


def compiled_graphs(fn: Any) -> list[CompiledGraph]:
    """The graphs megatrain compiled for ``fn`` (what ``torch.compile`` was given or returned;
    a module stands for its ``forward``), oldest first, including those of frames Dynamo
    compiled while ``fn`` ran (its rest after a graph break, an ``opt.step()`` it calls).
    Records are kept per function code: closures made by one ``def`` share them."""
    owner = compat.compiled_owner(fn)
    if owner is None:
        raise TypeError(f"compiled_graphs() takes a function or module given to torch.compile, not {type(fn).__name__}")
    with _lock:
        return list(_by_owner.get(owner, ()))


def forget_records() -> None:
    """Drops every function's records, as ``torch._dynamo.reset()`` drops Dynamo's caches (the
    test suite calls both between tests: records are filed under the functions' code
    objects, which live as long as the process)."""
    with _lock:
        _by_owner.clear()


@contextlib.contextmanager
def recording(into: list | None = None) -> Iterator[list[CompiledGraph]]:
    """``with recording() as records:`` every graph compiled inside the block, in order
    (appended to ``into`` where given)."""
    records: list[CompiledGraph] = into if into is not None else []
    with _lock:
        _open_recordings.append(records)
    try:
        yield records
    finally:
        with _lock:
            # By identity: two open recordings may hold equal lists (nested ones, the same graphs).
            del _open_recordings[next(i for i, r in enumerate(_open_recordings) if r is records)]
