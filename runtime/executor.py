"""Executes a rewritten graph: memory ops on the device's copy lanes, compute in between.

The program is the graph's nodes in order, each an instruction over numbered value slots.
Like Thunder's ``del`` statements, frees are explicit: after each instruction the slots whose
last reader it was are cleared, so a value lives exactly as long as the graph says (this is
what makes the measured peak comparable with the planned one).

Two lowerings share the executor:
- eager: every compute op is one instruction, run op by op, and every device-side result is
  handed to the device's tracker (on the CPU stand-in that is how the peak is measured);
- inductor: each maximal run of compute ops between two memory ops is one segment, compiled
  once by Inductor (Triton kernels on CUDA, C++ on CPU) on its first call. Where the device
  shares host memory (the CPU stand-in when nothing is measured), memory ops move nothing and
  split nothing: a segment is then one layer's compute in one phase.

The instruction types and what each does are in ``runtime/instructions.py``; ``_Lowering``
makes them from the graph, ``StreamingProgram`` runs them. Returned gradients that land on
the host go through the call's ``GradientSink`` (``runtime/gradient_sink.py``).
"""
from __future__ import annotations

import collections
import contextlib
import operator
import time
from typing import Any, Callable

import torch
import torch.fx as fx

from megacompile.core import ops, workspace
from megacompile.core import torch_compat as compat
from megacompile.core.errors import PartialUpdateError
from megacompile.core.host_ops import is_host_op, is_weight_copy_cast, widened_copy
from megacompile.core.node_info import has_info, info, is_view_node
from megacompile.core.torch_compat import no_dispatch_modes
from megacompile.runtime import profiler_ranges
from megacompile.runtime import trace as _trace
from megacompile.runtime.device import StreamingDevice
from megacompile.runtime.gradient_sink import GradientSink
from megacompile.runtime.host_arena import ArenaPool, arena_bytes
from megacompile.runtime.instructions import (
    SKIPPED,
    Call,
    ComputeOp,
    Const,
    Evict,
    HostOp,
    Instruction,
    Load,
    Offload,
    Segment,
    Slot,
    Wait,
    WeightCopy,
    Widen,
    resolve,
    template_slots,
)
from megacompile.runtime.placement import (
    DEVICE_KERNELS,
    place_constant,
    retarget_factories,
    substitute_host_kernels,
)
from megacompile.runtime.segment_cache import memory_order, varying_sizes

_aten = torch.ops.aten
# Ops Inductor lowers to an extern call of the vendor library (BLAS / cuBLAS, oneDNN /
# cuDNN): inside a segment they cost the same call, and a segment that also has other work
# saves the Python calls of everything around them; alone they run directly (a compiled
# wrapper around a lone matmul adds its call cost and fuses nothing).
_EXTERN_LIBRARY_KERNELS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.convolution.default, _aten.convolution_backward.default,
}
# Attention kernels always run directly, between segments: on a device they are substituted
# by megacompile's own device_attention ops at placement, which Inductor does not lower.
_ALWAYS_DIRECT = {
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_flash_attention_backward.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_efficient_attention_backward.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    *DEVICE_KERNELS,
}


def _is_trivial(node: fx.Node) -> bool:
    """Views and tuple access: nothing for a compiler to fuse, so they run as they are."""
    return node.target is operator.getitem or is_view_node(node)


def copying_device_segments(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The runs of nodes that ``StreamingProgram`` compiles into one segment each under the
    Inductor lowering on a device that copies (no host-memory sharing), in graph order.

    The memory estimate needs them (plan.estimate_memory): a segment's inputs are held until
    the segment returns (a compiled segment is called with its inputs as arguments, and the
    instruction's frees run after it), so an input whose last reader is early in a segment
    lives to the segment's end, not to that reader. The runs are cut as ``_Lowering`` cuts them
    (``_split_run``), without the sharing case; tests/test_segment_cache.py checks that the two
    agree."""
    segments: list[list[fx.Node]] = []
    pending: list[fx.Node] = []
    for node in [*gm.graph.nodes, None]:
        compute = (node is not None and node.op == "call_function" and not ops.is_memory_op(node)
                   and not (has_info(node) and info(node).placement == "host"))
        if compute:
            pending.append(node)
        else:
            segments += [piece for compiled, piece in _split_run(pending) if compiled]
            pending = []
    return segments


def _split_run(pending: list[fx.Node]) -> list[tuple[bool, list[fx.Node]]]:
    """A run of compute ops (between two memory ops) as (compiled, nodes) pieces in order: one
    compiled segment per stretch, GEMMs included (Inductor calls the same library for them),
    and the ops that run directly. Attention runs directly and splits the run. A getitem
    leading a stretch (a kernel's results taken apart) runs as it is, so a segment starts from
    tensors, not from a kernel's tuple; leading views join it (Inductor takes views of its
    inputs for free). A stretch with a single library call (or none) and views around it has
    nothing to fuse and no launches to save: its ops run as they are. Two library calls are
    one segment call instead of a dispatch per op (views included)."""
    pieces: list[tuple[bool, list[fx.Node]]] = []
    stretch: list[fx.Node] = []

    def close() -> None:
        if stretch:
            kernels = [n for n in stretch if not _is_trivial(n)]
            fusable = len(kernels) > 1 or any(n.target not in _EXTERN_LIBRARY_KERNELS for n in kernels)
            pieces.append((fusable, list(stretch)))
            stretch.clear()

    for n in pending:
        if n.target in _ALWAYS_DIRECT:
            close()
            pieces.append((False, [n]))
        elif not stretch and n.target is operator.getitem:
            pieces.append((False, [n]))
        else:
            stretch.append(n)
    close()
    return pieces


def _returned_once(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Value -> its position in the returned tuple, for values returned exactly once."""
    output = next((n for n in reversed(nodes) if n.op == "output"), None)
    returned = output.args[0] if output is not None else None
    if not isinstance(returned, (list, tuple)):
        return {}
    # Counted once: a forward returns every saved value, thousands in a deep model.
    times = collections.Counter(r for r in returned if isinstance(r, fx.Node))
    return {r: position for position, r in enumerate(returned) if isinstance(r, fx.Node) and times[r] == 1}


def _saved_offloads(returned: dict[fx.Node, int], saved_from: int | None) -> set[fx.Node]:
    """A forward's offloaded activations that it returns only for the backward (positions from
    ``saved_from`` on: AOTAutograd puts the user's outputs first), never to the user."""
    if saved_from is None:
        return set()
    return {n for n, position in returned.items() if n.target is ops.offload and position >= saved_from}


def _staged_on_host(nodes: list[fx.Node]) -> set[fx.Node]:
    """Transient host copies: a host op's result on its way to a load (a bf16 cast of a
    parameter) and an offloaded copy on its way to a host op (a bf16 gradient before its fp32
    cast). A host op's result the graph returns (the fp32 gradient) is not."""
    return {n for n in nodes
            if (is_host_op(n) and any(u.target is ops.load for u in n.users))
            or (n.target is ops.offload and any(is_host_op(u) for u in n.users))}


def _widened_copy(node: fx.Node, returned: dict[fx.Node, int]) -> fx.Node | None:
    """bf16: the offloaded narrow copy a returned host op widens (``host_casts.widened_copy``),
    or None. The sink may take that copy as soon as it lands (the host optimizer's kernel
    widens it exactly) instead of waiting for the cast."""
    return widened_copy(node) if node in returned else None


class _Lowering:
    """Turns a rewritten graph's nodes, in order, into a program's instructions over slots."""

    def __init__(self, program: StreamingProgram, nodes: list[fx.Node]) -> None:
        self.program = program
        self.slots: dict[fx.Node, int] = {}
        self.instructions: list[Instruction] = []
        self.input_slots: list[int] = []
        self.output_template: Any = None
        self.nodes = nodes
        self.returned = _returned_once(nodes)
        self.staged = _staged_on_host(nodes)
        self.to_arena = _saved_offloads(self.returned, program.saved_from) if not program.share_host_memory else set()
        # bf16: returned cast -> the offloaded narrow copy it widens, and that copy -> the
        # cast's returned position.
        self.widens: dict[fx.Node, fx.Node] = {}
        for n in nodes:
            copy = _widened_copy(n, self.returned) if is_host_op(n) else None
            if copy is not None:
                self.widens[n] = copy
        self.widened_at = {copy: self.returned[n] for n, copy in self.widens.items()}
        # The pending run: compute ops waiting to become segments (or ops).
        self.pending: list[fx.Node] = []
        self.in_run: set[fx.Node] = set()
        self.after_run: dict[fx.Node, Instruction] = {}  # offloads of values the pending run computes
        self.run_layer: str | None = None  # the layer of the pending run's last layered op

    def slot(self, n: fx.Node) -> int:
        if n not in self.slots:
            self.slots[n] = len(self.slots)
        return self.slots[n]

    def template(self, a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: Slot(self.slot(n)))

    def lower(self) -> _Lowering:
        for node in self.nodes:
            if node.op == "placeholder":
                self.input_slots.append(self.slot(node))
            elif node.op == "output":
                self.flush()
                self.output_template = self.template(node.args[0])
            elif node.op == "get_attr":
                self.flush()
                self.instructions.append(self.constant(node))
            elif ops.is_memory_op(node):
                self.memory_op(node)
            elif has_info(node) and info(node).placement == "host":
                self.flush()
                self.instructions.append(self.host_op(node))
            else:
                self.compute(node)
        return self

    # --- the pending run of compute ---------------------------------------------------------
    def compute(self, node: fx.Node) -> None:
        # Views and getitems join the run like any op (fewer segment calls, and Inductor sees
        # e.g. a reduction behind a transpose); ``_split_run`` runs a stretch of them alone as it is.
        layer = info(node).layer if has_info(node) else None
        changes_layer = layer is not None and self.run_layer not in (None, layer)
        if self.program.share_host_memory and self.pending and changes_layer:
            self.flush()  # one segment per layer (repeated layers reuse its compiled code)
        if self.program.lowering == "inductor":
            self.pending.append(node)
            self.in_run.add(node)
            if layer is not None:
                self.run_layer = layer
        else:
            self.flush()
            self.instructions.append(self.op(node))

    def flush(self) -> None:
        """The pending run becomes its segments and direct ops, then the offloads it held back."""
        for compiled, piece in _split_run(self.pending):
            if compiled:
                self.instructions.append(self.program._segment(piece, self.slot))
            else:
                self.instructions.extend(self.op(n) for n in piece)
        self.pending.clear()
        self.in_run.clear()
        self.instructions.extend(self.after_run.values())
        self.after_run.clear()
        self.run_layer = None

    # --- one node -------------------------------------------------------------------------
    def op(self, node: fx.Node) -> ComputeOp:
        return ComputeOp(name=node.name, layer=info(node).layer if has_info(node) else None, out=self.slot(node),
                         fn=compat.layout_tolerant_target(node), args=self.template(node.args),
                         kwargs=self.template(node.kwargs))

    def host_op(self, node: fx.Node) -> HostOp | WeightCopy:
        if is_weight_copy_cast(node):
            return WeightCopy(name=node.name, layer=info(node).layer, out=self.slot(node),
                              source=self.slot(node.args[0]), dtype=node.meta["val"].dtype)
        fields = dict(name=node.name, layer=info(node).layer, out=self.slot(node), fn=node.target,
                      args=self.template(node.args), kwargs=self.template(node.kwargs),
                      staged=node in self.staged, returns=self.returned.get(node))
        copy = self.widens.get(node)
        return HostOp(**fields) if copy is None else Widen(source=self.slot(copy), **fields)

    def constant(self, node: fx.Node) -> Const:
        value = getattr(self.program.gm, node.target)
        if any(not (has_info(u) and info(u).placement == "host") for u in node.users):
            # Built inside AOTAutograd's tracing, where a fake mode may be active: the copy
            # must be a real device tensor, not a fake one.
            with compat.no_dispatch_modes():
                value = place_constant(value, self.program.device.torch_device)
        return Const(name=node.name, out=self.slot(node), value=value)

    def memory_op(self, node: fx.Node) -> None:
        if not self.program.share_host_memory:
            self.flush()
            self.instructions.append(self.memory_instruction(node))
            return
        # Sharing host memory, memory ops move no bytes and need no place of their own: they
        # are taken out of the run (loads issued ahead of it, offloads after it) and split it
        # only where the layer changes, so a segment is a layer's compute, not the compute
        # between two copies (and repeated layers still reuse one compiled segment).
        if node.target in (ops.wait, ops.evict):
            # Nothing to wait for (the "copy" is the host tensor) and nothing to free (a value
            # is dropped after its last reader): no instruction at all.
            return
        source = node.args[0]
        if source in self.in_run:  # an offload of a value the run computes: after the run
            self.after_run[node] = self.memory_instruction(node)
            return
        if source in self.after_run:  # a reload of such an offload: the run ends here
            self.flush()
        self.instructions.append(self.memory_instruction(node))  # ahead of the run

    def memory_instruction(self, node: fx.Node) -> Instruction:
        copies = node.target in (ops.load, ops.offload)
        out = self.slot(node) if copies else None  # numbered before its source, as ever
        common = dict(name=node.name, layer=info(node).layer if has_info(node) else None,
                      source=self.slot(node.args[0]))
        if not copies:
            return (Wait if node.target is ops.wait else Evict)(**common)
        tag = node.args[1] if len(node.args) > 1 else None
        if node.target is ops.load:
            return Load(out=out, tag=tag, **common)
        returns = self.widened_at.get(node, self.returned.get(node))
        return Offload(out=out, tag=tag, staged=node in self.staged, returns=returns,
                       to_arena=node in self.to_arena, sole_reader=returns is not None and _sole_reader(node),
                       **common)


def _sole_reader(offload: fx.Node) -> bool:
    """Whether the offload's copy is the last thing that reads its source's memory: the source
    and the views it is made of have no other user than the next link of that chain (and the
    memory ops ordering this copy), and the memory is made here (not an input or a constant)."""
    node, reader = offload.args[0], offload
    while True:
        if node.op != "call_function":
            return False
        if any(u is not reader and u.target not in (ops.wait, ops.evict) for u in node.users):
            return False
        parent = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        # A view, or an element of a view op's results (a piece of a split), shares its base.
        shares = is_view_node(node) or (node.target is operator.getitem and parent is not None
                                        and is_view_node(parent))
        if not shares:
            return True
        if parent is None:
            return False
        node, reader = parent, node


def _plan_frees(instructions: list[Instruction], input_slots: list[int], output_template: Any) -> list[int]:
    """Appends to each instruction the slots whose last reader it is; returns the inputs that
    nothing reads (freed as the program starts). Returned values are never freed."""
    last_read: dict[int, int] = {}
    for k, instr in enumerate(instructions):
        for s in instr.reads():
            last_read[s] = k
        for s in instr.writes():
            last_read.setdefault(s, k)  # a value nobody reads dies right away
    outputs = set(template_slots(output_template))
    for s in input_slots:
        last_read.setdefault(s, -1)
    for s, k in last_read.items():
        if k >= 0 and s not in outputs:
            instructions[k].frees.append(s)
    return [s for s, k in last_read.items() if k == -1 and s not in outputs]


class StreamingProgram:
    """A boxed callable (takes a list of inputs, which it empties) that runs one graph."""

    _boxed_call = True

    def __init__(
        self,
        gm: fx.GraphModule,
        device: StreamingDevice,
        lowering: str,
        compile_segment: Callable[[fx.GraphModule, list], Callable] | None = None,
        on_start: Callable[[list], None] | None = None,  # called with the call's inputs
        on_finish: Callable[[bool], None] | None = None,  # called with whether the run raised
        observe_inputs: Callable[[list], None] | None = None,
        make_sink: Callable[[], GradientSink | None] | None = None,
        label: str = "program",
        check_inputs: Callable[[list], None] | None = None,
        share_host_memory: bool = False,
        saved_from: int | None = None,
    ) -> None:
        self.gm = gm
        # A forward: the position of its first value saved for the backward (its offloaded
        # activations among them go to exact-size host buffers reused every step).
        self.saved_from = saved_from
        # Loads and offloads share host tensors instead of copying them (the caller decides:
        # only on a device whose memory is the host's, where no peak is measured and no
        # parameter changes while a program that read it still runs).
        if share_host_memory and not device.shares_host_memory:
            raise ValueError(f"the {device.kind} device cannot share host memory")
        self.share_host_memory = share_host_memory
        self.label = label  # the name of this program's event in a runtime trace
        # Called with the inputs before anything runs (the plan's re-check at new sizes).
        self.check_inputs = check_inputs
        self.device = device
        self.lowering = lowering
        self.compile_segment = compile_segment
        self.on_start = on_start
        self.on_finish = on_finish
        # Called with what a run returned (the step recorder watches a forward's outputs).
        self.on_outputs: Callable[[Any, set], None] | None = None  # (outputs, the inputs' ids)
        # Sees the inputs of each call before they are consumed (the forward records which
        # parameter tensors it ran with, for the backward's overlapped optimizer updates).
        self.observe_inputs = observe_inputs
        # Called at the start of each call: the GradientSink that takes returned gradients as
        # they land (the overlapped optimizer's lander), or None for the default sink.
        self.make_sink = make_sink
        # A backward: its returned values are gradients, the same sizes every step, which land
        # in the device's reused buffers (where it has them). A forward's returned values are
        # the user's to keep.
        self.lands_gradients = False
        # Set to a list to record (instruction name, device bytes live after it) over the last
        # run: the measured curve beside the plan's (`megacompile inspect --plot`).
        self.memory_log: list | None = None
        # Layers the host may run ahead of the device's compute (option host_lead_layers); None: no bound.
        self.host_lead_layers: int | None = None
        self._build()

    # --- building -------------------------------------------------------------------------
    def _build(self) -> None:
        # Traced on the host: ops that make tensors name the host device (placement.py).
        retarget_factories(self.gm, self.device.torch_device)
        substitute_host_kernels(self.gm, self.device.torch_device)
        lowering = _Lowering(self, list(self.gm.graph.nodes)).lower()
        self.instructions = lowering.instructions
        self.input_slots = lowering.input_slots
        self.output_template = lowering.output_template
        self.num_slots = len(lowering.slots)
        self.free_at_start = _plan_frees(self.instructions, self.input_slots, self.output_template)
        self.arena_pool = None
        if lowering.to_arena:  # empty where the program shares host memory
            traced = [n.args[0].meta.get("val") for n in lowering.to_arena]
            self.arena_pool = ArenaPool(self.device.host_buffer, self.device.before_host_buffer_reuse,
                                        size=arena_bytes(traced))

    def _segment(self, seg_nodes: list[fx.Node], slot_of: Callable[[fx.Node], int]) -> Segment:
        inside = set(seg_nodes)
        inputs: list[fx.Node] = []
        for n in seg_nodes:
            for inp in n.all_input_nodes:
                if inp not in inside and inp not in inputs:
                    inputs.append(inp)
        outputs = [n for n in seg_nodes if any(u not in inside for u in n.users)]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        # The segment is re-traced by Inductor with real inputs: it gets none of the parent
        # graph's meta (its fake tensors belong to another fake mode).
        for inp in inputs:
            env[inp] = graph.placeholder(inp.name)
        for n in seg_nodes:
            env[n] = graph.node_copy(n, lambda x: env[x])
            env[n].meta = {}
        # A multi-output op read outside the segment (``nll_loss_forward``, whose second
        # result a later getitem takes) leaves as its elements: a compiled graph returns a flat
        # tuple of tensors. ``arity`` says how many flat outputs each slot takes back.
        flat, arity = [], []
        for o in outputs:
            val = o.meta.get("val")
            if isinstance(val, (tuple, list)):
                flat += [graph.call_function(operator.getitem, (env[o], i)) for i in range(len(val))]
                arity.append(len(val))
            else:
                flat.append(env[o])
                arity.append(None)
        graph.output(tuple(flat))
        layers = list(dict.fromkeys(info(n).layer for n in seg_nodes if has_info(n) and info(n).layer))
        return Segment(name=f"segment[{seg_nodes[0].name}..{seg_nodes[-1].name}]",
                       layer=",".join(layers) if layers else None,
                       outs=[slot_of(o) for o in outputs], inputs=[slot_of(i) for i in inputs],
                       gm=fx.GraphModule(self.gm, graph), arity=arity if any(a is not None for a in arity) else None,
                       varying=varying_sizes(inputs))

    def _compile(self, gm: fx.GraphModule, inputs: list, varying: list | None = None) -> Callable:
        # Compile outside whatever dispatch state the caller (an autograd.Function, the
        # autograd engine) runs us in: Inductor re-traces the segment with its own modes.
        examples = [t.detach() if isinstance(t, torch.Tensor) else t for t in inputs]
        with no_dispatch_modes(), torch.enable_grad():
            if varying is not None:  # dynamic shapes: compiled for any size there
                orders = [memory_order(t) if isinstance(t, torch.Tensor) and keys is not None else None
                          for t, keys in zip(examples, varying)]
                examples = compat.symbolic_examples(examples, varying, orders)
            return self.compile_segment(gm, examples)

    # --- running --------------------------------------------------------------------------
    # The backward runs from inside the user's compiled frame (``loss.backward()`` after a
    # graph break); without this, Dynamo would try to trace the runtime itself.
    @torch.compiler.disable
    def __call__(self, args: list) -> Any:
        if self.check_inputs is not None:
            self.check_inputs(args)
        if self.on_start is not None:
            self.on_start(args)
        if self.observe_inputs is not None:
            self.observe_inputs(args)
        sink = self.make_sink() if self.make_sink is not None else None
        if sink is None:
            sink = _RETURN_EVERYTHING
        recorder = _trace.active()
        program_start = time.perf_counter_ns() if recorder is not None else 0
        # While a torch profiler records, the run and each instruction are its ranges too.
        program_range = profiler_ranges.ProfilerRange("graphs", self.label) if profiler_ranges.profiling() else None
        failed = False
        # (ids, not the tensors: the run frees its inputs as it goes)
        input_ids = {id(a) for a in args} if self.on_outputs is not None else None
        try:
            # The casts autocast would make are in the program already; a caller's autocast
            # context must not cast its ops again (an op the trace kept in fp32 would change).
            with compat.autocast_disabled():
                outputs = self._run(args, sink, recorder, program_range is not None)
            if self.on_outputs is not None:
                self.on_outputs(outputs, input_ids)
            return outputs
        except BaseException as error:
            failed = True
            self.device.after_failure()  # the failed run's values are still referenced here
            # Updates already submitted finish before anyone can look at the parameters.
            sink.finish(failed=True)
            updated = sink.updated_before_failure()
            if updated:
                raise _partial_update_error(self.label, updated, error) from error
            raise
        finally:
            if not failed:
                sink.finish()
            # The profiler's range closes before the trace's clock stops, so the range nests in the
            # trace's event (a GIL handoff in between would otherwise lengthen the range alone).
            if program_range is not None:
                program_range.close()
            if recorder is not None:  # the program's event encloses the updates it waited for
                recorder.add_program(self.label, program_start, time.perf_counter_ns(),
                                     {"instructions": len(self.instructions)})
            if self.on_finish is not None:
                self.on_finish(failed)

    def _run(self, args: list, sink: GradientSink, recorder, profiled: bool) -> Any:
        env: list = [None] * self.num_slots
        for s, value in zip(self.input_slots, args):
            env[s] = value
        args.clear()  # the caller's references would keep inputs alive past their last use
        for s in self.free_at_start:
            env[s] = None
        device = self.device
        if self.memory_log is not None:
            self.memory_log.clear()
        call = Call(env, device, sink, track=self.lowering == "eager", share=self.share_host_memory,
                    compile=self._compile, arena=self.arena_pool.lease() if self.arena_pool is not None else None,
                    landing=device.landing if self.lands_gradients else None)
        # The stand-in's tracker sees op outputs; the fused head's chunk buffers are inside
        # one op, so that op reports them (on CUDA the allocator sees everything).
        observing = call.track and device.kind == "cpu"
        try:
            with workspace.observe(device.track) if observing else contextlib.nullcontext():
                result = self._run_instructions(call, env, recorder, profiled)
        finally:
            if call.arena is not None:
                self.arena_pool.finished(call.arena)
        env.clear()
        return result

    def _run_instructions(self, call: Call, env: list, recorder, profiled: bool) -> Any:
        device = self.device
        lead = self.host_lead_layers
        layer = None  # the layer of the compute enqueued last
        for instr in self.instructions:
            if lead is not None and instr.kind in _LAYER_COMPUTE and instr.layer is not None and instr.layer != layer:
                layer = instr.layer
                device.layer_started(lead)  # may wait for the device (runtime/host_lead.py)
            if recorder is not None:
                instr_start = time.perf_counter_ns()
            if profiled:
                with profiler_ranges.ProfilerRange(_lane(device, instr), instr.name):
                    outcome = instr.run(call)
            else:
                outcome = instr.run(call)
            if outcome is SKIPPED:
                continue
            if recorder is not None:
                _record_instruction(recorder, device, instr, env, instr_start)
            if self.memory_log is not None:
                self.memory_log.append((instr.name, device.tracker.current))
            for s in instr.frees:
                env[s] = None
        return resolve(self.output_template, env)


def _partial_update_error(label: str, updated: list, error: BaseException) -> PartialUpdateError:
    """The error of a program run that failed after its sink (the overlapped host optimizer)
    had updated some layers: says so and names them."""
    count = sum(n for _, n in updated)
    layers = ", ".join(str(layer or "(glue)") for layer, _ in updated)
    return PartialUpdateError(
        f"megatrain: {label} failed ({type(error).__name__}: {error}) after the host optimizer had already "
        f"updated {count} parameters of layers {layers} in this step. Those parameters and their optimizer "
        f"state are one step ahead of the rest, which are as before the step: restore a checkpoint to retry "
        f"the step, or go on knowing it.", updated, error)


# Stateless: one default sink for every program.
_RETURN_EVERYTHING = GradientSink()

_COMPUTE_LANES = {"op": "compute", "segment": "compute", "const": "compute", "wait": "wait", "evict": "evict"}
# The instructions whose layer marks where the program's compute moves to a new layer.
_LAYER_COMPUTE = frozenset({"op", "segment"})


def _lane(device: StreamingDevice, instr: Instruction) -> str:
    return device.trace_copy_lanes.get(instr.kind) or _COMPUTE_LANES.get(instr.kind, "compute")


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _record_instruction(recorder, device: StreamingDevice, instr: Instruction, env: list, start_ns: int) -> None:
    """One finished instruction as a trace event (only while ``trace_runtime`` is active)."""
    end_ns = time.perf_counter_ns()
    lane = _lane(device, instr)
    values = [env[s] for s in instr.traced_slots()]
    args = {"kind": instr.kind, "layer": instr.layer, "bytes": _nbytes(values)}
    recorder.add_instruction(lane, instr.name, start_ns, end_ns, args)
