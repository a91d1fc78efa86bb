"""Compiles one captured training graph: partition, passes, plan, budget check, lowering.

AOTAutograd traces the Dynamo graph into a joint forward+backward aten graph and calls our
``partition`` with it. There, for each recompute policy the options allow (cheapest first),
the joint graph is annotated and marked, split into forward and backward, both are rewritten
by the passes, and the memory estimate is compared with the budget; the first plan that fits
wins. A budget no plan meets raises ``BudgetError`` here, before anything has run.
AOTAutograd then hands the rewritten graphs to ``compile_forward`` / ``compile_backward``,
which lower them to ``StreamingProgram``s.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import warnings
import weakref
from typing import Any

import sympy
import torch
import torch.fx as fx

from megacompile.capture import inline_regions, records, retained_graph
from megacompile.capture.records import CompiledGraph
from megacompile.capture.repeat_chain import find_repeat_chain, truncated_joint
from megacompile.core import kernel_dtypes, token_chunks
from megacompile.core import torch_compat as compat
from megacompile.core.collector import cycle_collector_paused
from megacompile.core.errors import BudgetError, DataParallelError, UnsupportedGraph
from megacompile.core.node_info import info, layer_of_module_path, normalize_module_path
from megacompile.core.units import format_bytes
from megacompile.optimizer import overlap
from megacompile.optimizer.eager_update_watch import EagerUpdateWatch
from megacompile.optimizer.host_step import has_host_step, kernel_available
from megacompile.optimizer.overlap import ParamInputs
from megacompile.optimizer.ownership import fused_kernel_runs, optimizer_of
from megacompile.options import Options
from megacompile.passes import PassContext, chunk_tokens, facts_after, run_passes
from megacompile.passes.recompute import num_forward_outputs
from megacompile.passes.resident_parameters import used_in_both_phases
from megacompile.plan import flat_planner, template_planner
from megacompile.plan.cost_model import optimizer_param_bytes, remember_flops, step_time
from megacompile.plan.flat_planner import Attempt, PlanMaker
from megacompile.plan.gradient_reduction import choose_reduction
from megacompile.plan.hardware import get_profile
from megacompile.plan.memory_estimate import (
    allocation_granularity,
    estimate_memory,
    estimate_program_pair,
    storage_root_bytes,
    storage_roots,
)
from megacompile.plan.template_planner import DEPTHS, MIN_LAYERS, Template
from megacompile.plan.training_plan import PlanSpec, TrainingPlan
from megacompile.report import RECORDER
from megacompile.runtime import host_heap
from megacompile.runtime.data_parallel import DataParallelStats, GradientReducer, ReducingSink, group_of
from megacompile.runtime.executor import StreamingProgram
from megacompile.runtime.segment_cache import SegmentCache

_graph_counter = itertools.count()
# TORCH_LOGS="megatrain": each compile phase with its time, and the plan chosen (docs/guide.md, "Logs").
log = logging.getLogger(__name__)


def _log_plan(record: CompiledGraph, options: Options, seconds: float) -> None:
    """The plan decision in two INFO lines: what was chosen and its numbers, then why."""
    plan = record.plan
    budget = plan.budget if plan.budget is not None else options.memory_budget
    limit = f"under budget {format_bytes(budget)}" if budget is not None else "with no budget (the whole device)"
    parts = [f"{part} {format_bytes(e.peak_bytes)}" for part, e in (("forward", plan.forward),
                                                                     ("backward", plan.backward)) if e is not None]
    if plan.limiting_layer:
        parts.append(f"peak in layer {plan.limiting_layer}")
    if plan.template:
        parts.append(f"extrapolated from short copies: {format_bytes(plan.template['extrapolated_peak'])}")
    predicted = f", predicted {plan.predicted_seconds * 1e3:.3f} ms/step" if plan.predicted_seconds else ""
    log.info("%s: plan %r: planned peak %s %s (%s)%s; planned in %.1f s", record.label, plan.policy,
             format_bytes(plan.peak_bytes), limit, "; ".join(parts), predicted, seconds)
    default = "no backward: nothing to keep for it" if plan.policy == "inference" else "keeping every activation fits"
    log.info("%s: why: %s", record.label, plan.reason or default)


class TrainingCompiler:
    """The AOTAutograd callbacks for one Dynamo graph."""

    def __init__(self, options: Options, device, input_names: list[str], input_roles: list[str],
                 example_inputs: list, lowering_fn) -> None:
        self.options = options
        self.device = device
        self.input_names = input_names
        self.input_roles = input_roles
        self.lower = lowering_fn
        # Set by ``partition``: the forward returns the backward's saved values after these.
        self.num_fwd_outputs: int | None = None
        self.record = CompiledGraph(label=f"graph{next(_graph_counter)}", options=options)
        # The passes' snapshots of Dynamo's graph (stage "dynamo"), shown before the plan's.
        self.captured_snapshots: list = []
        # Autocast the backend added after Dynamo's trace (see PassContext.autocast_added).
        self.autocast_added = False
        self.started = time.perf_counter()

        # The forward records the parameter tensors it ran with; the backward's gradient i
        # belongs to forward input i.
        self.param_inputs = ParamInputs([i for i, role in enumerate(input_roles) if role == "param"])

        self.eager_watch = EagerUpdateWatch()
        self._sharded_optimizer_checked = False
        for index, (name, role, value) in enumerate(zip(input_names, input_roles, example_inputs)):
            if role == "param" and isinstance(value, torch.Tensor):
                self.record.param_refs[index] = weakref.ref(value)

                layer = layer_of_module_path(name.rsplit(".", 1)[0]) if "." in name else None
                key = layer or "(glue)"
                self.record.param_bytes_by_layer[key] = (
                    self.record.param_bytes_by_layer.get(key, 0) + value.numel() * value.element_size()
                )

    def _ctx(self, stage: str, plan: TrainingPlan, num_user_outputs: int = 0) -> PassContext:
        return PassContext(self.options, stage, plan, self.input_names, self.input_roles, num_user_outputs,
                           autocast_added=self.autocast_added)

    # --- building plans on a joint graph ------------------------------------------------
    def _builder(self, joint: fx.GraphModule, num_fwd_outputs: int):
        """``build(plan)`` for one joint graph: partition it under the plan, run the passes on
        both halves, estimate their memory."""
        def build(plan: TrainingPlan, snapshots: bool = False):
            self.record.compile_times.plans_built += 1
            snapshots = snapshots and self.options.keeps_snapshots
            # Candidates are built without the inspect snapshots (formatting every graph after
            # every pass was a third of the planning time); where snapshots are kept (option
            # snapshots: under `megacompile inspect`), the chosen plan is built again with them.
            jctx = self._ctx("joint", plan)
            run_passes(joint, jctx, keep_snapshots=snapshots)
            by_name = {n.name: n for n in joint.graph.nodes}
            fw, bw = compat.extract_forward_backward(
                joint, [by_name[n] for n in plan.saved_values], [by_name[n] for n in plan.saved_sym_nodes],
                num_fwd_outputs,
            )
            fctx = self._ctx("forward", plan, num_user_outputs=num_fwd_outputs)
            run_passes(fw, fctx, keep_snapshots=snapshots)
            bctx = self._ctx("backward", plan)
            run_passes(bw, bctx, keep_snapshots=snapshots)
            plan.forward, plan.backward = estimate_program_pair(
                fw, bw, self.options.lowering, allocation_granularity(self.options.device),
                inputs_held=self.options.retain_graph)
            return Attempt(plan, fw, bw, jctx.snapshots + fctx.snapshots + bctx.snapshots)

        return build

    def _prepare(self, joint: fx.GraphModule) -> tuple[list[str], list[str]]:
        """Annotates an (inlined) joint graph once; returns its layers in forward order and the
        parameters both passes read (the residency candidates)."""
        run_passes(joint, self._ctx("joint", TrainingPlan()), keep_snapshots=False)
        remember_flops(joint)  # every candidate's graphs copy these nodes: count their FLOPs once
        layers: list[str] = []
        for node in joint.graph.nodes:
            layer = info(node).layer if node.op == "call_function" and compat.is_forward_tagged(node) else None
            if layer and layer not in layers:
                layers.append(layer)
        return layers, [info(n).source for n in used_in_both_phases(joint)]

    def _templates(self, joint: fx.GraphModule, num_fwd_outputs: int, make_maker) -> tuple[list, list[list[str]]]:
        """Short copies of the (not yet inlined) joint graph to plan its repeated layers on
        (``template_planner``), and the module paths of the full graph's repeated layers (their
        calls' sites, in forward order, grouped by the chain's units); ([], []) where the
        option, the budget or the graph's structure rules them out."""
        mode = self.options.plan_repeats
        if mode == "flat" or self.options.memory_budget is None or self.options.recompute == "always":
            return [], []
        chain = find_repeat_chain(joint)
        if chain is None or len(chain) < MIN_LAYERS[mode]:
            return [], []
        units = [[layer_of_module_path(normalize_module_path(inline_regions.call_site_path(call) or ""))
                  for call in unit] for unit in chain.units()]
        templates = []
        for k in DEPTHS:
            short = truncated_joint(joint, chain, k)
            if short is None:
                return [], []
            inline_regions.inline_partitioned_regions(short)
            self._prepare(short)
            templates.append(Template(k, make_maker(self._builder(short, num_fwd_outputs), short), short,
                                      units[:k - 1] + units[-1:]))
        return templates, units

    def _params_read_by(self, joint: fx.GraphModule) -> int:
        """How many parameter elements ``joint`` reads (its placeholders follow the inputs)."""
        placeholders = list(joint.graph.find_nodes(op="placeholder"))
        return sum(node.meta["val"].numel() for node, role in zip(placeholders, self.input_roles)
                   if role == "param" and node.users and isinstance(node.meta.get("val"), torch.Tensor))

    # --- AOTAutograd callbacks ----------------------------------------------------------
    def partition(self, joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **_unused):
        self.num_fwd_outputs = num_fwd_outputs
        if isinstance(joint_inputs, (list, tuple)) and len(joint_inputs) == 0:
            # AOTAutograd partitions a nested_compile_region body's own joint graph (once per
            # distinct body, with no inputs) before the step's: save everything its backward
            # reads. The step's plan decides keep / offload / recompute on the inlined copies.
            return compat.save_everything_partition(joint, num_fwd_outputs)
        self._size_as_kernels(joint)
        held, holders = RECORDER.device_bytes_held(self.device)
        self.record.planned_on_top_of = held
        if held and self.options.memory_budget is not None:
            return self._partition_on_top_of(held, holders, joint, joint_inputs, num_fwd_outputs)
        return self._partition(joint, joint_inputs, num_fwd_outputs)

    def _size_as_kernels(self, gm: fx.GraphModule) -> None:
        """Values sized as the kernels that run the program return them (``core/kernel_dtypes.py``),
        not as the host trace's fake tensors say; not where Inductor compiles the CPU
        decomposition the fakes come from (the stand-in under the Inductor lowering)."""
        if not (self.options.torch_device.type == "cpu" and self.options.lowering == "inductor"):
            kernel_dtypes.size_as_kernels(gm)

    def _partition_on_top_of(self, held: int, holders: list[str], joint, joint_inputs, num_fwd_outputs: int):
        """A later graph of a step Dynamo split at a graph break runs while the earlier graphs'
        saved activations wait on the device for their backward: it is planned within what
        the budget leaves beside them."""
        budget = self.options.memory_budget
        what = (f"{format_bytes(held)} that {', '.join(holders)} of the same step hold on the device until "
                f"their backward")
        if held >= budget:
            raise BudgetError(
                f"megatrain: memory_budget={format_bytes(budget)} leaves nothing for {self.record.label}: {what}. "
                f"Raise memory_budget above {held}, or avoid the graph break between them.",
                minimum_budget=held + 1, limiting_layer=holders[0])
        self.options = dataclasses.replace(self.options, memory_budget=budget - held)
        try:
            return self._partition(joint, joint_inputs, num_fwd_outputs)
        except BudgetError as e:
            minimum = None if e.minimum_budget is None else e.minimum_budget + held
            raise BudgetError(
                f"megatrain: {self.record.label} is planned within memory_budget={format_bytes(budget)} less "
                f"{what}: {e}" + (f" For the whole step: at least {minimum}." if minimum else ""),
                minimum_budget=minimum, limiting_layer=e.limiting_layer,
                streaming_floor=e.streaming_floor) from None

    def _partition(self, joint: fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int):
        started = time.perf_counter()
        log.info("%s: captured the joint forward+backward graph (%d nodes) in %.1f s; planning",
                 self.record.label, len(joint.graph.nodes), started - self.started)
        profile = get_profile(self.options.hardware_profile())
        def pricer(num_params: int):
            param_bytes = optimizer_param_bytes(num_params, self.options.precision)

            def predict_seconds(attempt) -> float:
                return step_time(attempt.forward, attempt.backward, profile, optimizer_param_bytes=param_bytes,
                                 precision=self.options.precision,
                                 overlap_optimizer=self.options.overlaps_optimizer,
                                 fused_pointwise=None if self.options.lowering == "inductor" else False).total_s
            return predict_seconds

        predict_seconds = pricer(self.record.num_params)

        def make_maker(build, short_copy: fx.GraphModule | None = None) -> PlanMaker:
            # A short copy of the step is priced with the host optimizer updating its own
            # parameters: priced with the whole model's, the update outlasted the copy's device
            # work, which hid what each layer adds (Llama-2-7B, bf16: 24 ms a layer where the
            # full graph's take 86).
            return PlanMaker(build, self.options, profile,
                             predict_seconds if short_copy is None else pricer(self._params_read_by(short_copy)))

        # Before inlining: the repeated layers are still one call each, which is what the
        # short copies are cut from.
        chunked = [n for n in joint.graph.nodes if n.op == "call_function" and n.target in token_chunks.OPS]
        choosing = bool(chunked) and self.options.token_chunks == chunk_tokens.PLANNER_CHOOSES
        try:
            templates, repeated = ([], []) if choosing else self._templates(joint, num_fwd_outputs, make_maker)
        except Exception as e:  # noqa: BLE001  (an optimization: the flat planner plans what it cannot)
            templates, repeated = [], []
            _template_failed(e)
        inline_regions.inline_partitioned_regions(joint)
        if num_forward_outputs(joint) != num_fwd_outputs:  # the recompute pass counts them from the graph
            raise UnsupportedGraph(f"the joint graph has {num_forward_outputs(joint)} forward outputs by its primals, "
                                   f"AOTAutograd says {num_fwd_outputs}")
        build = self._builder(joint, num_fwd_outputs)
        layers, both_phases = self._prepare(joint)
        chosen = None
        if templates:
            try:
                # The repeated layers by the names the inlined graph's layers have (per-layer mixes).
                in_units = {layer for unit in repeated for layer in unit}
                named = [layer for layer in layers if layer in in_units]
                period = len(repeated[0])
                units = ([named[i:i + period] for i in range(0, len(named), period)]
                         if len(named) == len(in_units) == period * len(repeated) else None)
                chosen = template_planner.plan_with_templates(make_maker(build), joint, templates, len(repeated),
                                                              self.options, profile, units)
            except Exception as e:  # noqa: BLE001
                _template_failed(e)
        if chosen is None and choosing:
            chosen = self._plan_chunk_count(
                chunked,
                lambda: flat_planner.plan_training(build, layers, self.options, profile, predict_seconds, both_phases,
                                                   joint=joint),
                lambda: flat_planner.some_plan_fits(build, self.options, profile, predict_seconds))
        if chosen is None:
            chosen = flat_planner.plan_training(build, layers, self.options, profile, predict_seconds, both_phases,
                                                joint=joint)
        chosen = self._with_merged_compute_runs(make_maker(build), chosen)
        if self.options.keeps_snapshots and not chosen.snapshots:  # built as a candidate: again, with them
            priced = chosen.peak
            chosen = build(chosen.plan, snapshots=True)
            if chosen.peak != priced:  # building is a pure function of the plan; the budget check relies on it
                raise RuntimeError(
                    f"megatrain internal error: plan '{chosen.plan.policy}' built again peaks at {chosen.peak} "
                    f"bytes, not the {priced} it was chosen at; please report this with the model")
        self.record.plan, self.record.forward, self.record.backward = chosen.plan, chosen.forward, chosen.backward
        self.record.snapshots = self.captured_snapshots + chosen.snapshots
        self._planned(started)
        return chosen.forward, chosen.backward

    def _planned(self, planning_started: float) -> None:
        """The record of the chosen plan kept, its compile times noted and logged."""
        records.add(self.record)
        self.record.compile_times.capture_s = planning_started - self.started
        self.record.compile_times.planning_s = time.perf_counter() - planning_started
        _log_plan(self.record, self.options, self.record.compile_times.planning_s)

    def _with_merged_compute_runs(self, maker: PlanMaker, chosen: Attempt) -> Attempt:
        """The chosen plan with each layer's memory ops gathered at the ends of its compute
        (passes/merge_compute_runs.py), where that fits the budget and the programs copy: one
        compiled segment per run instead of the ops between a weight's wait and its evict
        running one by one. Frees move later, so the peak usually grows (under the Inductor
        lowering's rule that a segment's inputs live to its end, other segment bounds can also
        lower it); the host thread, which this relieves, is not in the cost model's time."""
        if not (merged_runs_pay_off(self.options, self.record, self.device)
                and "compute_runs_merged" in facts_after("backward", self.options.disable_passes)):
            return chosen
        spec = chosen.plan.spec
        merged = maker.make(spec.replace(name=f"{spec.name}, merged runs", merged_compute_runs=True))
        if not maker.fits(merged):
            chosen.plan.reason += (f"; memory ops left between the compute ops: gathered at each layer's run "
                                   f"ends the plan peaks at {format_bytes(merged.peak)}, over the budget")
            return chosen
        merged.plan.predicted_seconds = maker.predict_seconds(merged)
        merged.plan.reason = (chosen.plan.reason + "; each layer's loads and waits before its compute, its "
                              "offloads and evicts after it (one compiled run, peak "
                              f"{format_bytes(chosen.peak)} -> {format_bytes(merged.peak)})")
        merged.plan.layer_costs, merged.plan.template = chosen.plan.layer_costs, chosen.plan.template
        return merged

    @staticmethod
    def _plan_chunk_count(chunked: list[fx.Node], plan, surely_fits):
        """The plan at the fewest chunks (powers of two) whose plan fits the budget: a slice's
        working set shrinks with the count while the FLOPs stay (every count replays the run
        once), and each chunk adds its ops' launches, so fewer is faster. Counts are tried with
        ``surely_fits`` (a few builds) before ``plan`` (the whole ladder, dozens): the step is
        planned in full once, at the count chosen, where the probes decide."""
        tokens = max(token_chunks.call_tokens(n) for n in chunked)
        counts = [1 << i for i in range(1, tokens.bit_length()) if (1 << i) <= tokens] or [1]
        planned = {}  # count -> the full plan, where a probe was not sure

        def use(count: int) -> None:
            for node in chunked:
                token_chunks.set_chunks(node, count)

        def fits_at(count: int) -> bool:
            use(count)
            if surely_fits():
                return True
            try:
                planned[count] = plan()
            except BudgetError:
                if count == counts[-1]:
                    raise  # the most chunks: if this does not fit, nothing does
                return False
            return True

        fits_at(counts[-1])
        lo, hi = 0, len(counts) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if fits_at(counts[mid]):
                hi = mid
            else:
                lo = mid + 1
        count = counts[lo]
        use(count)
        chosen = planned[count] if count in planned else plan()
        chosen.plan.reason = (chosen.plan.reason or "") + (
            f"; per-token runs in {count} token chunk(s), the fewest that fit")
        return chosen

    # AOTAutograd compiles the backward lazily, inside ``loss.backward()`` within the user's
    # compiled frame; without ``disable`` Dynamo would trace our lowering code itself.
    @torch.compiler.disable
    def compile_forward(self, gm: fx.GraphModule, example_inputs) -> Any:
        program = self.lower(self._same_or_ours(gm, self.record.forward), start_step=True, record=self.record,
                             part="forward", saved_from=self.num_fwd_outputs)

        def observe(args: list) -> None:
            self.param_inputs.observe(args)
            params = self.param_inputs.tensors()
            RECORDER.forward_read(self.record, list(params.values()))
            self.eager_watch.forward_starting(params)

        program.observe_inputs = observe
        return program

    @torch.compiler.disable
    def compile_backward(self, gm: fx.GraphModule, example_inputs) -> Any:
        # Called on the first loss.backward(), outside the backend's pause (collector.py).
        with cycle_collector_paused():
            program = self.lower(self._same_or_ours(gm, self.record.backward), start_step=False, record=self.record,
                                 part="backward")
        program.make_sink = self._make_lander
        program.lands_gradients = True
        program.observe_inputs = retained_graph.retained_graph_check(self.record)
        finished = program.on_finish

        def on_finish(failed: bool) -> None:
            self.eager_watch.backward_finished(self.param_inputs.tensors())
            trims = not failed and self.options.release_host_heap and host_heap.available()
            if trims:
                host_heap.release_soon()  # the step's freed host pages, off this thread
            RECORDER.host_heap_seen(dataclasses.asdict(host_heap.stats()) if trims else None)
            if finished is not None:
                finished(failed)

        program.on_finish = on_finish
        return program

    def _make_lander(self):
        """Per backward call, the sink for its gradients: the overlapped optimizer's lander
        if the step can overlap it; else, for a data-parallel model, the sink that averages
        gradients across ranks; else None (the program returns every gradient)."""
        params = self.param_inputs.tensors()
        group = group_of(params.values())
        # One rank has nothing to average: its backward is the plain one (no copies, no waits).
        syncing = group is not None and group.sync and group.world_size > 1
        if group is not None and group.shards_optimizer and not self._sharded_optimizer_checked:
            self._sharded_optimizer_checked = _check_sharded_optimizer(params)
        if group is not None:
            RECORDER.data_parallel_decided(None if syncing else DataParallelStats(
                group.world_size, group.rank, synced=group.sync, sharded_optimizer=group.shards_optimizer,
                shared_parameters=group.shared_parameters, hosts=group.nodes))
            if not group.sync:
                group.local_accumulation = True  # this backward's gradients stay on this rank
        reducer = None
        if syncing:
            # On the device (before the copies) or on the host (after them): the cost model's
            # choice, or the user's (megacompile.data_parallel(reduce_gradients_on=...)).
            on_device, why = reduction_for(group, self.device.kind, sum(p.numel() * p.element_size()
                                                                         for p in params.values()))
            reducer = GradientReducer(group, on_device, why)

        def without_overlap(why: str):
            RECORDER.overlap_decided(overlap.OverlapStats(False, why))
            if not syncing:
                return None
            sink = ReducingSink(params, group, reducer)
            RECORDER.data_parallel_decided(sink.stats)
            return sink

        if not self.options.overlaps_optimizer:
            return without_overlap("overlap_optimizer=False" if self.options.overlap_optimizer is False
                                   else "overlap_optimizer='auto' is off on the CPU stand-in (its device lane "
                                        "computes on the host cores the updates would use)")
        if group is not None and not group.sync:
            return without_overlap("inside megacompile.no_sync(): gradients accumulate locally")
        # A graph run more than once before its backward (micro-batches summed, a graph break in
        # per-layer or per-expert code) gets each parameter's gradient in parts, and ``param_inputs``
        # holds only its last call's parameters: it does not overlap. A parameter another graph's
        # call read too (a weight on both sides of a graph break) gets its gradient in parts: it is
        # left to autograd and step(), after the backward (autograd sums the parts before it
        # accumulates them).
        calls, others = RECORDER.gradient_parts(self.record)
        if calls > 1:
            return without_overlap(f"this graph ran {calls} times before its backward: its parameters' gradients "
                                   "come in parts, summed by autograd for step()")
        shared = [pos for pos, p in params.items() if id(p) in others or overlap.gets_gradient_from_outside(p)]
        if shared and syncing:
            return without_overlap(f"{len(shared)} parameter(s) of this graph are read by another graph of the step "
                                   "(data parallel: their gradients are averaged after it)")
        params = {pos: p for pos, p in params.items() if pos not in shared}
        if shared and not params:
            return without_overlap("every parameter of this graph is read by another graph of the step: their "
                                   "gradients come in parts, summed by autograd for step()")
        opt, reason = overlap.step_follows_backward(params)
        if syncing and group.shards_optimizer:
            # Overlapped or not, the ranks share updated parameters differently (per layer from
            # the lander, per owner after step()): they must all take the same path.
            if not group.agree(opt is not None, "the ranks' agreement on overlapping the optimizer") and opt:
                opt, reason = None, "another rank cannot overlap the optimizer with this backward"
        if opt is None:
            return without_overlap(reason)
        created = overlap.create_missing_state(opt, params)  # a first step overlaps too
        lander = overlap.GradientLander(opt, params, self.device, reason, reducer=reducer, created_state=created)
        lander.stats.left_to_step = len(shared)
        RECORDER.overlap_decided(lander.stats)
        if reducer is not None:
            RECORDER.data_parallel_decided(reducer.stats)
        RECORDER.optimizer_seen(opt)
        return lander

    @torch.compiler.disable
    def compile_inference(self, gm: fx.GraphModule, example_inputs) -> Any:
        started = time.perf_counter()
        inline_regions.inline_nested_regions(gm)  # marked layers' calls, as traced (nothing partitioned)
        self._size_as_kernels(gm)
        plan = TrainingPlan(PlanSpec(name="inference", budget=self.options.memory_budget))
        ctx = self._ctx("inference", plan)
        run_passes(gm, ctx, keep_snapshots=self.options.keeps_snapshots)
        plan.forward = estimate_memory(gm, keep_outputs_alive=False, lowering=self.options.lowering,
                                       granularity=allocation_granularity(self.options.device))
        budget = self.options.memory_budget
        if budget is not None and plan.peak_bytes > budget:
            raise BudgetError(
                f"megatrain: memory_budget={format_bytes(budget)} is too small for this graph: it needs "
                f"{format_bytes(plan.peak_bytes)} ({plan.peak_bytes} bytes), set by layer "
                f"'{plan.limiting_layer}'. Raise memory_budget to at least {plan.peak_bytes}.",
                minimum_budget=plan.peak_bytes, limiting_layer=str(plan.limiting_layer),
            )
        self.record.plan, self.record.forward, self.record.snapshots = plan, gm, ctx.snapshots
        self.record.label += " (no backward)"
        self._planned(started)
        # Glue without parameters (``loss.detach()``) belongs to the step around it.
        starts_step = "param" in self.input_roles
        return self.lower(gm, start_step=starts_step, record=self.record, part="forward")

    @staticmethod
    def _same_or_ours(given: fx.GraphModule, ours: fx.GraphModule | None) -> fx.GraphModule:
        # AOTAutograd hands back the module the partitioner returned; if a PyTorch version
        # copies it, the copy has the same nodes and meta.
        return given if ours is None else given


def reduction_for(group, device_kind: str, grad_bytes: int) -> tuple[bool, str]:
    """(whether this backward averages gradients on the device, why): the user's choice
    (``data_parallel(reduce_gradients_on=...)``), or under "auto" the faster path for a
    program on a ``device_kind`` device whose parameters have ``grad_bytes`` of gradients."""
    if group.local_accumulation:
        return False, "gradients accumulated under no_sync() are averaged with this backward's, on the host"
    if group.reduce_on != "auto":
        return group.reduce_on == "device", f"reduce_gradients_on='{group.reduce_on}'"
    collectives = "nccl" if device_kind == "cuda" and group.device_backend == "nccl" else None
    choice = choose_reduction(grad_bytes, grad_bytes, group.world_size, group.nodes, device_collectives=collectives)
    return choice.on == "device", choice.why


def _check_sharded_optimizer(params: dict[int, torch.Tensor]) -> bool:
    """A sharded optimizer is the fused host Adam / AdamW step, which updates only this rank's
    shard; any other optimizer would update every parameter on every rank. True once the
    optimizer was found and is one (none yet, or two: asked again at the next backward)."""
    opt = optimizer_of({id(p): p for p in params.values()})
    if opt is None:
        return False
    if not (has_host_step(opt) or (fused_kernel_runs(opt) and kernel_available())):
        raise DataParallelError(
            f"megacompile.data_parallel(shard_optimizer=True) needs a stock torch.optim.Adam or AdamW over "
            f"fp32 parameters (run by megatrain's fused host kernel), not {type(opt).__name__}: use one, or "
            f"shard_optimizer=False")
    return True


def _template_failed(error: Exception) -> None:
    """Planning on short copies of the step is a shortcut: where it fails, say so and plan
    the full graph as if it had not been tried."""
    warnings.warn(f"megatrain: planning the repeated layers on short copies of the step failed "
                  f"({type(error).__name__}: {error}); planning the full graph instead (plan_repeats='flat' "
                  f"skips the attempt)", stacklevel=3)


def size_check(record: CompiledGraph, budget: int | None):
    """A check, run before a program starts, that the plan fits at the call's actual sizes;
    it returns the plan's peak there and what the forward leaves on the device for the
    backward (what the step's later calls run beside).

    The plan is made at the traced example's sizes; with dynamic shapes a later call may be
    larger. The byte counts are kept as sympy expressions of the size symbols
    (``NodeInfo.nbytes``), so the peak of both rewritten graphs is re-estimated at each new set
    of sizes (once per set) and a ``BudgetError`` is raised before anything runs if it exceeds
    the budget (beside what the step's earlier graphs hold: ``StepRecorder.forward_started``).
    None where there is nothing to check (no budget, static shapes).
    """
    if budget is None or record.forward is None:
        return None
    bindings: list[tuple[int, int | None, Any, Any]] = []  # input, dim (None: a SymInt input), symbol, SymInt
    placeholders = [n for n in record.forward.graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        val = node.meta.get("val")
        dims = list(enumerate(val.shape)) if isinstance(val, torch.Tensor) else [(None, val)]
        for dim, size in dims:
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                bindings.append((index, dim, size.node.expr, size))
    if not bindings:
        return None
    checked: dict[tuple, tuple[int, int]] = {}
    roots = storage_roots(record.forward)
    root_bytes = storage_root_bytes(record.forward, allocation_granularity(record.options.device))
    traced = ", ".join(f"{sym}={compat.int_hint(size)}" for _, _, sym, size in bindings)

    def check(args: list) -> tuple[int, int]:
        sizes = {}
        for index, dim, sym, _ in bindings:
            value = args[index] if dim is None else args[index].shape[dim]
            sizes.setdefault(sym, int(value))
        key = tuple(sizes.values())
        if key in checked:
            return checked[key]
        how = dict(sizes=sizes, lowering=record.options.lowering,
                   granularity=allocation_granularity(record.options.device))
        estimates = [estimate_memory(record.forward, keep_outputs_alive=True, **how)]
        if record.backward is not None:
            estimates.append(estimate_memory(record.backward, keep_outputs_alive=False, input_storage=roots,
                                             input_storage_bytes=root_bytes, inputs_held=record.options.retain_graph,
                                             **how))
        worst = max(estimates, key=lambda e: e.peak_bytes)
        if worst.peak_bytes > budget:
            now = ", ".join(f"{sym}={v}" for sym, v in sizes.items())
            raise BudgetError(
                f"megatrain: at this call's sizes ({now}) the plan made at the traced sizes ({traced}) needs "
                f"{format_bytes(worst.peak_bytes)} ({worst.peak_bytes} bytes) of device memory, set by layer "
                f"'{worst.peak_layer}', over memory_budget={format_bytes(budget)}. Nothing has run for this "
                f"call. Use smaller inputs, or raise memory_budget to at least {worst.peak_bytes}.",
                minimum_budget=worst.peak_bytes, limiting_layer=str(worst.peak_layer),
            )
        checked[key] = (worst.peak_bytes, estimates[0].end_bytes)
        return checked[key]

    return check


def programs_copy(options: Options, record: CompiledGraph, device) -> bool:
    """Whether the graph's programs copy between host and device: always on CUDA; on the CPU
    stand-in only where a copy is measured (the eager lowering) or a parameter may be updated
    while a program still reads it (the overlapped optimizer updates a layer mid-backward, and
    only a separate copy keeps the backward's reads from seeing it). Elsewhere the stand-in's
    loads share host memory and move nothing."""
    return not (device.shares_host_memory and not record.measures_peak
                and not options.overlaps_optimizer)


def merged_runs_pay_off(options: Options, record: CompiledGraph, device) -> bool:
    """Whether a plan's merge_compute_runs variant is worth building: its programs copy, so
    memory ops cut their runs, and runs compile (the Inductor lowering), so a merged run is
    one call. (The fuzzer also builds it under the eager lowering, which measures the peak.)"""
    return options.lowering == "inductor" and programs_copy(options, record, device)


def lower_with(options: Options, device):
    """A lowering function bound to the options: graph -> StreamingProgram."""
    # One cache for the forward and the backward of this graph: a repeated layer's segments
    # are compiled once.
    compile_segment = SegmentCache(compat.inductor_compile_segment)

    def lower(gm: fx.GraphModule, *, start_step: bool, record: CompiledGraph, part: str,
              saved_from: int | None = None):
        started = time.perf_counter()
        program = _lower(gm, start_step=start_step, record=record, part=part, saved_from=saved_from)
        seconds = time.perf_counter() - started
        record.compile_times.lowering_s += seconds
        log.info("%s %s: lowered (%s) in %.1f s", record.label, part, options.lowering, seconds)
        return program

    def _lower(gm: fx.GraphModule, *, start_step: bool, record: CompiledGraph, part: str, saved_from: int | None):
        record.segment_stats = compile_segment.stats
        check = size_check(record, options.memory_budget) if part == "forward" else None
        on_start = ((lambda args: RECORDER.forward_started(record, device, check(args) if check else None))
                    if start_step else None)
        ends_step_part = start_step or record.plan.policy != "inference"
        on_finish = ((lambda failed: RECORDER.graph_finished(record, backward=part == "backward", failed=failed))
                     if ends_step_part else None)
        share = not programs_copy(options, record, device)
        program = StreamingProgram(gm, device, options.lowering, compile_segment, on_start, on_finish,
                                   label=f"{record.label} {part}",
                                   check_inputs=check if on_start is None else None,  # (on_start checks)
                                   share_host_memory=share,
                                   saved_from=saved_from)
        program.host_lead_layers = options.host_lead_layers
        if part == "forward" and start_step:
            program.on_outputs = lambda outputs, input_ids: RECORDER.forward_returned(record, outputs, input_ids)
        if options.keeps_snapshots and record.measures_peak:  # inspect: the measured curve for --plot
            program.memory_log = record.memory_logs.setdefault(part, [])
        return program

    return lower
