"""The time half of the cost model: FLOPs, bytes, the lane simulation and the step prediction.

Hand-built programs use a profile with round numbers (1 TFLOP/s, 1 GB/s each way, no launch
overhead), so every expected time below is arithmetic done in the comment next to it.
"""
import dataclasses

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

from megacompile.capture.records import recording
from megacompile.core import ops
from megacompile.core.node_info import info
from megacompile.plan import cost_model as cm
from megacompile.plan.hardware import HardwareProfile, get_profile

aten = torch.ops.aten
MS = 1e-3

ROUND = HardwareProfile(
    name="round", description="test profile with round numbers",
    device_flops_fp32=1e12, device_flops_bf16=2e12, hbm_bytes=10**10, hbm_bandwidth=1e12,
    h2d_bandwidth=1e9, d2h_bandwidth=1e9, host_memory_bandwidth=1e10, host_cores=1,
    host_adamw_params_per_s=1e9,
)


def _nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


# --- FLOPs and bytes ----------------------------------------------------------------------
def test_node_flops_of_matmuls_by_hand():
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    gm = make_fx(lambda a, b: torch.mm(a, b), tracing_mode="fake")(a, b)
    assert cm.node_flops(_nodes(gm, aten.mm.default)[0]) == 2 * 16 * 8 * 32

    bias = torch.randn(8)
    gm = make_fx(lambda c, a, b: torch.addmm(c, a, b), tracing_mode="fake")(bias, a, b)
    assert cm.node_flops(_nodes(gm, aten.addmm.default)[0]) == 2 * 16 * 8 * 32

    x, y = torch.randn(3, 16, 32), torch.randn(3, 32, 8)
    gm = make_fx(lambda x, y: torch.bmm(x, y).relu(), tracing_mode="fake")(x, y)
    assert cm.node_flops(_nodes(gm, aten.bmm.default)[0]) == 3 * 2 * 16 * 8 * 32
    # Pointwise ops, views and placeholders count nothing.
    assert cm.node_flops(_nodes(gm, aten.relu.default)[0]) == 0
    gm = make_fx(lambda a: a.t(), tracing_mode="fake")(a)
    assert all(cm.node_flops(n) == 0 for n in gm.graph.nodes)


def test_causal_attention_counts_the_scores_a_causal_kernel_computes():
    """is_causal=True with equal lengths: (S + 1) / 2S of the full count, forward and backward
    (torch's formula counts the whole score matrix); a mask, or no causality, the full count."""
    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    S = 64
    full = 4 * 2 * 4 * S * S * 16  # QK^T and PV: 2 * 2 * B * H * S * S * D

    def attention(q, k, v, causal, masked=False):
        mask = torch.ones(S, S, dtype=torch.bool).tril() if masked else None
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return torch.autograd.grad(out.sum(), (q, k, v))

    def flops(gm):
        counted = {n.target.name(): cm.node_flops(n) for n in gm.graph.nodes
                   if n.op == "call_function" and "scaled_dot_product" in str(n.target)}
        assert len(counted) == 2, counted  # the forward and its backward
        fwd = next(f for name, f in counted.items() if not name.endswith("_backward"))
        bwd = next(f for name, f in counted.items() if name.endswith("_backward"))
        return fwd, bwd

    fwd, bwd = flops(make_fx(lambda q, k, v: attention(q, k, v, False), tracing_mode="fake")(q, k, v))
    assert fwd == full and bwd > fwd
    causal_fwd, causal_bwd = flops(make_fx(lambda q, k, v: attention(q, k, v, True), tracing_mode="fake")(q, k, v))
    assert causal_fwd == int(full * (S + 1) / (2 * S)) and causal_bwd == int(bwd * (S + 1) / (2 * S))
    assert flops(make_fx(lambda q, k, v: attention(q, k, v, False, True), tracing_mode="fake")(q, k, v))[0] == full


def test_node_flops_with_symbolic_shapes_use_the_example_sizes():
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    gm = make_fx(lambda a, b: torch.mm(a, b), tracing_mode="symbolic")(a, b)
    mm = _nodes(gm, aten.mm.default)[0]
    assert isinstance(mm.meta["val"].shape[0], torch.SymInt)
    assert cm.node_flops(mm) == 2 * 16 * 8 * 32
    assert cm.node_bytes_touched(mm) == (16 * 32 + 32 * 8 + 16 * 8) * 4


def test_linear_forward_flops_match_flop_counter_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))
    x = torch.randn(5, 7, 32)
    names, params = zip(*model.named_parameters())
    gm = make_fx(lambda x, *ps: torch.func.functional_call(model, dict(zip(names, ps)), (x,)),
                 tracing_mode="fake")(x, *params)
    ours = sum(cm.node_flops(n) for n in gm.graph.nodes)
    with FlopCounterMode(display=False) as counter:
        model(x)
    assert ours == counter.get_total_flops() == 2 * 35 * (32 * 64 + 64 * 48 + 48 * 8)


def test_remembered_flops_follow_node_copies_and_are_dropped_when_the_value_changes():
    """The planner counts a joint graph's FLOPs once (``remember_flops``): copies of a node
    into a candidate's graphs reuse the count; a node whose result changed is counted again."""
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    gm = make_fx(lambda a, b: torch.mm(a, b).relu(), tracing_mode="fake")(a, b)
    cm.remember_flops(gm)
    mm = _nodes(gm, aten.mm.default)[0]
    assert mm.meta["megatrain_flops"][1] == 2 * 16 * 8 * 32
    copy = fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        env[n] = copy.node_copy(n, lambda x: env[x])
    copied = env[mm]
    assert cm.node_flops(copied) == 2 * 16 * 8 * 32
    # The same op on other sizes (a pass replaced the result): counted from its tensors.
    with FakeTensorMode():
        copied.meta = dict(copied.meta, val=torch.empty(16, 4))
        for arg, shape in zip(copied.args, ((16, 32), (32, 4))):
            arg.meta = dict(arg.meta, val=torch.empty(*shape))
    assert cm.node_flops(copied) == 2 * 16 * 4 * 32


def test_op_without_formula_is_counted_through_its_decomposition():
    """aten.linear has no formula; FlopCounterMode counts what it decomposes to (on meta)."""
    with FakeTensorMode():
        x, w, b = torch.empty(4, 16), torch.empty(8, 16), torch.empty(8)
        out = aten.linear.default(x, w, b)
    g = fx.Graph()
    phs = []
    for name, val in (("x", x), ("w", w), ("b", b)):
        ph = g.placeholder(name)
        ph.meta["val"] = val
        phs.append(ph)
    lin = g.call_function(aten.linear.default, tuple(phs))
    lin.meta["val"] = out
    assert cm.node_flops(lin) == 2 * 4 * 8 * 16
    assert cm.node_bytes_touched(lin) == (4 * 16 + 8 * 16 + 8 + 4 * 8) * 4


def test_node_bytes_touched():
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    bias = torch.randn(8)
    gm = make_fx(lambda c, a, b: torch.addmm(c, a, b).t().relu(), tracing_mode="fake")(bias, a, b)
    addmm = _nodes(gm, aten.addmm.default)[0]
    assert cm.node_bytes_touched(addmm) == (8 + 16 * 32 + 32 * 8 + 16 * 8) * 4
    assert cm.node_bytes_touched(_nodes(gm, aten.t.default)[0]) == 0  # a view
    assert cm.node_bytes_touched(_nodes(gm, aten.relu.default)[0]) == 2 * 16 * 8 * 4
    # A broadcast input (stride 0) is read once per distinct element.
    gm = make_fx(lambda a, c: a[:, :8] + c.expand(16, 8), tracing_mode="fake")(a, bias)
    add = _nodes(gm, aten.add.Tensor)[0]
    assert cm.node_bytes_touched(add) == (16 * 8 + 8 + 16 * 8) * 4


# --- hand-built programs ------------------------------------------------------------------
class Program:
    """Builds a rewritten program by hand: placeholders, memory ops and matmuls, with fake
    tensors in meta["val"] and NodeInfo, as the passes leave them."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()

    def _node(self, target, args, layer=None, placement="device"):
        node = self.graph.call_function(target, args)
        vals = fx.node.map_arg(args, lambda n: n.meta["val"])
        with self.mode:
            node.meta["val"] = target(*vals)
        ni = info(node)
        ni.layer, ni.placement = layer, placement
        return node

    def input(self, name, shape, placement="device", layer=None):
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape)
        ni = info(node)
        ni.role, ni.layer, ni.placement = "param" if placement == "host" else "input", layer, placement
        return node

    def load(self, host, layer=None):
        return self._node(ops.load, (host, host.name), layer)

    def offload(self, t, layer=None):
        return self._node(ops.offload, (t, t.name), layer, placement="host")

    def wait(self, t, layer=None):
        return self._node(ops.wait, (t,), layer)

    def evict(self, t, layer=None):
        return self._node(ops.evict, (t,), layer)

    def mm(self, a, b, layer=None):
        return self._node(aten.mm.default, (a, b), layer)

    def done(self, *outputs) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def _sim(gm, profile=ROUND, **kw):
    kw.setdefault("launch_overhead", 0.0)
    return cm.simulate(gm, profile, **kw)


# A 1000x1000x1000 matmul: 2e9 FLOP = 2 ms at 1 TFLOP/s (its 12 MB at 1 TB/s take 12 us).
# A 500x500 fp32 weight: 1 MB = 1 ms over a 1 GB/s link.
def test_load_issued_before_a_long_compute_op_is_hidden():
    p = Program()
    x, a = p.input("x", (1000, 1000)), p.input("a", (1000, 1000))
    w = p.input("w", (500, 500), placement="host", layer="layers.1")
    lw = p.load(w, layer="layers.1")
    y = p.mm(x, a, layer="layers.0")
    p.wait(lw, layer="layers.1")
    z = p.mm(lw, lw, layer="layers.1")  # 2.5e8 FLOP = 0.25 ms
    p.evict(lw, layer="layers.1")
    tl = _sim(p.done(y, z))
    assert tl.exposed_wait_s == 0
    assert tl.total_s == pytest.approx(2.25 * MS)
    assert (tl.compute_s, tl.h2d_s) == (pytest.approx(2.25 * MS), pytest.approx(1 * MS))
    assert tl.h2d_bytes == 10**6 and tl.loads == 1
    assert tl.flops == 2 * 10**9 + 2 * 500**3
    assert tl.bottleneck == "compute"
    assert tl.per_layer["layers.0"].compute_s == pytest.approx(2 * MS)
    assert tl.per_layer["layers.1"].compute_s == pytest.approx(0.25 * MS)
    assert tl.per_layer["layers.1"].h2d_s == pytest.approx(1 * MS)
    events = {(e.lane, e.name): (e.start_s, e.end_s) for e in tl.events}
    assert events[("h2d", lw.name)] == pytest.approx((0, 1 * MS))
    assert events[("compute", y.name)] == pytest.approx((0, 2 * MS))
    assert events[("compute", z.name)] == pytest.approx((2 * MS, 2.25 * MS))
    # All of a NodeCost is there for every op.
    for node in p.graph.nodes:
        if node.op == "call_function":
            c = node.meta[cm.COST_KEY]
            assert isinstance(c, cm.NodeCost) and c.profile == "round"
    assert lw.meta[cm.COST_KEY].lane == "h2d" and y.meta[cm.COST_KEY].lane == "compute"


def _exposed_program():
    p = Program()
    x, a = p.input("x", (1000, 1000)), p.input("a", (1000, 1000))
    w = p.input("w", (500, 500), placement="host")
    lw = p.load(w)
    p.wait(lw)  # nothing to hide it behind
    y = p.mm(x, a)
    p.evict(lw)
    return p.done(y)


def test_load_waited_immediately_is_fully_exposed():
    tl = _sim(_exposed_program())
    assert tl.exposed_wait_s == pytest.approx(1 * MS)
    assert tl.total_s == pytest.approx(3 * MS)
    assert [e.lane for e in tl.events] == ["h2d", "stall", "compute"]


def test_h2d_lane_is_fifo():
    p = Program()
    w1 = p.input("w1", (500, 500), placement="host")
    w2 = p.input("w2", (500, 500), placement="host")
    l1, l2 = p.load(w1), p.load(w2)
    p.wait(l2)  # l2 queues behind l1: lands at 2 ms
    p.wait(l1)
    p.evict(l1)
    p.evict(l2)
    tl = _sim(p.done())
    h2d = [(e.name, e.start_s, e.end_s) for e in tl.events if e.lane == "h2d"]
    assert h2d == [(l1.name, 0, pytest.approx(1 * MS)), (l2.name, pytest.approx(1 * MS), pytest.approx(2 * MS))]
    assert tl.exposed_wait_s == pytest.approx(2 * MS)
    assert tl.total_s == pytest.approx(2 * MS)
    assert tl.bottleneck == "h2d"


def test_load_is_issued_only_when_the_compute_lane_reaches_it():
    p = Program()
    x, a = p.input("x", (1000, 1000)), p.input("a", (1000, 1000))
    w = p.input("w", (500, 500), placement="host")
    y = p.mm(x, a)  # 0 -> 2 ms
    lw = p.load(w)  # 2 -> 3 ms
    p.wait(lw)
    p.evict(lw)
    tl = _sim(p.done(y))
    assert tl.exposed_wait_s == pytest.approx(1 * MS)
    assert tl.total_s == pytest.approx(3 * MS)


def test_offload_runs_after_its_producer_and_the_final_wait_blocks():
    p = Program()
    x, a = p.input("x", (1000, 1000)), p.input("a", (1000, 1000))
    y = p.mm(x, a)  # 0 -> 2 ms
    o = p.offload(y)  # 4 MB: 2 -> 6 ms on d2h
    p.evict(y)
    h, b = p.input("h", (1000, 500)), p.input("b", (500, 1000))
    y2 = p.mm(h, b)  # 1e9 FLOP: 2 -> 3 ms, overlapped with the offload
    p.wait(o)  # compute lane idles 3 -> 6 ms
    tl = _sim(p.done(o, y2))
    d2h = [(e.start_s, e.end_s) for e in tl.events if e.lane == "d2h"]
    assert d2h == [(pytest.approx(2 * MS), pytest.approx(6 * MS))]
    assert tl.exposed_wait_s == pytest.approx(3 * MS)
    assert tl.total_s == pytest.approx(6 * MS)
    assert tl.d2h_bytes == 4 * 10**6 and tl.offloads == 1 and tl.bottleneck == "d2h"


def test_copy_time_scales_inversely_with_link_bandwidth():
    gm = _exposed_program()
    base = _sim(gm)
    for factor in (2, 4):
        slow = dataclasses.replace(ROUND, h2d_bandwidth=ROUND.h2d_bandwidth / factor)
        tl = _sim(gm, slow)
        assert tl.h2d_s == pytest.approx(base.h2d_s * factor)
        assert tl.total_s == pytest.approx(2 * MS + factor * 1 * MS)
    fast_device = dataclasses.replace(ROUND, device_flops_fp32=2e12)
    assert _sim(gm, fast_device).compute_s == pytest.approx(1 * MS)


def test_synchronous_copies_serialize_on_the_compute_lane():
    p = Program()
    x, a = p.input("x", (1000, 1000)), p.input("a", (1000, 1000))
    w = p.input("w", (500, 500), placement="host")
    lw = p.load(w)
    y = p.mm(x, a)
    p.wait(lw)
    p.evict(lw)
    gm = p.done(y)
    assert _sim(gm).total_s == pytest.approx(2 * MS)
    assert _sim(gm, synchronous_copies=True).total_s == pytest.approx(3 * MS)
    # The CPU stand-in device copies synchronously, so its profile does by default.
    standin = dataclasses.replace(ROUND, name="cpu-standin")
    assert _sim(gm, standin).total_s == pytest.approx(3 * MS)


def test_launch_overhead_defaults_per_profile():
    gm = _exposed_program()
    mm = _nodes(gm, aten.mm.default)[0]
    cm.annotate_costs(gm, ROUND)
    assert mm.meta[cm.COST_KEY].time_s == pytest.approx(2 * MS + cm.GPU_LAUNCH_OVERHEAD_S)
    cm.annotate_costs(gm, get_profile("cpu-standin"))
    expected = 2e9 / get_profile("cpu-standin").device_flops_fp32 + cm.CPU_STANDIN_LAUNCH_OVERHEAD_S
    assert mm.meta[cm.COST_KEY].time_s == pytest.approx(expected)
    for node in gm.graph.nodes:  # memory ops carry no launch overhead
        if node.target in (ops.wait, ops.evict):
            assert node.meta[cm.COST_KEY].time_s == 0


def test_step_time_chains_forward_backward_and_host_optimizer():
    fwd, bwd = _exposed_program(), _exposed_program()  # 3 ms each
    pred = cm.step_time(fwd, bwd, ROUND, optimizer_param_bytes=4 * 10**6, tokens=1000, launch_overhead=0.0)
    # 1e6 fp32 params at 1e9 params/s: 1 ms, after the backward.
    assert pred.host_optimizer_s == pytest.approx(1 * MS)
    assert pred.total_s == pytest.approx(7 * MS)
    assert pred.optimizer_params == 10**6
    assert pred.lane_s() == pytest.approx({"compute": 4 * MS, "h2d": 2 * MS, "d2h": 0.0, "host_optimizer": 1 * MS})
    assert pred.bottleneck == "compute"
    assert pred.flops == pred.model_flops == 4 * 10**9
    assert pred.achieved_flops_per_s == pytest.approx(4e9 / 7e-3)
    assert pred.mfu == pytest.approx(4e9 / 7e-3 / 1e12)
    assert pred.tokens_per_s == pytest.approx(1000 / 7e-3)
    # Roofline: compute 4 ms vs 2 MB / 1 GB/s = 2 ms vs 28 MB / 10 GB/s = 2.8 ms.
    assert pred.roofline_s == pytest.approx(4 * MS)
    opt = [e for e in pred.events if e.lane == "host_optimizer"]
    assert opt == [cm.TimelineEvent("host_optimizer", "optimizer_step", pytest.approx(6 * MS), pytest.approx(7 * MS))]
    bwd_events = [e for e in pred.events if e.lane == "compute"]
    assert bwd_events[1].start_s == pytest.approx(4 * MS)  # backward starts when the forward ended
    trace = cm.chrome_trace(pred.events)
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X") == len(pred.events)
    assert "bottleneck: compute" in str(pred)


def test_overlapped_host_optimizer_updates_each_gradient_as_it_lands():
    """overlap_optimizer=True models what the runtime does (megacompile/optimizer/overlap.py): one host
    worker updates each returned gradient, in landing order, once its offload has landed; the
    step ends when both the backward and the worker are done."""
    fwd = Program()
    w = fwd.input("w", (500, 500))
    forward = fwd.done(fwd.mm(w, w))  # 0.25 ms
    p = Program()
    x, a, v = p.input("x", (1000, 1000)), p.input("a", (1000, 1000)), p.input("v", (500, 500))
    g1 = p.mm(v, v)  # 0.25 ms
    o1 = p.offload(g1)  # 1 MB: 1 ms on the d2h lane
    y = p.mm(x, a)  # 2 ms, beside the copy
    g2 = p.mm(v, v)
    o2 = p.offload(g2)
    del y
    backward = p.done(o1, o2)
    kw = dict(optimizer_param_bytes=2 * 500 * 500 * 4, launch_overhead=0.0)  # 0.25 ms of AdamW each
    sync = cm.step_time(forward, backward, ROUND, **kw)
    over = cm.step_time(forward, backward, ROUND, overlap_optimizer=True, **kw)
    # Backward (from 0.25 ms): g1 lands at 1.5 ms, g2 at 3.75 ms, the backward ends at 3.75 ms.
    assert sync.total_s == pytest.approx(4.25 * MS)
    updates = [(e.start_s, e.end_s) for e in over.events if e.lane == "host_optimizer"]
    assert updates == [pytest.approx((1.5 * MS, 1.75 * MS)), pytest.approx((3.75 * MS, 4.0 * MS))]
    assert over.total_s == pytest.approx(4.0 * MS)
    assert over.host_optimizer_s == sync.host_optimizer_s == pytest.approx(0.5 * MS)
    # Gradients that land early hide their updates entirely when the worker keeps up.
    landings = cm.optimizer_landings(backward, over.backward, 3.75 * MS)
    assert [round(t / MS, 6) for t, _, _ in landings] == [1.5, 3.75]
    assert [n for _, n, _ in landings] == [250_000, 250_000]


def test_roofline_floor():
    # compute 1 ms; 3 MB at 1 GB/s = 3 ms; 1 MB = 1 ms; 20 MB at 10 GB/s = 2 ms.
    assert cm.roofline_floor(1 * MS, 3e6, 1e6, 2e7, ROUND) == pytest.approx(3 * MS)
    assert cm.roofline_floor(5 * MS, 3e6, 1e6, 2e7, ROUND) == pytest.approx(5 * MS)
    assert cm.roofline_floor(0, 0, 0, 5e7, ROUND) == pytest.approx(5 * MS)
    assert cm.roofline_floor(0, 0, 4e6, 0, ROUND) == pytest.approx(4 * MS)


def test_pointwise_chains_are_priced_as_the_fused_kernels_inductor_makes():
    """RMSNorm before a matmul: mean(x*x), rsqrt, x*r. Fused, x is read twice (the reduction's
    kernel and the scaling's), only the normed result is written (the matmul reads it), and
    only the op that writes it launches; eagerly every op reads and writes its own tensors.
    Another layer's pointwise op does not fuse with them."""
    p = Program()
    x, w = p.input("x", (1000, 1000)), p.input("w", (1000, 1000))
    sq = p._node(aten.mul.Tensor, (x, x), "layers.0")
    ms = p._node(aten.mean.dim, (sq, [-1], True), "layers.0")
    eps = p._node(aten.add.Tensor, (ms, 1e-6), "layers.0")
    r = p._node(aten.rsqrt.default, (eps,), "layers.0")
    normed = p._node(aten.mul.Tensor, (x, r), "layers.0")
    y = p.mm(normed, w, "layers.0")
    z = p._node(aten.relu.default, (normed,), "layers.1")
    gm = p.done(y, z)
    big, small = 1000 * 1000 * 4, 1000 * 4
    overhead = 1e-6
    fused = _sim(gm, launch_overhead=overhead, fused_pointwise=True)
    fused_costs = {n.name: cm.cost(n) for n in gm.graph.nodes if n.op == "call_function"}
    eager = _sim(gm, launch_overhead=overhead, fused_pointwise=False)
    assert fused_costs[sq.name].bytes_touched == big and fused_costs[sq.name].time_s == big / 1e12
    assert [fused_costs[n.name].bytes_touched for n in (ms, eps, r)] == [0, 0, 0]
    assert fused_costs[normed.name].bytes_touched == 2 * big  # reads x, writes the result
    assert fused_costs[normed.name].time_s == pytest.approx(2 * big / 1e12 + overhead)
    assert fused_costs[z.name].bytes_touched == 2 * big  # layers.1: its own kernel
    eager_pointwise = (2 * big) + (big + small) + 2 * small + 2 * small + (big + small + big)
    pointwise_fused = big + 2 * big + 2 * big
    mm_s = 2e9 / 1e12 + overhead
    assert fused.compute_s == pytest.approx(mm_s + pointwise_fused / 1e12 + 2 * overhead)
    assert eager.compute_s == pytest.approx(mm_s + (eager_pointwise + 2 * big) / 1e12 + 6 * overhead)


# --- a real rewritten program ---------------------------------------------------------------
def _mlp_step(**options):
    """(record with a backward, model, loss_fn, batch) of one compiled step of the reference MLP
    on the CPU stand-in, lowered eagerly."""
    from reference_models import MLP, REFERENCE_MODELS, make_training_step

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP(depth=3)
    _, make_batch, loss_fn = REFERENCE_MODELS["mlp"]
    step, _ = make_training_step(model, loss_fn)
    step = torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager", **options})
    x, y = make_batch(torch.Generator().manual_seed(1))
    with recording() as compiled:  # a module fixture runs outside the per-test recording
        step(x, y)
    torch._dynamo.reset()
    return [r for r in compiled if r.backward is not None][-1], model, loss_fn, (x, y)


@pytest.fixture(scope="module")
def mlp_program():
    record, model, loss_fn, (x, y) = _mlp_step()
    # The same computation in eager mode, counted by FlopCounterMode.
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(x), y).backward()
    return record, counter.get_total_flops(), sum(p.numel() * 4 for p in model.parameters())


def test_step_time_on_a_rewritten_program(mlp_program):
    record, eager_flops, param_bytes = mlp_program
    profile = get_profile("h100-sxm")
    # Lowered eagerly: no op fuses (predict_record reads that from the record's options).
    pred = cm.step_time(record.forward, record.backward, profile, optimizer_param_bytes=param_bytes, tokens=16,
                        fused_pointwise=False)
    assert pred.bottleneck in cm.STEP_LANES
    for lane, seconds in pred.lane_s().items():
        assert seconds > 0, lane
    assert pred.total_s >= max(pred.lane_s().values())
    assert pred.total_s >= pred.roofline_s > 0
    assert pred.flops == eager_flops  # the rewritten programs compute what eager does

    loads = [n for gm in (record.forward, record.backward) for n in _nodes(gm, ops.load)]
    offloads = [n for gm in (record.forward, record.backward) for n in _nodes(gm, ops.offload)]
    assert pred.forward.loads + pred.backward.loads == len(loads)
    assert pred.forward.offloads + pred.backward.offloads == len(offloads)
    load_bytes = sum(info(n).nbytes_hint for n in loads)
    assert pred.h2d_bytes == load_bytes
    assert pred.h2d_s == pytest.approx(load_bytes / profile.h2d_bandwidth)
    assert pred.d2h_bytes == sum(info(n).nbytes_hint for n in offloads)
    assert pred.optimizer_params == param_bytes // 4
    assert pred.host_optimizer_s == pytest.approx(param_bytes / 4 / profile.estimated_host_adamw_params_per_s())
    assert set(pred.per_layer) >= {"layers.0", "layers.1", "layers.2", "head"}
    assert sum(r.h2d_s for r in pred.per_layer.values()) == pytest.approx(pred.h2d_s)

    recorded = cm.predict_record(record, profile, tokens=16)
    assert recorded.total_s == pytest.approx(pred.total_s)


@pytest.fixture(scope="module")
def bf16_mlp_record():
    record, model, _, _ = _mlp_step(precision="bf16")
    return record, sum(p.numel() * 2 for p in model.parameters())


def test_host_casts_the_runtime_serves_cost_no_time(bf16_mlp_record):
    """A weight's bf16 cast is served from its persistent copy (runtime/weight_copies.py): the
    overlapped optimizer rewrites the copy in its update, otherwise the step's first load of the
    weight does. A landed bf16 gradient's widening cast does not run where the overlapped
    optimizer takes the gradient. The other host ops cost bytes / host memory bandwidth."""
    from megacompile.core.host_ops import is_host_op, is_weight_copy_cast, widened_copy

    record, param_bytes = bf16_mlp_record
    profile = get_profile("h100-sxm")
    cost = lambda n: n.meta[cm.COST_KEY].time_s  # noqa: E731
    fwd_host = [n for n in record.forward.graph.nodes if is_host_op(n)]
    bwd_host = [n for n in record.backward.graph.nodes if is_host_op(n)]
    fwd_casts = [n for n in fwd_host if is_weight_copy_cast(n)]
    bwd_casts = [n for n in bwd_host if is_weight_copy_cast(n)]
    widens = [n for n in bwd_host if widened_copy(n) is not None]
    assert len(fwd_casts) >= 3 and len(widens) >= 3  # a cast per linear weight and bias; a widen per gradient
    kw = dict(optimizer_param_bytes=param_bytes, precision="bf16")

    sync = cm.step_time(record.forward, record.backward, profile, **kw)
    cast_in_forward = {info(n.args[0]).source for n in fwd_casts}
    first_in_backward = {}
    for n in bwd_casts:
        first_in_backward.setdefault(info(n.args[0]).source, n)
    others_fwd = [n for n in fwd_host if n not in fwd_casts]
    others_bwd = [n for n in bwd_host if n not in bwd_casts]
    assert sync.forward.host_s == pytest.approx(sum(map(cost, fwd_casts + others_fwd)))
    assert all(cost(n) > 0 for n in fwd_casts + widens)
    assert sync.backward.host_s == pytest.approx(
        sum(map(cost, others_bwd)) + sum(cost(n) for s, n in first_in_backward.items() if s not in cast_in_forward))

    over = cm.step_time(record.forward, record.backward, profile, overlap_optimizer=True, **kw)
    assert over.forward.host_s == pytest.approx(sum(map(cost, others_fwd)))
    assert over.backward.host_s == pytest.approx(sum(cost(n) for n in others_bwd if n not in widens))
    assert not any(e.lane == "host" and e.name in {n.name for n in fwd_casts + bwd_casts + widens}
                   for e in over.events)
    assert over.total_s < sync.total_s


def test_tighter_link_predicts_a_slower_step(mlp_program):
    record, _, param_bytes = mlp_program
    base = get_profile("h100-sxm")
    totals = []
    for bandwidth in (50e9, 5e9, 5e8, 5e7, 5e6):
        profile = dataclasses.replace(base, h2d_bandwidth=bandwidth, d2h_bandwidth=bandwidth)
        totals.append(cm.step_time(record.forward, record.backward, profile,
                                   optimizer_param_bytes=param_bytes).total_s)
    assert all(a <= b for a, b in zip(totals, totals[1:])), totals
    assert totals[-1] > 10 * totals[0]
    slowest = dataclasses.replace(base, h2d_bandwidth=5e6, d2h_bandwidth=5e6)
    pred = cm.step_time(record.forward, record.backward, slowest, optimizer_param_bytes=param_bytes)
    assert pred.bottleneck == "h2d"


def test_cpu_attention_is_counted_as_attention():
    """Graphs are traced on the host, where sdpa becomes the CPU flash op that FlopCounterMode
    leaves out; on the GPU it is flash attention, so it is costed with the sdpa formulas."""
    import torch.nn.functional as F

    b, h, s, d = 2, 4, 16, 8
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))

    def fwd_bwd(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out.sum(), (q, k, v))

    gm = make_fx(fwd_bwd, tracing_mode="fake")(q, k, v)
    counted = {str(n.target): cm.node_flops(n) for n in gm.graph.nodes if cm.node_flops(n)}
    causal = (s + 1) / (2 * s)  # the scores at k <= q only (test below)
    assert counted == {
        "aten._scaled_dot_product_flash_attention_for_cpu.default": int(4 * b * h * s * s * d * causal),  # QK^T, PV
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": int(10 * b * h * s * s * d * causal),
    }
