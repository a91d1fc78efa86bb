"""The time half of the cost model: FLOPs and bytes per node, a lane simulation, step time.

Each op of a rewritten program gets a ``NodeCost`` under ``node.meta["megatrain_cost"]``
(``COST_KEY``): its FLOPs (``torch.utils.flop_counter``'s per-op formulas, evaluated on the
fake tensors' sizes at the traced example), the bytes it reads and writes, and its time on
a ``HardwareProfile``:

- compute ops: roofline ``max(flops / device FLOP/s, bytes / HBM bandwidth)`` plus a per-op
  launch overhead (``launch_overhead_s``) for every op that runs a kernel. Where the program
  is compiled by Inductor on a GPU (``fused_pointwise``), a layer's chains of pointwise ops and
  the reductions they feed run as fused kernels: a value passed between two of them is neither
  written nor read again, and only an op whose result leaves the chain pays a launch;
- ``load``: bytes / h2d bandwidth on the ``h2d`` lane; ``offload``: bytes / d2h bandwidth on
  the ``d2h`` lane; ``wait`` / ``evict``: no time of their own;
- host ops (host casts): bytes / host memory bandwidth on the thread that issues the device
  work, except the casts the runtime does not run (``HostCastsServed``).

``simulate`` replays one program in node order the way the streaming runtime runs it: one
compute lane, one FIFO copy lane each way; a ``load`` is issued when the compute lane reaches
it, a ``wait`` stalls the compute lane until the copy has landed. ``step_time`` chains
forward, backward and the (today synchronous) host optimizer, and compares the result with
the roofline floor of the mission: max(compute, link bytes / link bandwidth each way, host
optimizer bytes / host memory bandwidth).

All sizes are evaluated at the traced example (``int_hint``), so symbolic shapes work; no
tensor is allocated (ops are costed from fake tensor metadata; the rare op that is costed by
decomposition runs on ``meta`` tensors).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch.utils import flop_counter as _fc

from megacompile.core import ops
from megacompile.core import torch_compat as compat
from megacompile.core.host_ops import is_weight_copy_cast, widened_copy
from megacompile.core.node_info import has_info, info, is_view_node
from megacompile.core.torch_compat import int_hint
from megacompile.plan.hardware import ADAMW_BYTES_PER_PARAM, HardwareProfile

COST_KEY = "megatrain_cost"

LANES = ("compute", "h2d", "d2h")
STEP_LANES = ("compute", "h2d", "d2h", "host_optimizer")

# Per-op launch overhead charged to every op that runs a kernel (views, tuple access and
# SymInt arithmetic run none).
# - GPU profiles, 5 us: eager PyTorch spends about 4-6 us of host time per CUDA kernel
#   (dispatcher + cudaLaunchKernel) and the smallest kernels occupy the GPU for 2-3 us, so a
#   stream of tiny ops is launch bound at roughly 5 us per op. We charge it per aten op, which
#   is an upper bound under the Inductor lowering (it fuses pointwise chains into one kernel).
# - CPU stand-in, 10 us: on the 2-core development VM a small aten op (addmm, gelu, add on a
#   16x64 tensor, one thread) takes 5-10 us from Python including its arithmetic, and the eager
#   executor adds a few us per instruction (argument resolution, tracker bookkeeping). The
#   stand-in's memory-op instructions (~4 us each) are not charged: wait/evict cost nothing.
#   Measured MLP forward (72 instructions, 14 kernels): 393 us best of 7; predicted 175 us.
GPU_LAUNCH_OVERHEAD_S = 5e-6
CPU_STANDIN_LAUNCH_OVERHEAD_S = 10e-6

_PARAM_BYTES = {"fp32": 4, "bf16": 2}


# --- per-node costs ---------------------------------------------------------------------
@dataclasses.dataclass
class NodeCost:
    """What one node costs on one profile (``node.meta["megatrain_cost"]``)."""

    flops: int = 0
    # HBM bytes read + written (compute ops); bytes copied over the link (load/offload).
    bytes_touched: int = 0
    time_s: float = 0.0
    lane: str = "compute"  # compute | h2d | d2h | host (a host op, e.g. a host cast)
    profile: str = ""
    precision: str = "fp32"


def cost(node: fx.Node) -> NodeCost | None:
    return node.meta.get(COST_KEY)


def is_cpu_standin(profile: HardwareProfile) -> bool:
    """The built-in stand-in and profiles calibrated without a GPU (same description)."""
    return profile.name == "cpu-standin" or profile.description.startswith("CPU stand-in")


def launch_overhead_s(profile: HardwareProfile) -> float:
    return CPU_STANDIN_LAUNCH_OVERHEAD_S if is_cpu_standin(profile) else GPU_LAUNCH_OVERHEAD_S


def device_flops(profile: HardwareProfile, precision: str = "fp32") -> float:
    if precision == "fp32":
        return float(profile.device_flops_fp32)
    if precision == "bf16":
        return float(profile.device_flops_bf16)
    raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")


def _hint_size(shape) -> torch.Size:
    return torch.Size([int_hint(s) for s in shape])


def _hinted(val: Any) -> Any:
    """Fake tensors -> their sizes at the example; SymInts -> ints; containers recursively."""
    if isinstance(val, torch.Tensor):
        return _hint_size(val.shape)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return int_hint(val) if isinstance(val, torch.SymInt) else val.node.hint
    if isinstance(val, list):
        return [_hinted(v) for v in val]
    if isinstance(val, tuple):
        return tuple(_hinted(v) for v in val)
    return val


def _as_meta(val: Any) -> Any:
    """Fake tensors -> meta tensors of the example's sizes (nothing allocated, no guards)."""
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(_hint_size(val.shape), _hint_size(val.stride()), dtype=val.dtype, device="meta")
    if isinstance(val, torch.SymInt):
        return int_hint(val)
    if isinstance(val, torch.device):
        return torch.device("meta")
    if isinstance(val, list):
        return [_as_meta(v) for v in val]
    if isinstance(val, tuple):
        return tuple(_as_meta(v) for v in val)
    return val


def _vals(node: fx.Node, convert) -> tuple[tuple, dict]:
    def of(n: fx.Node) -> Any:
        return convert(n.meta.get("val"))

    args = fx.node.map_arg(node.args, of)
    kwargs = fx.node.map_arg(node.kwargs, of)
    if convert is _as_meta:  # constants too: a device argument must say meta
        args, kwargs = _as_meta(args), {k: _as_meta(v) for k, v in kwargs.items()}
    return args, kwargs


def _formulas() -> dict:
    table = dict(_fc.flop_registry)
    # The CPU spelling of scaled_dot_product_attention: graphs are traced on the host (where
    # megatrain keeps the parameters), so an attention that runs as flash attention on the
    # GPU appears here as the CPU op, which FlopCounterMode does not count.
    aten = torch.ops.aten
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", "sdpa_flop"),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", "sdpa_backward_flop")):
        if hasattr(aten, name) and hasattr(_fc, formula):
            table.setdefault(getattr(aten, name), getattr(_fc, formula))
    return table


_FORMULAS: dict | None = None
_DECOMPOSES: dict = {}


def _decomposes(op: compat.OpOverload) -> bool:
    found = _DECOMPOSES.get(op)
    if found is None:
        try:
            found = compat.has_composite_implicit_kernel(op)
        except Exception:
            found = False
        _DECOMPOSES[op] = found
    return found


_WARNED: set = set()


def _warn_once(key: Any, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def _output_has_tensor(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (list, tuple)):
        return any(_output_has_tensor(v) for v in val)
    return False


_FLOPS_KEY = "megatrain_flops"


def remember_flops(gm: fx.GraphModule) -> None:
    """Count every op's FLOPs once and keep the count in its meta, for the graphs built from
    this one: node copies share the meta's fake tensors, and the count is reused while the
    copy's result is the same fake tensor (the same op on the same sizes)."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta[_FLOPS_KEY] = (id(node.meta.get("val")), _count_flops(node))


def node_flops(node: fx.Node) -> int:
    """FLOPs of one aten op node, from its fake tensors at the example's sizes (counted once
    where ``remember_flops`` ran on the graph this node was copied from)."""
    remembered = node.meta.get(_FLOPS_KEY)
    if remembered is not None and remembered[0] == id(node.meta.get("val")):
        return remembered[1]
    return _count_flops(node)


def _count_flops(node: fx.Node) -> int:
    """FLOPs of one aten op node, from its fake tensors at the example's sizes.

    The formulas are ``torch.utils.flop_counter``'s (2*M*N*K for a matmul); an op without a
    formula that PyTorch decomposes (CompositeImplicitAutograd) is counted the way
    ``FlopCounterMode`` counts it, by running the decomposition on meta tensors. Everything
    else (pointwise, reductions, views, memory ops, SymInt arithmetic) is 0.
    """
    global _FORMULAS
    target = node.target
    if node.op != "call_function" or not isinstance(target, compat.OpOverload):
        return 0
    if target in ops.MEMORY_OPS or "val" not in node.meta:
        return 0
    if any("val" not in n.meta for n in node.all_input_nodes):
        return 0
    if _FORMULAS is None:
        _FORMULAS = _formulas()
    formula = _FORMULAS.get(target.overloadpacket)
    if formula is not None:
        try:
            if hasattr(formula, "__wrapped__"):  # shape formula (shape_wrapper): sizes suffice
                args, kwargs = _vals(node, _hinted)
                return int(formula(*args, **kwargs, out_val=_hinted(node.meta["val"])) * causal_fraction(node))
            # Raw formulas (flash/efficient attention) read tensor attributes: give them the
            # fake tensors and take the example's value of a symbolic result.
            args, kwargs = _vals(node, lambda v: v)
            return int(int_hint(formula(*args, **kwargs, out_val=node.meta["val"])) * causal_fraction(node))
        except Exception as e:  # a cost estimate must not fail a compile
            _warn_once(target, f"megatrain cost model: no FLOP count for {target} ({type(e).__name__}: {e}); using 0")
            return 0
    if _decomposes(target):
        try:
            args, kwargs = _vals(node, _as_meta)
            with _fc.FlopCounterMode(display=False) as counter:
                if target.decompose(*args, **kwargs) is NotImplemented:
                    return 0
            return int(counter.get_total_flops())
        except Exception:
            return 0
    return 0


def causal_fraction(node: fx.Node) -> float:
    """The share of an attention op's score matrix a causal kernel computes: (S + 1) / 2S for
    ``is_causal=True`` with equal query and key lengths (flash kernels skip the tiles above the
    diagonal), 1 otherwise. torch's sdpa FLOP formulas count the whole matrix either way."""
    target = node.target
    if not target.name().startswith("aten::_scaled_dot_product"):
        return 1.0
    values = {}
    for i, arg in enumerate(target._schema.arguments):
        values[arg.name] = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
    if values.get("is_causal") is not True:
        return 1.0
    query, key = (values.get(n) for n in ("query", "key"))
    shapes = [v.meta["val"].shape if isinstance(v, fx.Node) and "val" in v.meta else None for v in (query, key)]
    if None in shapes or len(shapes[0]) < 2 or len(shapes[1]) < 2:
        return 1.0
    s_q, s_k = int_hint(shapes[0][-2]), int_hint(shapes[1][-2])
    return (s_q + 1) / (2 * s_q) if s_q == s_k and s_q > 0 else 1.0


def _tensor_bytes(val: Any) -> int:
    """Bytes of the distinct elements a tensor addresses (broadcast dims, stride 0, count once)."""
    if isinstance(val, torch.Tensor):
        n = 1
        for size, stride in zip(val.shape, val.stride()):
            if int_hint(stride) != 0:
                n *= int_hint(size)
        return n * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_tensor_bytes(v) for v in val)
    return 0


def node_bytes_touched(node: fx.Node) -> int:
    """Bytes an op reads and writes, at the example's sizes.

    Compute ops: every distinct tensor input once plus the outputs. ``load`` / ``offload``:
    the bytes copied (what their link lane moves). 0 for views, tuple access, ``wait``,
    ``evict``, SymInt arithmetic and ops without a tensor result.
    """
    target = node.target
    if node.op != "call_function" or not isinstance(target, compat.OpOverload):
        return 0
    out = node.meta.get("val")
    if target in (ops.load, ops.offload):
        return _tensor_bytes(out)
    if target in ops.MEMORY_OPS or is_view_node(node) or not _output_has_tensor(out):
        return 0
    read = sum(_tensor_bytes(n.meta.get("val")) for n in dict.fromkeys(node.all_input_nodes))
    return read + _tensor_bytes(out)


# Reductions Inductor fuses with the pointwise ops that feed them (RMSNorm's mean of squares,
# a bias gradient's sum).
_FUSED_REDUCTIONS = frozenset({
    torch.ops.aten.sum.dim_IntList, torch.ops.aten.sum.default, torch.ops.aten.mean.dim,
    torch.ops.aten.mean.default, torch.ops.aten.amax.default, torch.ops.aten.amin.default,
})
_DTYPE_CASTS = frozenset({torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default})


class PointwiseFusion:
    """Which device ops of one program Inductor runs as fused kernels, and what they then move.

    Fusible: device ops tagged pointwise, dtype casts and the reductions above. Inside one
    layer, a fusible op's input made by another fusible op (through views) stays in registers
    (not read from memory), and its result is written only if something other than a fusible
    op of its layer reads it (a matmul, a copy, the graph's output, another layer). The ops of
    a fused kernel pay one launch: the op whose result is written."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self._fusible: dict[fx.Node, bool] = {}
        for node in gm.graph.nodes:
            self._fusible[node] = self._is_fusible(node)

    @staticmethod
    def _is_fusible(node: fx.Node) -> bool:
        if node.op != "call_function" or not isinstance(node.target, compat.OpOverload):
            return False
        if ops.is_memory_op(node) or is_view_node(node) or not has_info(node) or info(node).placement != "device":
            return False
        target = node.target
        return torch.Tag.pointwise in target.tags or target in _FUSED_REDUCTIONS or target in _DTYPE_CASTS

    def fusible(self, node: fx.Node) -> bool:
        return self._fusible.get(node, False)

    @staticmethod
    def _base(node: fx.Node) -> fx.Node:
        seen = 0
        while is_view_node(node) and node.all_input_nodes and seen < 64:
            node, seen = node.all_input_nodes[0], seen + 1
        return node

    def _readers(self, node: fx.Node) -> list[fx.Node]:
        """Who reads ``node``'s memory: its users, through views."""
        out, stack, seen = [], list(node.users), set()
        while stack:
            user = stack.pop()
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and is_view_node(user):
                stack.extend(user.users)
            else:
                out.append(user)
        return out

    def _same_kernel(self, a: fx.Node, b: fx.Node) -> bool:
        return self.fusible(a) and self.fusible(b) and info(a).layer == info(b).layer

    def bytes_and_launch(self, node: fx.Node) -> tuple[int, bool]:
        """(bytes read from and written to memory, whether it launches a kernel) of a fusible op."""
        read = 0
        for value in dict.fromkeys(node.all_input_nodes):
            if not self._same_kernel(self._base(value), node):
                read += _tensor_bytes(value.meta.get("val"))
        readers = self._readers(node)
        written = not readers or any(not self._same_kernel(node, r) for r in readers)
        return read + (_tensor_bytes(node.meta.get("val")) if written else 0), written


def _lane(node: fx.Node) -> str:
    if node.target is ops.load:
        return "h2d"
    if node.target is ops.offload:
        return "d2h"
    if has_info(node) and info(node).placement == "host":
        return "host"  # a host op (a host cast): the issuing thread's time, at host memory bandwidth
    return "compute"


def annotate_costs(gm: fx.GraphModule, profile: HardwareProfile, precision: str = "fp32", *,
                   launch_overhead: float | None = None, fused_pointwise: bool | None = None) -> None:
    """Store a ``NodeCost`` under ``node.meta["megatrain_cost"]`` for every call_function node.

    ``launch_overhead``: seconds per kernel-running op; default ``launch_overhead_s(profile)``.
    ``fused_pointwise``: price pointwise chains as fused kernels (``PointwiseFusion``); default:
    on GPU profiles (a GPU program is lowered by Inductor unless the user asks for eager).
    """
    peak = device_flops(profile, precision)
    overhead = launch_overhead_s(profile) if launch_overhead is None else float(launch_overhead)
    if fused_pointwise is None:
        fused_pointwise = not is_cpu_standin(profile)
    fusion = PointwiseFusion(gm) if fused_pointwise else None
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        lane = _lane(node)
        flops = node_flops(node)
        nbytes = node_bytes_touched(node)
        launches = True
        if fusion is not None and lane == "compute" and fusion.fusible(node):
            nbytes, launches = fusion.bytes_and_launch(node)
        if lane == "h2d":
            time_s = nbytes / profile.h2d_bandwidth
        elif lane == "d2h":
            time_s = nbytes / profile.d2h_bandwidth
        elif node.target in (ops.wait, ops.evict) or (flops == 0 and nbytes == 0):
            time_s = 0.0
        elif lane == "host":
            flops, time_s = 0, nbytes / profile.host_memory_bandwidth
        else:
            time_s = max(flops / peak, nbytes / profile.hbm_bandwidth) + (overhead if launches else 0.0)
        node.meta[COST_KEY] = NodeCost(flops=flops, bytes_touched=nbytes, time_s=time_s, lane=lane,
                                       profile=profile.name, precision=precision)


# --- the lane simulation ----------------------------------------------------------------
@dataclasses.dataclass
class HostCastsServed:
    """Which host casts of a step the runtime serves without casting, so they cost no time:

    - a parameter's narrowing cast (``host_casts.is_weight_copy_cast``) takes the parameter's
      persistent bf16 copy. The overlapped optimizer rewrites that copy in its update's pass
      (``copies_written_by_optimizer``); otherwise the step's first load of the parameter
      rewrites it (the cast is paid once a step) and later loads take it as it is;
    - the cast widening a landed bf16 gradient (``host_casts.widened_copy``) does not run where
      the overlapped optimizer takes the gradient (``gradients_taken``): its kernel reads the
      bf16 copy.

    One instance spans the graphs of a step, in order (it remembers the parameters cast)."""

    copies_written_by_optimizer: bool = False
    gradients_taken: bool = False
    cast_this_step: set[str] = dataclasses.field(default_factory=set)

    def free(self, node: fx.Node) -> bool:
        if is_weight_copy_cast(node):
            if self.copies_written_by_optimizer:
                return True
            weight = info(node.args[0]).source or node.args[0].name
            first = weight not in self.cast_this_step
            self.cast_this_step.add(weight)
            return not first
        return self.gradients_taken and widened_copy(node) is not None


class TimelineEvent(NamedTuple):
    lane: str  # compute | h2d | d2h | stall (compute lane waiting for a copy) | host | host_optimizer
    name: str
    start_s: float
    end_s: float


@dataclasses.dataclass
class LayerTime:
    compute_s: float = 0.0
    h2d_s: float = 0.0
    d2h_s: float = 0.0
    exposed_wait_s: float = 0.0

    def add(self, other: "LayerTime") -> None:
        self.compute_s += other.compute_s
        self.h2d_s += other.h2d_s
        self.d2h_s += other.d2h_s
        self.exposed_wait_s += other.exposed_wait_s


@dataclasses.dataclass
class LaneTimeline:
    total_s: float = 0.0  # when the last lane finished
    compute_s: float = 0.0  # busy time per lane
    h2d_s: float = 0.0
    d2h_s: float = 0.0
    exposed_wait_s: float = 0.0  # compute lane idle, waiting for copies
    host_s: float = 0.0  # host ops run by the issuing thread (the compute lane waits for them)
    flops: int = 0
    # FLOPs of ops replayed in the backward (NodeInfo.phase == "recompute"); included in flops.
    recompute_flops: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    loads: int = 0
    offloads: int = 0
    bottleneck: str = "compute"
    per_layer: dict[str, LayerTime] = dataclasses.field(default_factory=dict, repr=False)
    events: list[TimelineEvent] = dataclasses.field(default_factory=list, repr=False)

    def lane_s(self) -> dict[str, float]:
        return {"compute": self.compute_s, "h2d": self.h2d_s, "d2h": self.d2h_s}


def _bottleneck(lane_s: dict[str, float]) -> str:
    return max(lane_s, key=lambda k: lane_s[k])  # ties: the first listed (compute)


def _layer_key(node: fx.Node) -> str:
    layer = info(node).layer if has_info(node) else None
    return layer or "(glue)"


def _copy_of(node: Any, done: dict) -> fx.Node | None:
    """The load/offload whose copy ``node`` (or the base it views) is."""
    seen = 0
    while isinstance(node, fx.Node) and seen < 64:
        if node in done:
            return node
        tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if node.op != "call_function" or not is_view_node(node) or not tensors:
            return None
        node, seen = tensors[0], seen + 1
    return None


def simulate(gm: fx.GraphModule, profile: HardwareProfile, precision: str = "fp32", *,
             synchronous_copies: bool | None = None, launch_overhead: float | None = None,
             start_s: float = 0.0, served: HostCastsServed | None = None,
             fused_pointwise: bool | None = None) -> LaneTimeline:
    """Replay one rewritten program on the profile's lanes, in node order.

    - compute ops run one after another on the compute lane;
    - ``load`` is issued when the compute lane reaches it and starts when the h2d lane is
      free (FIFO); ``offload`` likewise on the d2h lane, not before its input is produced;
    - ``wait`` on a copy stalls the compute lane until that copy has finished (the stall is
      the exposed wait); ``evict`` costs nothing.

    ``synchronous_copies``: copies run on the compute lane's thread and block it, as the CPU
    stand-in device does; default: True for CPU stand-in profiles, False otherwise.
    ``start_s`` shifts the whole timeline (events and ``total_s``), for chaining graphs.
    ``served``: the host casts the runtime does not run (default: a weight cast costs at its
    parameter's first cast in this graph only, as with a synchronous optimizer).
    """
    annotate_costs(gm, profile, precision, launch_overhead=launch_overhead, fused_pointwise=fused_pointwise)
    if synchronous_copies is None:
        synchronous_copies = is_cpu_standin(profile)
    served = HostCastsServed() if served is None else served
    tl = LaneTimeline()
    t_compute = h2d_free = d2h_free = start_s
    ready: dict[fx.Node, float] = {}  # when a value exists
    done: dict[fx.Node, float] = {}  # when a copy (load / offload) has landed
    end = start_s

    def layer(node: fx.Node) -> LayerTime:
        key = _layer_key(node)
        if key not in tl.per_layer:
            tl.per_layer[key] = LayerTime()
        return tl.per_layer[key]

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            ready[node] = start_s
            continue
        if node.op != "call_function":
            continue
        c: NodeCost = node.meta[COST_KEY]
        inputs_ready = max((ready.get(n, start_s) for n in node.all_input_nodes), default=start_s)
        if node.target in (ops.load, ops.offload):
            is_load = node.target is ops.load
            lane_free = h2d_free if is_load else d2h_free
            begin = max(lane_free, t_compute, inputs_ready)
            finish = begin + c.time_s
            if is_load:
                h2d_free = finish
                tl.h2d_s += c.time_s
                tl.h2d_bytes += c.bytes_touched
                tl.loads += 1
                layer(node).h2d_s += c.time_s
            else:
                d2h_free = finish
                tl.d2h_s += c.time_s
                tl.d2h_bytes += c.bytes_touched
                tl.offloads += 1
                layer(node).d2h_s += c.time_s
            if synchronous_copies:
                t_compute = finish
            done[node] = ready[node] = finish
            tl.events.append(TimelineEvent("h2d" if is_load else "d2h", node.name, begin, finish))
            end = max(end, finish)
            continue
        if node.target is ops.wait:
            copy = _copy_of(node.args[0], done)
            if copy is not None and done[copy] > t_compute:
                stall = done[copy] - t_compute
                tl.exposed_wait_s += stall
                layer(node).exposed_wait_s += stall
                tl.events.append(TimelineEvent("stall", node.name, t_compute, done[copy]))
                t_compute = done[copy]
            ready[node] = t_compute
            continue
        if node.target is ops.evict:
            ready[node] = t_compute
            continue
        begin = t_compute
        if c.lane == "host":
            # The thread that issues the device work runs it: it delays what follows, but
            # it is not device compute.
            if not served.free(node):
                t_compute = begin + c.time_s
                tl.host_s += c.time_s
                if c.time_s > 0:
                    tl.events.append(TimelineEvent("host", node.name, begin, t_compute))
            ready[node] = t_compute
            continue
        t_compute = begin + c.time_s
        ready[node] = t_compute
        if c.time_s > 0:
            tl.compute_s += c.time_s
            layer(node).compute_s += c.time_s
            tl.events.append(TimelineEvent("compute", node.name, begin, t_compute))
        tl.flops += c.flops
        if has_info(node) and info(node).phase == "recompute":
            tl.recompute_flops += c.flops
    end = max(end, t_compute, h2d_free, d2h_free)
    tl.total_s = end - start_s
    tl.bottleneck = _bottleneck(tl.lane_s())
    return tl


# --- a whole training step --------------------------------------------------------------
def roofline_floor(compute_s: float, h2d_bytes: float, d2h_bytes: float, host_optimizer_bytes: float,
                   profile: HardwareProfile) -> float:
    """The step time no schedule can beat (the mission's roofline): the slowest of compute,
    bytes over the link each way at link bandwidth, and the host optimizer's bytes at host
    memory bandwidth, all perfectly overlapped."""
    return max(
        float(compute_s),
        h2d_bytes / profile.h2d_bandwidth,
        d2h_bytes / profile.d2h_bandwidth,
        host_optimizer_bytes / profile.host_memory_bandwidth,
    )


@dataclasses.dataclass
class StepTimePrediction:
    profile: str
    precision: str
    total_s: float
    compute_s: float
    h2d_s: float
    d2h_s: float
    host_optimizer_s: float
    exposed_wait_s: float
    bottleneck: str  # the busiest of compute | h2d | d2h | host_optimizer
    flops: int  # executed, recompute included
    model_flops: int  # recompute excluded: what MFU is computed from
    h2d_bytes: int
    d2h_bytes: int
    optimizer_params: int
    host_optimizer_bytes: int
    achieved_flops_per_s: float  # flops / total_s
    mfu: float  # model_flops / total_s / device peak
    roofline_s: float  # roofline_floor(...) of this step
    tokens: int | None = None
    tokens_per_s: float | None = None
    forward: LaneTimeline | None = dataclasses.field(default=None, repr=False)
    backward: LaneTimeline | None = dataclasses.field(default=None, repr=False)
    per_layer: dict[str, LayerTime] = dataclasses.field(default_factory=dict, repr=False)
    events: list[TimelineEvent] = dataclasses.field(default_factory=list, repr=False)

    @property
    def achieved_tflops(self) -> float:
        return self.achieved_flops_per_s / 1e12

    def lane_s(self) -> dict[str, float]:
        return {"compute": self.compute_s, "h2d": self.h2d_s, "d2h": self.d2h_s,
                "host_optimizer": self.host_optimizer_s}

    def summary(self) -> str:
        ms = lambda s: f"{s * 1e3:.4g} ms"  # noqa: E731
        head = f"predicted step on {self.profile} ({self.precision}): {ms(self.total_s)}"
        if self.total_s > 0:
            head += f" (roofline floor {ms(self.roofline_s)} = {self.roofline_s / self.total_s:.0%} of it)"
        lines = [
            head,
            "  busy: " + ", ".join(f"{k} {ms(v)}" for k, v in self.lane_s().items())
            + f"; exposed waits {ms(self.exposed_wait_s)}; bottleneck: {self.bottleneck}",
            f"  moved: h2d {self.h2d_bytes} B, d2h {self.d2h_bytes} B; optimizer {self.optimizer_params} params",
            f"  {self.flops / 1e9:.4g} GFLOP executed ({self.model_flops / 1e9:.4g} model):"
            f" {self.achieved_tflops:.4g} TFLOPS achieved, MFU {self.mfu:.2%}",
        ]
        if self.tokens_per_s is not None:
            lines.append(f"  {self.tokens} tokens/step: {self.tokens_per_s:,.0f} tokens/s")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def step_time(forward_gm: fx.GraphModule, backward_gm: fx.GraphModule | None, profile: HardwareProfile, *,
              optimizer_param_bytes: int, precision: str = "fp32", tokens: int | None = None,
              synchronous_copies: bool | None = None, launch_overhead: float | None = None,
              overlap_optimizer: bool = False, fused_pointwise: bool | None = None) -> StepTimePrediction:
    """Predicted time of one training step: forward, backward and the host optimizer.

    The optimizer updates ``optimizer_param_bytes / bytes-per-param`` parameters at
    ``profile.estimated_host_adamw_params_per_s()``. Synchronous (``overlap_optimizer=False``):
    after the backward has finished. Overlapped, as the runtime does it (megacompile/optimizer/overlap.py):
    each gradient's update runs on one host worker, in landing order, as soon as its offload
    has landed (``optimizer_landings``); the step ends when both the backward and the worker
    are done.
    """
    kw = dict(synchronous_copies=synchronous_copies, launch_overhead=launch_overhead, fused_pointwise=fused_pointwise)
    served = HostCastsServed(copies_written_by_optimizer=overlap_optimizer)
    fwd = simulate(forward_gm, profile, precision, served=served, **kw)
    if backward_gm is not None:
        served.gradients_taken = overlap_optimizer
        bwd = simulate(backward_gm, profile, precision, start_s=fwd.total_s, served=served, **kw)
    else:
        bwd = None
    graphs = [t for t in (fwd, bwd) if t is not None]
    params = int(optimizer_param_bytes) // _PARAM_BYTES[precision]
    opt_s = params / profile.estimated_host_adamw_params_per_s() if params else 0.0
    opt_bytes = params * ADAMW_BYTES_PER_PARAM
    device_end = sum(t.total_s for t in graphs)
    events = [e for t in graphs for e in t.events]
    if opt_s and overlap_optimizer and bwd is not None:
        worker = 0.0  # when the host worker is free
        landings = optimizer_landings(backward_gm, bwd, device_end)
        scale = params / max(1, sum(n for _, n, _ in landings))  # the optimizer's count rules
        for landed, numel, name in landings:
            begin = max(worker, landed)
            worker = begin + numel * scale / profile.estimated_host_adamw_params_per_s()
            events.append(TimelineEvent("host_optimizer", name, begin, worker))
        total = max(device_end, worker)
    else:
        if opt_s:
            events.append(TimelineEvent("host_optimizer", "optimizer_step", device_end, device_end + opt_s))
        total = device_end + opt_s
    per_layer: dict[str, LayerTime] = {}
    for t in graphs:
        for key, row in t.per_layer.items():
            per_layer.setdefault(key, LayerTime()).add(row)
    compute_s = sum(t.compute_s for t in graphs)
    flops = sum(t.flops for t in graphs)
    model_flops = flops - sum(t.recompute_flops for t in graphs)
    h2d_bytes = sum(t.h2d_bytes for t in graphs)
    d2h_bytes = sum(t.d2h_bytes for t in graphs)
    lanes = {"compute": compute_s, "h2d": sum(t.h2d_s for t in graphs), "d2h": sum(t.d2h_s for t in graphs),
             "host_optimizer": opt_s}
    achieved = flops / total if total > 0 else 0.0
    return StepTimePrediction(
        profile=profile.name, precision=precision, total_s=total,
        compute_s=compute_s, h2d_s=lanes["h2d"], d2h_s=lanes["d2h"], host_optimizer_s=opt_s,
        exposed_wait_s=sum(t.exposed_wait_s for t in graphs), bottleneck=_bottleneck(lanes),
        flops=flops, model_flops=model_flops, h2d_bytes=h2d_bytes, d2h_bytes=d2h_bytes,
        optimizer_params=params, host_optimizer_bytes=opt_bytes,
        achieved_flops_per_s=achieved,
        mfu=(model_flops / total / device_flops(profile, precision)) if total > 0 else 0.0,
        roofline_s=roofline_floor(compute_s, h2d_bytes, d2h_bytes, opt_bytes, profile),
        tokens=tokens, tokens_per_s=(tokens / total if tokens and total > 0 else None),
        forward=fwd, backward=bwd, per_layer=per_layer, events=events,
    )


def optimizer_landings(backward_gm: fx.GraphModule, backward: LaneTimeline,
                       device_end: float) -> list[tuple[float, int, str]]:
    """(when it is on the host, elements, name) of each gradient the backward returns, in landing
    order: an offloaded gradient (or the host cast of one, bf16) lands when its copy ends in the
    simulated timeline; any other lands when the backward ends."""
    copy_end = {e.name: e.end_s for e in backward.events if e.lane == "d2h"}
    output = next(iter(backward_gm.graph.find_nodes(op="output")))
    landings = []
    for grad in fx.node.map_aggregate(output.args[0], lambda a: a):
        if not isinstance(grad, fx.Node) or not isinstance(grad.meta.get("val"), torch.Tensor):
            continue
        source = grad
        if source.target is not ops.offload and len(source.all_input_nodes) == 1:
            source = source.all_input_nodes[0]  # a host cast of an offloaded bf16 gradient
        landed = copy_end.get(source.name, device_end) if source.target is ops.offload else device_end
        landings.append((landed, int_hint(grad.meta["val"].numel()), grad.name))
    return sorted(landings)


def optimizer_param_bytes(num_params: int, precision: str) -> int:
    """``step_time``'s ``optimizer_param_bytes`` for ``num_params`` parameters: their bytes in
    the precision's device dtype (the host keeps fp32 masters in both modes)."""
    return int(num_params) * _PARAM_BYTES[precision]


def predict_record(record, profile: HardwareProfile, *, tokens: int | None = None, **kw) -> StepTimePrediction:
    """``step_time`` for a ``capture.CompiledGraph`` (its graphs, parameter count, precision)."""
    precision = getattr(record.options, "precision", "fp32")
    kw.setdefault("overlap_optimizer", record.options.overlaps_optimizer)
    if record.options.lowering != "inductor":
        kw.setdefault("fused_pointwise", False)
    return step_time(record.forward, record.backward, profile,
                     optimizer_param_bytes=optimizer_param_bytes(record.num_params, precision),
                     precision=precision, tokens=tokens, **kw)


def chrome_trace(events: list[TimelineEvent]) -> dict:
    """Events as a Chrome trace (chrome://tracing, Perfetto): one row per lane, microseconds."""
    rows = {lane: i for i, lane in enumerate(("compute", "stall", "h2d", "d2h", "host", "host_optimizer"))}
    trace = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": lane}}
             for lane, tid in rows.items()]
    for e in events:
        trace.append({"name": e.name, "ph": "X", "pid": 0, "tid": rows.get(e.lane, len(rows)),
                      "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6, "cat": e.lane})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}
