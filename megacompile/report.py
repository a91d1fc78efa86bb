"""What the last step planned and did: ``megacompile.last_report()``.

A step starts when a compiled forward (or inference) program starts and runs through the
backward and the optimizer graph that follow, until the next forward starts that no earlier
forward's pending backward ties to the same step. The recorder resets the device's transfer
counters and peak tracker at that point.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import threading
import weakref
from typing import Any

import torch

from megacompile.core.errors import BudgetError
from megacompile.core.units import format_bytes


@dataclasses.dataclass
class LayerRow:
    layer: str
    param_bytes: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    saved_activation_bytes: int = 0
    recomputed_ops: int = 0
    planned_forward_peak: int = 0
    planned_backward_peak: int = 0


@dataclasses.dataclass
class StepReport:
    device: str
    precision: str
    lowering: str
    memory_budget: int | None
    policy: str
    planned_peak_device_bytes: int
    measured_peak_device_bytes: int | None
    h2d_bytes: int
    d2h_bytes: int
    recomputed_ops: list[str]
    layers: list[LayerRow]
    graphs: list[str]
    host_graphs: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    # Host memory the training state holds between steps, counted from the tensors: fp32
    # (master) weights, the gradients the backward hands to ``param.grad``, the optimizer's
    # state for these parameters (after its first step). Bytes by kind, and per parameter.
    host_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    host_bytes_per_param: float = 0.0
    # Transient host copies the step makes on top (bf16: each parameter's bf16 cast until its
    # load, the bf16 gradients until their fp32 cast): the most live at once, measured.
    host_staging_peak_bytes: int = 0
    # The host optimizer in this step's backward: megacompile.optimizer.overlap.OverlapStats as a dict
    # (overlapped, reason, updated_params, update_seconds, exposed_seconds,
    # peak_pending_grad_bytes), or None before a backward ran.
    optimizer: dict | None = None
    # Inductor lowering: {"compiled": distinct segments compiled, "reused": segments that
    # reused a repeat's compiled code} for this step's graph; None for the eager lowering.
    segments: dict | None = None
    # CUDA: the most the caching allocator reserved during the step (what nvidia-smi shows,
    # beside what tensors held); None on the CPU stand-in, which has no allocator cache.
    measured_reserved_device_bytes: int | None = None
    # Host bytes the device runtime holds page-locked after the step (runtime/pinned_memory.py;
    # the CPU stand-in pins nothing) and the cap on them (option pinned_host_memory).
    pinned_host_bytes: int = 0
    pinned_host_cap: int | None = None
    # Host buffers the forwards' offloaded activations land in, exactly their size and reused
    # every step (runtime/host_arena.py): bytes held after the step.
    offload_arena_bytes: int = 0
    # Host buffers returned gradients land in, exactly their size and reused every step
    # (runtime/host_arena.LandingBuffers): bytes held after the step.
    gradient_landing_bytes: int = 0
    # A data-parallel model (megacompile.data_parallel): runtime.data_parallel.DataParallelStats
    # as a dict (world_size, rank, synced, buckets, reduced_bytes, exposed_seconds,
    # sharded_optimizer, shared_parameters, hosts, reduced_on, reduced_on_why, device_reductions,
    # device_reduced_bytes); None otherwise.
    data_parallel: dict | None = None
    # Option release_host_heap: the heap trims after the backwards (runtime/host_heap.HeapStats
    # as a dict: trims, last_released_bytes, last_seconds; the last trim done by the report, which
    # runs in the background); None with the option off or where the C library cannot trim.
    host_heap: dict | None = None
    # Option host_lead_layers, on CUDA: how often the program's thread waited for the GPU to
    # catch up and for how long, over the process so far (runtime/host_lead.HostLead: throttles,
    # throttled_seconds); None where work runs where it is issued (the CPU stand-in).
    host_lead: dict | None = None
    # Where compiling the step's graphs went so far, wall seconds summed over its graphs
    # (capture.records.CompileTimes, plus segments_s: Inductor compiling the programs' segments,
    # which happens as the first step reaches each). Dynamo's own trace comes before the backend
    # and is not in it.
    compile_times: dict | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        measured = (format_bytes(self.measured_peak_device_bytes) if self.measured_peak_device_bytes is not None
                    else "not measured")
        lines = [
            f"megatrain step report ({self.device}, lowering={self.lowering}, policy={self.policy})",
            f"  precision            {self.precision}",
            f"  memory budget        {format_bytes(self.memory_budget) if self.memory_budget else 'none'}",
            f"  planned peak device  {format_bytes(self.planned_peak_device_bytes)}",
            f"  measured peak device {measured}",
            *([f"  reserved peak device {format_bytes(self.measured_reserved_device_bytes)} (the allocator's cache)"]
              if self.measured_reserved_device_bytes is not None else []),
            *([f"  pinned host          {format_bytes(self.pinned_host_bytes)}"
               + (f" (cap {format_bytes(self.pinned_host_cap)})" if self.pinned_host_cap is not None else "")]
              if self.pinned_host_bytes or self.pinned_host_cap is not None else []),
            *([f"  offload arenas       {format_bytes(self.offload_arena_bytes)} (host, reused every step)"]
              if self.offload_arena_bytes else []),
            *([f"  gradient landing     {format_bytes(self.gradient_landing_bytes)} (host, reused every step)"]
              if self.gradient_landing_bytes else []),
            *([f"  host heap released   {format_bytes(self.host_heap['last_released_bytes'])} by the last of "
               f"{self.host_heap['trims']} trims ({self.host_heap['last_seconds'] * 1e3:.1f} ms, in the background)"]
              if self.host_heap else []),
            *([f"  host lead waits      {self.host_lead['throttles']} ({self.host_lead['throttled_seconds']:.3f} s "
               f"so far, the host waiting for the GPU to catch up)"] if self.host_lead else []),
            f"  host -> device       {format_bytes(self.h2d_bytes)}",
            f"  device -> host       {format_bytes(self.d2h_bytes)}",
            f"  recomputed ops       {len(self.recomputed_ops)}",
            f"  host state           {self.host_bytes_per_param:.2f} B/param ("
            + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in self.host_bytes.items())
            + f"); staging peak {format_bytes(self.host_staging_peak_bytes)}",
            f"  graphs               {', '.join(self.graphs + self.host_graphs)}",
        ]
        if self.optimizer is not None:
            o = self.optimizer
            lines.append(
                f"  host optimizer       overlapped with the backward: {o['updated_params']} tensors updated as "
                f"gradients landed, {o['exposed_seconds'] * 1e3:.1f} ms waited at the end" if o["overlapped"]
                else f"  host optimizer       after the backward ({o['reason']})"
            )
        if self.data_parallel is not None:
            d = self.data_parallel
            on_device = (f"{d['device_reductions']} gradients ({format_bytes(d['device_reduced_bytes'])}) averaged "
                         f"on the device, " if d.get("device_reductions") else "")
            lines.append(
                f"  data parallel        rank {d['rank']} of {d['world_size']}: {on_device}{d['buckets']} gradient "
                f"buckets ({format_bytes(d['reduced_bytes'])}) averaged on the host, "
                f"{d['exposed_seconds'] * 1e3:.1f} ms waited at the end"
                + (f" (reduced on the {d['reduced_on']}: {d['reduced_on_why']})" if d.get("reduced_on_why") else "")
                + ("; optimizer state sharded" if d["sharded_optimizer"] else "")
                + (f"; parameters: one copy per host ({d.get('hosts', 1)} host(s)), shared by its ranks"
                   if d["shared_parameters"] else "") if d["synced"]
                else f"  data parallel        rank {d['rank']} of {d['world_size']}: no_sync (gradients kept local)")
        if self.segments is not None and self.lowering == "inductor":
            lines.append(f"  compiled segments    {self.segments['compiled']} distinct, "
                         f"{self.segments['reused']} repeats reused them")
        if self.compile_times:
            c = self.compile_times
            lines.append(f"  compile time         capture {c['capture_s']:.1f} s, planning {c['planning_s']:.1f} s "
                         f"({c['plans_built']} plans built), lowering {c['lowering_s']:.1f} s"
                         + (f", segments {c['segments_s']:.1f} s" if self.lowering == "inductor" else ""))
        header = (f"  {'layer':<28}{'params':>12}{'h2d':>12}{'d2h':>12}{'saved act':>12}{'recomp':>8}"
                  f"{'fwd peak':>12}{'bwd peak':>12}")
        lines.append(header)
        for r in self.layers:
            lines.append(
                f"  {r.layer[:27]:<28}{format_bytes(r.param_bytes):>12}{format_bytes(r.h2d_bytes):>12}"
                f"{format_bytes(r.d2h_bytes):>12}{format_bytes(r.saved_activation_bytes):>12}{r.recomputed_ops:>8}"
                f"{format_bytes(r.planned_forward_peak):>12}{format_bytes(r.planned_backward_peak):>12}"
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


@dataclasses.dataclass(eq=False)
class _Call:
    """One run of a compiled forward whose backward the step still waits for."""

    graph: Any  # capture.records.CompiledGraph
    end_bytes: int  # what its forward leaves on the device for the backward, at its sizes
    outputs: list | None = None  # weak references to what the forward returned
    storages: list | None = None  # weak references to their storages
    node: Any = None  # a weak reference to its backward's autograd node, once seen

    def abandoned(self) -> bool:
        """Whether no backward can come: its autograd node is gone; before that is seen,
        the memory of everything its forward returned is. The node, once an output shows it,
        decides from then on. Memory, not the tensors: the tensor objects returned may die
        while what they hold lives on (a custom autograd Function took them as inputs and keeps
        only an edge to the node; AOTAutograd hands the user a fresh view of an output that is
        a view of an intermediate, and the saved activations are held by the node)."""
        if self.node is not None:
            return self.node() is None
        if not self.outputs:
            return False
        alive = [t for t in (r() for r in self.outputs) if t is not None]
        for t in alive:
            if t.grad_fn is not None:
                try:
                    self.node, self.outputs, self.storages = weakref.ref(t.grad_fn), None, None
                except TypeError:  # a node kind without weak references: keep watching outputs
                    continue
                return False
        return not alive and not any(s() is not None for s in self.storages or ())

    def watch(self, returned: list[torch.Tensor]) -> None:
        """Watches what the forward returned. Storage objects live exactly as long as their
        memory (PyTorch keeps one per storage)."""
        self.outputs = [weakref.ref(t) for t in returned]
        self.storages = [weakref.ref(t.untyped_storage()) for t in returned if t.untyped_storage().nbytes()]


class StepRecorder:
    """Collects one step's plan and measurements across the graphs that make up the step.

    A step starts when a compiled forward starts while no earlier forward waits for its
    backward; a forward that starts while one does joins that step: Dynamo split the step at
    a graph break (the model in one graph, its loss in the next), or one graph runs several
    times before the backward (a Python loop around a graph break: a mixture of experts' code
    per expert; several micro-batches' losses summed). Each call runs on top of what the
    step's earlier calls leave on the device until their backward (``device_bytes_held``), and
    one that would not fit the budget there raises ``BudgetError`` before it runs.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[str, Any] | None = None
        self._pending: tuple | None = None
        self._last: StepReport | None = None
        self._data_parallel: dict | None = None
        self._host_heap: dict | None = None
        self._host_lead: dict | None = None

    @staticmethod
    def _last_call(cur: dict, compiled) -> _Call | None:
        return next((c for c in reversed(cur["awaiting_backward"]) if c.graph is compiled), None)

    def forward_returned(self, compiled, outputs, input_ids: set) -> None:
        """Watches what ``compiled``'s forward returned (its saved activations among them): once
        all of it is gone, no backward can come (the loss was dropped without one). Inputs it
        returns (a batch saved for the backward) live on with the caller: not watched."""
        returned = [t for t in outputs if isinstance(t, torch.Tensor) and id(t) not in input_ids]
        with self._lock:
            call = self._last_call(self._current, compiled) if self._current is not None else None
            if call is not None and returned:
                call.watch(returned)

    @staticmethod
    def _drop_abandoned(cur: dict, collect: bool = False) -> None:
        """Forgets the calls whose outputs are all gone; ``collect``: first frees what only
        reference cycles keep (a failed step's traceback holds its frames' losses), which is
        worth its time where a decision rests on it, not on every call."""
        if collect and cur["awaiting_backward"]:
            gc.collect()
        cur["awaiting_backward"] = [c for c in cur["awaiting_backward"] if not c.abandoned()]

    def forward_started(self, compiled, device, at_sizes: tuple[int, int] | None = None) -> None:
        """``compiled``'s forward starts; ``at_sizes``: its plan's peak and what its forward
        leaves on the device, at this call's sizes (None: as planned)."""
        need = _planned_peak(compiled, at_sizes[0] if at_sizes is not None else None)
        plan = compiled.plan
        end_bytes = (at_sizes[1] if at_sizes is not None
                     else plan.forward.end_bytes if plan is not None and plan.forward is not None else 0)
        with self._lock:
            cur = self._current
            if cur is not None:
                self._drop_abandoned(cur)
            if cur is not None and cur["device"] is device and cur["awaiting_backward"]:
                held = self._held(cur)
                if not _fits_beside(compiled, held, need):
                    self._drop_abandoned(cur, collect=True)
                    held = self._held(cur)
                    if not _fits_beside(compiled, held, need):
                        error = _budget_error(compiled, held, need, cur["awaiting_backward"])
                        cur["awaiting_backward"].clear()  # the step ends here: nothing will backpropagate
                        raise error
                if compiled not in cur["graphs"]:
                    cur["graphs"].append(compiled)
                    cur["held_at_start"].append(held)
                    cur["peaks"].append(held + need)
                    cur["calls"].append(1)
                else:
                    i = cur["graphs"].index(compiled)
                    cur["held_at_start"][i] = max(cur["held_at_start"][i], held)
                    cur["peaks"][i] = max(cur["peaks"][i], held + need)
                    cur["calls"][i] += 1
                if compiled.backward is not None:
                    cur["awaiting_backward"].append(_Call(compiled, end_bytes))
                self._update()
                return
            device.synchronize()
            device.reset_stats()
            device.tracker.reset_peak()
            device.host_staging.reset_peak()
            self._current = {"graphs": [compiled], "held_at_start": [0], "peaks": [need], "calls": [1],
                             "params_read": [],
                             "device": device,
                             "awaiting_backward": [_Call(compiled, end_bytes)] if compiled.backward is not None else [],
                             "host_graphs": [], "optimizer": None, "overlap": None,
                             "data_parallel": None}
            self._update()

    def graph_finished(self, compiled=None, backward: bool = False, failed: bool = False) -> None:
        """``compiled``'s forward or backward returned; ``failed``: it raised, and a forward
        that raised leaves nothing on the device for a backward that will not come."""
        with self._lock:
            cur = self._current
            if cur is not None:
                if failed:  # the step fails with it: no backward of its earlier calls will come
                    cur["awaiting_backward"].clear()
                call = self._last_call(cur, compiled) if backward else None
                if call is not None:
                    cur["awaiting_backward"].remove(call)
                self._update()

    def forward_read(self, compiled, params: list[torch.Tensor]) -> None:
        """The forward call of ``compiled`` that just started reads ``params`` (a graph may run
        with other tensors than it was compiled with: the same code for each layer)."""
        with self._lock:
            if self._current is not None:
                self._current["params_read"].append((compiled, {id(p) for p in params}))

    def gradient_parts(self, compiled) -> tuple[int, set[int]]:
        """For the backward of ``compiled`` that is starting: how many times its forward ran in
        the running step, and the ids of the parameters the step's calls of other graphs read.
        Autograd sums the parts a parameter's gradient gets from several backward calls before it
        accumulates them, so no one call holds such a gradient whole; and a graph run more than
        once cannot tell which call's parameters this backward's gradients are for."""
        with self._lock:
            cur = self._current
            if cur is None or compiled not in cur["graphs"]:
                return 1, set()
            calls = cur["calls"][cur["graphs"].index(compiled)]
            return calls, {i for g, ids in cur["params_read"] if g is not compiled for i in ids}

    @staticmethod
    def _held(cur: dict) -> int:
        return sum(c.end_bytes for c in cur["awaiting_backward"])

    def device_bytes_held(self, device) -> tuple[int, list[str]]:
        """What the graphs of the running step that still wait for their backward leave on
        ``device`` (their saved activations), and their labels: a graph planned now, within
        that step, runs on top of it."""
        with self._lock:
            cur = self._current
            if cur is not None:
                self._drop_abandoned(cur, collect=True)  # (planning is rare and slow anyway)
            if cur is None or cur["device"] is not device or not cur["awaiting_backward"]:
                return 0, []
            return self._held(cur), _holders(cur["awaiting_backward"])

    def optimizer_seen(self, optimizer) -> None:
        """The optimizer this step's parameters belong to (its state counts as host memory)."""
        with self._lock:
            if self._current is not None and optimizer is not None and self._current["optimizer"] is None:
                self._current["optimizer"] = optimizer
                self._update()

    def overlap_decided(self, stats) -> None:
        """How this step's host optimizer runs (``optimizer.overlap.OverlapStats``); taken
        into the report when the backward finishes."""
        with self._lock:
            if self._current is not None:
                self._current["overlap"] = stats

    def data_parallel_decided(self, stats) -> None:
        """What this step's backward reduces across ranks (``runtime.data_parallel.DataParallelStats``,
        None: nothing yet); taken into the report when the backward finishes."""
        with self._lock:
            if self._current is not None:
                self._current["data_parallel"] = stats

    def host_heap_seen(self, stats: dict | None) -> None:
        """The host heap's trims so far (``runtime.host_heap.HeapStats`` as a dict), as the
        backward finishes; None where the step does not trim."""
        with self._lock:
            if self._current is not None:
                self._current["host_heap"] = stats

    def host_graph_ran(self, label: str, optimizer=None) -> None:
        self.optimizer_seen(optimizer)
        with self._lock:
            if self._current is not None and label not in self._current["host_graphs"]:
                self._current["host_graphs"].append(label)
                self._update()

    def _update(self) -> None:
        # Only the numbers are taken here; the report (a walk over the step's graphs) is
        # built when someone asks for it, not once per graph of every step.
        cur = self._current
        graphs, device = cur["graphs"], cur["device"]
        device.synchronize()
        measured = device.tracker.peak_since_reset() if all(g.measures_peak for g in graphs) else None
        reserved = device.tracker.reserved_peak()
        landing = device.landing.nbytes if device.landing is not None else 0
        stats = copy.copy(device.stats)  # the counters as of now (later glue graphs add to them)
        stats.h2d_by_layer, stats.d2h_by_layer = dict(stats.h2d_by_layer), dict(stats.d2h_by_layer)
        overlapped = dataclasses.asdict(cur["overlap"]) if cur["overlap"] is not None else None
        self._pending = dict(graphs=list(graphs), held_at_start=list(cur["held_at_start"]), calls=list(cur["calls"]),
                             peaks=list(cur["peaks"]), stats=stats,
                             measured=measured, reserved=reserved, host_graphs=list(cur["host_graphs"]),
                             optimizer=cur["optimizer"],
                             staging_peak=device.host_staging.peak_since_reset(), overlap=overlapped,
                             pinned=(device.pinned.pinned, device.pinned.cap),
                             offload_arena_bytes=device.host_buffer_bytes - landing,
                             gradient_landing_bytes=landing)
        reduced = cur.get("data_parallel")
        self._data_parallel = dataclasses.asdict(reduced) if reduced is not None else None
        self._host_heap = cur.get("host_heap")
        lead = getattr(device, "lead", None)
        self._host_lead = ({"throttles": lead.throttles, "throttled_seconds": lead.throttled_ns / 1e9}
                           if lead is not None else None)
        self._last = None

    def last(self) -> StepReport | None:
        with self._lock:
            if self._last is None and self._pending is not None:
                pending = dict(self._pending)
                graphs = pending.pop("graphs")
                self._last = graphs[0].make_step_report(graphs, **pending)
                self._last.data_parallel = self._data_parallel
                self._last.host_heap = self._host_heap
                self._last.host_lead = self._host_lead
            return self._last


def _holders(calls: list[_Call]) -> list[str]:
    """The labels of the graphs ``calls`` ran, each once, with how many of its calls wait."""
    counts: dict[str, int] = {}
    for c in calls:
        counts[c.graph.label] = counts.get(c.graph.label, 0) + 1
    return [label if n == 1 else f"{label} ({n} calls)" for label, n in counts.items()]


def _planned_peak(compiled, peak_bytes: int | None) -> int:
    """``compiled``'s planned peak at this call's sizes (``peak_bytes``; None: as planned)."""
    if peak_bytes is not None:
        return peak_bytes
    return compiled.plan.call_peak_bytes if compiled.plan is not None else 0


def _fits_beside(compiled, held: int, need: int) -> bool:
    """Whether ``compiled``'s plan, needing ``need`` at this call, fits the budget on top of
    ``held``: what the plan was made to fit (at least the budget: a plan may round up to it),
    its own further calls (calls_before_backward) included."""
    budget, plan = compiled.options.memory_budget, compiled.plan
    return budget is None or plan is None or held + need <= max(budget, compiled.planned_on_top_of + plan.peak_bytes)


def _budget_error(compiled, held: int, need: int, awaiting: list[_Call]) -> BudgetError:
    """Why ``compiled`` does not fit beside what the step's earlier calls hold (its plan assumed
    less beside it: it runs again before its backward, or an earlier forward is alive without
    one), and what to change."""
    budget, plan = compiled.options.memory_budget, compiled.plan
    again = sum(c.graph is compiled for c in awaiting)
    if again:
        why = (f"{compiled.label} runs again (call {again + 1} of this step) before the backward of its earlier "
               f"calls. Micro-batches: call backward() on each loss before the next forward (the gradients "
               f"accumulate the same). A Python loop around a graph break, such as a mixture of experts' code per "
               f"expert after a data-dependent op (nonzero, where): remove the break (torch._dynamo.config."
               f"capture_dynamic_output_shape_ops = True captures such ops in the graph, and the planner then sees "
               f"the whole loop). Or plan each graph for its calls: options calls_before_backward="
               f"{max(again + 1, compiled.options.calls_before_backward + 1)} or more (as many as run before the "
               f"backward)")
    else:
        why = (f"an earlier forward of {', '.join(_holders(awaiting))} is still alive without its backward. Call "
               f"backward() first, run forwards that need none under torch.no_grad(), or drop their outputs "
               f"(del loss)")
    return BudgetError(
        f"megatrain: {compiled.label} needs {format_bytes(need)} ({need} bytes) of device memory on top of "
        f"{format_bytes(held)} that {', '.join(_holders(awaiting))} of the same step hold until their backward: "
        f"over memory_budget={format_bytes(budget)}. Nothing of this call has run and no parameter has changed. "
        f"Here {why}, or raise memory_budget to at least {held + need} (more if further calls follow).",
        minimum_budget=held + need, limiting_layer=str(plan.limiting_layer))


RECORDER = StepRecorder()


def last_report() -> StepReport | None:
    """What the last step planned and did (None before any megatrain step ran)."""
    return RECORDER.last()
