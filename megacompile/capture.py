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
import weakref
from typing import Any

import torch
import torch.fx as fx

from megacompile.passes import PassContext, run_passes

from . import _torch_compat as compat
from .errors import BudgetError
from .node_info import info
from .options import Options, format_bytes
from .plan import TrainingPlan, estimate_memory, storage_roots
from .report import RECORDER, LayerRow, StepReport

_graph_counter = itertools.count()

# Every graph compiled in this process, newest last, for `megacompile inspect`.
COMPILED: list["CompiledGraph"] = []


@dataclasses.dataclass
class CompiledGraph:
    label: str
    options: Options
    snapshots: list = dataclasses.field(default_factory=list)
    plan: TrainingPlan | None = None
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    param_bytes_by_layer: dict = dataclasses.field(default_factory=dict)
    # The graph's parameters (weakly: the record must not keep a model alive), by input index.
    param_refs: dict = dataclasses.field(default_factory=dict)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.params())

    def params(self) -> list[torch.Tensor]:
        return [p for p in (ref() for ref in self.param_refs.values()) if p is not None]

    def host_bytes(self, optimizer) -> dict[str, int]:
        """What this graph's parameters hold in host memory between steps, by kind, counted
        from the tensors themselves: the (fp32 master) weights, the gradients the backward
        hands to ``param.grad`` (their dtype and size, from the backward program), and the
        optimizer's state tensors for these parameters."""
        params = self.params()
        grads = 0
        if self.backward is not None:
            output = next(iter(self.backward.graph.find_nodes(op="output")))
            for index, out in enumerate(output.args[0]):
                if index in self.param_refs and isinstance(out, fx.Node):
                    grads += info(out).nbytes_hint
        states = 0
        if optimizer is not None:
            for p in params:
                for value in optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        states += value.untyped_storage().nbytes()
        return {
            "weights": sum(p.untyped_storage().nbytes() for p in params),
            "gradients": grads,
            "optimizer_states": states,
        }

    @property
    def measures_peak(self) -> bool:
        # CUDA: the allocator measures everything. CPU stand-in: only the eager lowering
        # hands every device-side tensor to the tracker.
        return self.options.device == "cuda" or self.options.lowering == "eager"

    def make_report(self, device, measured: int | None, host_graphs: list[str], optimizer=None) -> StepReport:
        from . import overlap

        plan = self.plan
        layers: dict[str, LayerRow] = {}

        def row(name: str | None) -> LayerRow:
            key = name or "(glue)"
            if key not in layers:
                layers[key] = LayerRow(key)
            return layers[key]

        for layer, nbytes in self.param_bytes_by_layer.items():
            row(layer).param_bytes += nbytes
        for layer, nbytes in device.stats.h2d_by_layer.items():
            row(layer).h2d_bytes = nbytes
        for layer, nbytes in device.stats.d2h_by_layer.items():
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
        num_params = self.num_params
        return StepReport(
            device=self.options.device,
            precision=self.options.precision,
            host_bytes=host,
            host_bytes_per_param=sum(host.values()) / num_params if num_params else 0.0,
            host_staging_peak_bytes=device.host_staging.peak_since_reset(),
            lowering=self.options.lowering,
            memory_budget=self.options.memory_budget,
            policy=plan.policy,
            planned_peak_device_bytes=plan.peak_bytes,
            measured_peak_device_bytes=measured,
            h2d_bytes=device.stats.h2d_bytes,
            d2h_bytes=device.stats.d2h_bytes,
            recomputed_ops=list(plan.recomputed_ops),
            layers=list(layers.values()),
            graphs=[self.label],
            host_graphs=host_graphs,
            notes=[plan.reason] if plan.reason else [],
            optimizer=dataclasses.asdict(overlap.LAST) if overlap.LAST is not None else None,
        )


class TrainingCompiler:
    """The AOTAutograd callbacks for one Dynamo graph."""

    def __init__(self, options: Options, device, input_names: list[str], input_roles: list[str],
                 example_inputs: list, lowering_fn) -> None:
        self.options = options
        self.device = device
        self.input_names = input_names
        self.input_roles = input_roles
        self.lower = lowering_fn
        self.record = CompiledGraph(label=f"graph{next(_graph_counter)}", options=options)
        from .overlap import ParamInputs

        # The forward records the parameter tensors it ran with; the backward's gradient i
        # belongs to forward input i.
        self.param_inputs = ParamInputs([i for i, role in enumerate(input_roles) if role == "param"])
        from .eager_update_watch import EagerUpdateWatch

        self.eager_watch = EagerUpdateWatch()
        for index, (name, role, value) in enumerate(zip(input_names, input_roles, example_inputs)):
            if role == "param" and isinstance(value, torch.Tensor):
                self.record.param_refs[index] = weakref.ref(value)
                from .node_info import layer_of_module_path

                layer = layer_of_module_path(name.rsplit(".", 1)[0]) if "." in name else None
                key = layer or "(glue)"
                self.record.param_bytes_by_layer[key] = (
                    self.record.param_bytes_by_layer.get(key, 0) + value.numel() * value.element_size()
                )

    def _ctx(self, stage: str, plan: TrainingPlan, num_user_outputs: int = 0) -> PassContext:
        return PassContext(self.options, stage, plan, self.input_names, self.input_roles, num_user_outputs)

    # --- AOTAutograd callbacks ----------------------------------------------------------
    def partition(self, joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **_unused):
        from .hardware import get_profile
        from .planner import Attempt, plan_training

        joint._megatrain_num_fwd_outputs = num_fwd_outputs

        def build(plan: TrainingPlan) -> Attempt:
            jctx = self._ctx("joint", plan)
            run_passes(joint, jctx)
            by_name = {n.name: n for n in joint.graph.nodes}
            fw, bw = compat.extract_forward_backward(
                joint, [by_name[n] for n in plan.saved_values], [by_name[n] for n in plan.saved_sym_nodes],
                num_fwd_outputs,
            )
            fctx = self._ctx("forward", plan, num_user_outputs=num_fwd_outputs)
            run_passes(fw, fctx)
            bctx = self._ctx("backward", plan)
            run_passes(bw, bctx)
            plan.forward = estimate_memory(fw, keep_outputs_alive=True)
            plan.backward = estimate_memory(bw, keep_outputs_alive=False, input_storage=storage_roots(fw))
            return Attempt(plan, fw, bw, jctx.snapshots + fctx.snapshots + bctx.snapshots)

        # Annotate once to learn the layers in forward order.
        run_passes(joint, self._ctx("joint", TrainingPlan()), keep_snapshots=False)
        layers: list[str] = []
        for node in joint.graph.nodes:
            layer = info(node).layer if node.op == "call_function" and compat.is_forward_tagged(node) else None
            if layer and layer not in layers:
                layers.append(layer)
        profile = get_profile(self.options.hardware_profile())
        from .cost_model import optimizer_param_bytes

        param_bytes = optimizer_param_bytes(self.record.num_params, self.options.precision)

        def predict_seconds(attempt: Attempt) -> float:
            from .cost_model import step_time

            return step_time(attempt.forward, attempt.backward, profile, optimizer_param_bytes=param_bytes,
                             precision=self.options.precision).total_s

        from megacompile.passes.resident_parameters import used_in_both_phases

        both_phases = [info(n).source for n in used_in_both_phases(joint)]
        chosen = plan_training(build, layers, self.options, profile, predict_seconds, both_phases, joint=joint)
        self.record.plan, self.record.forward, self.record.backward = chosen.plan, chosen.forward, chosen.backward
        self.record.snapshots = chosen.snapshots
        COMPILED.append(self.record)
        return chosen.forward, chosen.backward

    # AOTAutograd compiles the backward lazily, inside ``loss.backward()`` within the user's
    # compiled frame; without ``disable`` Dynamo would trace our lowering code itself.
    @torch.compiler.disable
    def compile_forward(self, gm: fx.GraphModule, example_inputs) -> Any:
        program = self.lower(self._same_or_ours(gm, self.record.forward), start_step=True, record=self.record)

        def observe(args: list) -> None:
            self.param_inputs.observe(args)
            self.eager_watch.forward_starting(self.param_inputs.tensors())

        program.observe_inputs = observe
        return program

    @torch.compiler.disable
    def compile_backward(self, gm: fx.GraphModule, example_inputs) -> Any:
        program = self.lower(self._same_or_ours(gm, self.record.backward), start_step=False, record=self.record)
        program.make_lander = self._make_lander
        finished = program.on_finish

        def on_finish() -> None:
            self.eager_watch.backward_finished(self.param_inputs.tensors())
            if finished is not None:
                finished()

        program.on_finish = on_finish
        return program

    def _make_lander(self):
        """Per backward call: a lander if the optimizer step can overlap it, else None."""
        from . import overlap

        if not self.options.overlap_optimizer:
            overlap.record(overlap.OverlapStats(False, "overlap_optimizer=False"))
            return None
        params = self.param_inputs.tensors()
        opt, reason = overlap.step_follows_backward(params)
        if opt is None:
            overlap.record(overlap.OverlapStats(False, reason))
            return None
        lander = overlap.GradientLander(opt, params, self.device, reason)
        overlap.record(lander.stats)
        RECORDER.optimizer_seen(opt)
        return lander

    @torch.compiler.disable
    def compile_inference(self, gm: fx.GraphModule, example_inputs) -> Any:
        plan = TrainingPlan(policy="inference", budget=self.options.memory_budget)
        ctx = self._ctx("inference", plan)
        run_passes(gm, ctx)
        plan.forward = estimate_memory(gm, keep_outputs_alive=False)
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
        COMPILED.append(self.record)
        # Glue without parameters (``loss.detach()``) belongs to the step around it.
        starts_step = "param" in self.input_roles
        return self.lower(gm, start_step=starts_step, record=self.record)

    @staticmethod
    def _same_or_ours(given: fx.GraphModule, ours: fx.GraphModule | None) -> fx.GraphModule:
        # AOTAutograd hands back the module the partitioner returned; if a PyTorch version
        # copies it, the copy has the same nodes and meta.
        return given if ours is None else given


def lower_with(options: Options, device):
    """A lowering function bound to the options: graph -> StreamingProgram."""
    from megacompile.runtime.executor import StreamingProgram

    def compile_segment(gm: fx.GraphModule, inputs: list):
        return compat.inductor_compile(gm, inputs)

    def lower(gm: fx.GraphModule, *, start_step: bool, record: CompiledGraph):
        on_start = (lambda: RECORDER.forward_started(record, device)) if start_step else None
        on_finish = (lambda: RECORDER.graph_finished(record)) if start_step or record.plan.policy != "inference" else None
        return StreamingProgram(gm, device, options.lowering, compile_segment, on_start, on_finish)

    return lower
