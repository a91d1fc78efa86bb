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
"""
from __future__ import annotations

import collections
import dataclasses
import operator
import time
from typing import Any, Callable

import torch
import torch.fx as fx

from megacompile.core import ops
from megacompile.core import torch_compat as compat
from megacompile.core.node_info import has_info, info, is_view_node
from megacompile.core.torch_compat import no_dispatch_modes
from megacompile.runtime import trace as _trace
from megacompile.runtime.device import StreamingDevice
from megacompile.runtime.placement import (
    DEVICE_KERNELS,
    place_constant,
    retarget_factories,
    substitute_host_kernels,
)


@dataclasses.dataclass
class Instruction:
    kind: str  # load | offload | wait | evict | op | host_op | segment | const
    out: list[int]
    args: Any  # slot-referencing args for op; input slots for memory ops / segments
    fn: Any = None
    name: str = ""
    layer: str | None = None
    frees: list[int] = dataclasses.field(default_factory=list)


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _resolve(template: Any, env: list) -> Any:
    if isinstance(template, _Slot):
        return env[template.index]
    if isinstance(template, (list, tuple)):
        resolved = [_resolve(t, env) for t in template]
        return resolved if isinstance(template, list) else tuple(resolved)
    if isinstance(template, dict):
        return {k: _resolve(v, env) for k, v in template.items()}
    return template


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
    lives to the segment's end, not to that reader. The runs are cut as ``_build`` cuts them
    (``_split_run``), without the sharing case; tests/test_segment_cache.py checks that the two
    agree."""
    segments: list[list[fx.Node]] = []
    pending: list[fx.Node] = []
    for node in [*gm.graph.nodes, None]:
        compute = (node is not None and node.op == "call_function" and not ops.is_memory_op(node)
                   and not (has_info(node) and info(node).placement == "host"))
        if compute and (pending or not _is_trivial(node)):
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
    inputs for free). A stretch of views, tuple access and library calls only has nothing to
    fuse: its ops run as they are."""
    pieces: list[tuple[bool, list[fx.Node]]] = []
    stretch: list[fx.Node] = []

    def close() -> None:
        if stretch:
            fusable = not all(_is_trivial(n) or n.target in _EXTERN_LIBRARY_KERNELS for n in stretch)
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


class StreamingProgram:
    """A boxed callable (takes a list of inputs, which it empties) that runs one graph."""

    _boxed_call = True

    def __init__(
        self,
        gm: fx.GraphModule,
        device: StreamingDevice,
        lowering: str,
        compile_segment: Callable[[fx.GraphModule, list], Callable] | None = None,
        on_start: Callable[[], None] | None = None,
        on_finish: Callable[[], None] | None = None,
        observe_inputs: Callable[[list], None] | None = None,
        make_lander: Callable[[], Any] | None = None,
        label: str = "program",
        check_inputs: Callable[[list], None] | None = None,
        share_host_memory: bool = False,
    ) -> None:
        self.gm = gm
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
        # Sees the inputs of each call before they are consumed (the forward records which
        # parameter tensors it ran with, for the backward's overlapped optimizer updates).
        self.observe_inputs = observe_inputs
        # Called at the start of each call: returns a megacompile.optimizer.overlap.GradientLander that
        # takes over the returned gradients as they are offloaded, or None.
        self.make_lander = make_lander
        # Set to a list to record (instruction, device bytes live after it): debugging aid
        # for comparing the measured curve with the plan's.
        self.memory_log: list | None = None
        self._build()

    # --- building -------------------------------------------------------------------------
    def _build(self) -> None:
        # Traced on the host: ops that make tensors name the host device (placement.py).
        retarget_factories(self.gm, self.device.torch_device)
        substitute_host_kernels(self.gm, self.device.torch_device)
        nodes = list(self.gm.graph.nodes)
        slot: dict[fx.Node, int] = {}
        self.input_slots: list[int] = []
        self.instructions: list[Instruction] = []
        pending: list[fx.Node] = []  # compute ops waiting to become a segment
        # Sharing host memory, memory ops move no bytes and need no place of their own: they
        # are taken out of the run (loads issued ahead of it, offloads after it) and split
        # it only where the layer changes, so a segment is a layer's compute, not the compute
        # between two copies (and repeated layers still reuse one compiled segment).
        moves_no_bytes = self.share_host_memory
        in_run: set[fx.Node] = set()
        after_run: dict[fx.Node, Instruction] = {}  # offloads of values the pending run computes
        run_layer: str | None = None  # the layer of the pending run's last layered op

        def slot_of(n: fx.Node) -> int:
            if n not in slot:
                slot[n] = len(slot)
            return slot[n]

        def template(a: Any) -> Any:
            return fx.node.map_arg(a, lambda n: _Slot(slot_of(n)))

        def op_instruction(node: fx.Node) -> Instruction:
            return Instruction("op", [slot_of(node)], (template(node.args), template(node.kwargs)),
                               fn=node.target, name=node.name, layer=info(node).layer if has_info(node) else None)

        def flush() -> None:
            nonlocal run_layer
            for compiled, piece in _split_run(pending):
                if compiled:
                    self.instructions.append(self._segment(piece, slot_of, nodes))
                else:
                    self.instructions.extend(op_instruction(n) for n in piece)
            pending.clear()
            in_run.clear()
            self.instructions.extend(after_run.values())
            after_run.clear()
            run_layer = None

        def memory_instruction(node: fx.Node) -> Instruction:
            kind = node.target._schema.name.split("::")[-1]
            layer = info(node).layer if has_info(node) else None
            out = [slot_of(node)] if kind in ("load", "offload") else []
            return Instruction(kind, out, [slot_of(node.args[0])], name=node.name, layer=layer,
                               fn=node.args[1] if len(node.args) > 1 else None)

        for node in nodes:
            if node.op == "placeholder":
                self.input_slots.append(slot_of(node))
            elif node.op == "output":
                flush()
                self.output_template = template(node.args[0])
            elif node.op == "get_attr":
                flush()
                value = getattr(self.gm, node.target)
                if any(not (has_info(u) and info(u).placement == "host") for u in node.users):
                    # Built inside AOTAutograd's tracing, where a fake mode may be active: the
                    # copy must be a real device tensor, not a fake one.
                    with compat.no_dispatch_modes():
                        value = place_constant(value, self.device.torch_device)
                self.instructions.append(Instruction("const", [slot_of(node)], None, fn=value, name=node.name))
            elif ops.is_memory_op(node) and moves_no_bytes:
                if node.target in (ops.wait, ops.evict):
                    # Nothing to wait for (the "copy" is the host tensor) and nothing to free
                    # (a value is dropped after its last reader): no instruction at all.
                    continue
                source = node.args[0]
                if source in in_run:  # an offload of a value the run computes: after the run
                    after_run[node] = memory_instruction(node)
                    continue
                if source in after_run:  # a reload of such an offload: the run ends here
                    flush()
                self.instructions.append(memory_instruction(node))  # ahead of the run
            elif ops.is_memory_op(node):
                flush()
                self.instructions.append(memory_instruction(node))
            elif has_info(node) and info(node).placement == "host":
                # A host op (a host cast): runs on the host, never in a device segment; its
                # result is host staging memory, not device memory.
                flush()
                self.instructions.append(
                    Instruction("host_op", [slot_of(node)], (template(node.args), template(node.kwargs)),
                                fn=node.target, name=node.name, layer=info(node).layer)
                )
            else:
                # A view or getitem inside a run of compute joins its segment (fewer segment
                # calls, and Inductor sees e.g. a reduction behind a transpose); on its own it
                # runs as it is.
                layer = info(node).layer if has_info(node) else None
                if moves_no_bytes and pending and layer is not None and run_layer not in (None, layer):
                    flush()  # one segment per layer (repeated layers reuse its compiled code)
                if self.lowering == "inductor" and (pending or not _is_trivial(node)):
                    pending.append(node)
                    in_run.add(node)
                    if layer is not None:
                        run_layer = layer
                else:
                    flush()
                    self.instructions.append(op_instruction(node))
        self.num_slots = len(slot)
        # Transient host copies: a host op's result on its way to a load (a bf16 cast of a
        # parameter) and an offloaded copy on its way to a host op (a bf16 gradient before
        # its fp32 cast). A host op's result the graph returns (the fp32 gradient) is not.
        def host_op(n: fx.Node) -> bool:
            return n.op == "call_function" and not ops.is_memory_op(n) and has_info(n) and info(n).placement == "host"

        self.staged_on_host = {
            slot[n] for n in nodes
            if (host_op(n) and any(u.target is ops.load for u in n.users))
            or (n.target is ops.offload and any(host_op(u) for u in n.users))
        }
        # Slot -> position in the returned tuple, for values returned directly.
        self.output_position: dict[int, int] = {}
        if isinstance(self.output_template, (list, tuple)):
            # Counted once: a forward returns every saved value, thousands in a deep model.
            times_returned = collections.Counter(t.index for t in self.output_template if isinstance(t, _Slot))
            for position, t in enumerate(self.output_template):
                if isinstance(t, _Slot) and times_returned[t.index] == 1:  # returned once
                    self.output_position[t.index] = position
        # bf16: a gradient comes back as an offloaded bf16 copy that a host cast widens to the
        # fp32 value returned. Offload slot -> (returned position, the cast's slot): the
        # host optimizer can take the bf16 copy as soon as it lands (its kernel widens it
        # exactly) instead of waiting for the cast at the end of the backward.
        offloaded = {i.out[0] for i in self.instructions if i.kind == "offload"}
        self.widened_gradient: dict[int, tuple[int, int]] = {}
        for instr in self.instructions:
            if instr.kind != "host_op" or instr.out[0] not in self.output_position:
                continue
            inputs: list[int] = []
            fx.node.map_aggregate(instr.args, lambda a: inputs.append(a.index) if isinstance(a, _Slot) else a)
            if len(inputs) == 1 and inputs[0] in offloaded:
                self.widened_gradient[inputs[0]] = (self.output_position[instr.out[0]], instr.out[0])
        self._plan_frees(slot)

    def _segment(self, seg_nodes: list[fx.Node], slot_of, all_nodes: list[fx.Node]) -> Instruction:
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
        sub = fx.GraphModule(self.gm, graph)
        layers = list(dict.fromkeys(info(n).layer for n in seg_nodes if has_info(n) and info(n).layer))
        instr = Instruction("segment", [slot_of(o) for o in outputs], [slot_of(i) for i in inputs],
                            name=f"segment[{seg_nodes[0].name}..{seg_nodes[-1].name}]",
                            layer=",".join(layers) if layers else None)
        instr.fn = {"gm": sub, "compiled": None, "arity": arity if any(a is not None for a in arity) else None}
        return instr

    def _plan_frees(self, slot: dict) -> None:
        last_read: dict[int, int] = {}

        def reads(instr: Instruction) -> list[int]:
            if instr.kind in ("op", "host_op"):
                found: list[int] = []
                fx.node.map_aggregate(instr.args, lambda a: found.append(a.index) if isinstance(a, _Slot) else a)
                return found
            if instr.kind == "const":
                return []
            return list(instr.args)

        for k, instr in enumerate(self.instructions):
            for s in reads(instr):
                last_read[s] = k
            for s in instr.out:
                last_read.setdefault(s, k)  # a value nobody reads dies right away
        outputs: set[int] = set()
        fx.node.map_aggregate(self.output_template, lambda a: outputs.add(a.index) if isinstance(a, _Slot) else a)
        for s in self.input_slots:
            last_read.setdefault(s, -1)
        self.free_at_start = [s for s, k in last_read.items() if k == -1 and s not in outputs]
        for s, k in last_read.items():
            if k >= 0 and s not in outputs:
                self.instructions[k].frees.append(s)

    def _compile(self, gm: fx.GraphModule, inputs: list) -> Callable:
        # Compile outside whatever dispatch state the caller (an autograd.Function, the
        # autograd engine) runs us in: Inductor re-traces the segment with its own modes.

        examples = [t.detach() if isinstance(t, torch.Tensor) else t for t in inputs]
        with no_dispatch_modes(), torch.enable_grad():
            return self.compile_segment(gm, examples)

    # --- running --------------------------------------------------------------------------
    # The backward runs from inside the user's compiled frame (``loss.backward()`` after a
    # graph break); without this, Dynamo would try to trace the runtime itself.
    @torch.compiler.disable
    def __call__(self, args: list) -> Any:
        if self.check_inputs is not None:
            self.check_inputs(args)
        if self.on_start is not None:
            self.on_start()
        if self.observe_inputs is not None:
            self.observe_inputs(args)
        lander = self.make_lander() if self.make_lander is not None else None
        recorder = _trace.active()
        program_start = time.perf_counter_ns() if recorder is not None else 0
        try:
            return self._run(args, lander, recorder)
        finally:
            if lander is not None:
                # Also on an error: updates already submitted must finish before anyone
                # can look at the parameters.
                lander.finish()
            if recorder is not None:  # the program's event encloses the updates it waited for
                recorder.add("graphs", self.label, program_start, time.perf_counter_ns(),
                             {"instructions": len(self.instructions)})
            if self.on_finish is not None:
                self.on_finish()

    def _run(self, args: list, lander, recorder) -> Any:
        env: list = [None] * self.num_slots
        for s, value in zip(self.input_slots, args):
            env[s] = value
        args.clear()  # the caller's references would keep inputs alive past their last use
        for s in self.free_at_start:
            env[s] = None
        device = self.device
        track = self.lowering == "eager"
        share = self.share_host_memory
        taken_casts: set[int] = set()
        for instr in self.instructions:
            if recorder is not None:
                instr_start = time.perf_counter_ns()
            kind = instr.kind
            if kind == "op":
                a, kw = _resolve(instr.args, env)
                env[instr.out[0]] = instr.fn(*a, **kw)
                # Locals would keep this op's inputs alive past their last use.
                a = kw = None
                if track:
                    device.track(env[instr.out[0]])
            elif kind == "host_op":
                if instr.out[0] in taken_casts:
                    continue  # the host optimizer took (and widens) this cast's input already
                a, kw = _resolve(instr.args, env)
                result = instr.fn(*a, **kw)
                a = kw = None
                position = self.output_position.get(instr.out[0]) if lander is not None else None
                if position is not None and lander.owns(position):
                    # A gradient made on the host (bf16 -> fp32 cast of a landed copy): the
                    # host optimizer takes it like an offloaded one; it is complete already.
                    lander.take(position, result, instr.layer, None)
                else:
                    env[instr.out[0]] = result
                    if instr.out[0] in self.staged_on_host:
                        device.host_staging.track(result)
                result = None
            elif kind == "load":
                if share:
                    env[instr.out[0]] = device.share(env[instr.args[0]], instr.fn, instr.layer)
                else:
                    env[instr.out[0]] = device.load(env[instr.args[0]], instr.fn, instr.layer, track)
            elif kind == "wait":
                if env[instr.args[0]] is not None:  # None: a gradient the lander took over
                    device.wait(env[instr.args[0]])
            elif kind == "evict":
                device.evict(env[instr.args[0]])
            elif kind == "offload":
                if share:
                    host = device.hand_over(env[instr.args[0]], instr.fn, instr.layer)
                else:
                    host = device.offload(env[instr.args[0]], instr.fn, instr.layer)
                position = self.output_position.get(instr.out[0]) if lander is not None else None
                widened = self.widened_gradient.get(instr.out[0]) if lander is not None else None
                if widened is not None and lander.owns(widened[0]):
                    position = widened[0]
                    taken_casts.add(widened[1])
                if position is not None and lander.owns(position):
                    # The host optimizer consumes this gradient as soon as it lands; the
                    # backward returns None for it (no host gradient buffer is kept).
                    lander.take(position, host, instr.layer, device.completion(host))
                else:
                    env[instr.out[0]] = host
                    if instr.out[0] in self.staged_on_host:
                        device.host_staging.track(host)
                host = None
            elif kind == "segment":
                inputs = [env[s] for s in instr.args]
                if instr.fn["compiled"] is None:
                    instr.fn["compiled"] = self._compile(instr.fn["gm"], inputs)
                outs = instr.fn["compiled"](*inputs)
                inputs = None
                if instr.fn["arity"] is not None:
                    outs = _regroup(outs, instr.fn["arity"])
                for s, v in zip(instr.out, outs):
                    env[s] = v
                outs = None
            elif kind == "const":
                env[instr.out[0]] = instr.fn
            if recorder is not None:
                _record_instruction(recorder, device, instr, env, instr_start)
            if self.memory_log is not None:
                self.memory_log.append((instr.name, device.tracker.current))
            for s in instr.frees:
                env[s] = None
        result = _resolve(self.output_template, env)
        env.clear()
        return result


def _regroup(flat, arity: list) -> list:
    """A segment's flat outputs back into one value per slot (a tuple for a multi-output op)."""
    out, k = [], 0
    for n in arity:
        if n is None:
            out.append(flat[k])
            k += 1
        else:
            out.append(tuple(flat[k:k + n]))
            k += n
    return out


_COMPUTE_LANES = {"op": "compute", "segment": "compute", "const": "compute", "wait": "wait", "evict": "evict"}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _record_instruction(recorder, device: StreamingDevice, instr: Instruction, env: list, start_ns: int) -> None:
    """One finished instruction as a trace event (only while ``trace_runtime`` is active)."""
    end_ns = time.perf_counter_ns()
    kind = instr.kind
    lane = device.trace_copy_lanes.get(kind) or _COMPUTE_LANES.get(kind, "compute")
    values = [env[s] for s in (instr.out or instr.args)] if kind != "op" else [env[instr.out[0]]]
    args = {"kind": kind, "layer": instr.layer, "bytes": _nbytes(values)}
    recorder.add(lane, instr.name, start_ns, end_ns, args)
