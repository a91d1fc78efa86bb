"""From k traced layers to N: the device peak, time, FLOPs and bytes of any count of keep /
offload / recompute / "recompute, layer input offloaded" (``STREAMED``) layers, and the plan
megatrain's planner would choose among them.

Time, FLOPs and bytes grow linearly with the layers as in the template planner
(``plan/depth_extrapolation``), but what one more layer adds is measured per policy on one
traced layer's stretch of the program (``digest``), not as the difference of two depths, so
that one trace prices every mix of policies. The peak is no single line: it is the largest of
the program's parts, each linear in N (``full_depth_peak``), since which part peaks depends on
the depth and the mix, and there is no full-depth build to check a line against.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from megacompile.cli.plan_command import POLICIES, RESIDENT, STREAMED
from megacompile.cli.plan_command.digest import Trace
from megacompile.plan.depth_extrapolation import extend_to_depth


@dataclasses.dataclass
class DepthPlan:
    """A count of layers per policy (keep / offload / recompute / STREAMED) over N identical
    layers, evaluated at full depth."""

    counts: dict
    peak_bytes: int
    device_s: float
    lanes_s: dict
    flops: int
    model_flops: int
    h2d_bytes: int
    d2h_bytes: int
    offloaded_activation_bytes: int
    peak_region: str  # "early" (embedding, first layer), "layers" (a later layer) or "head" (head and loss)
    bytes_by_direction: dict = dataclasses.field(default_factory=dict)  # forward/backward h2d/d2h
    base_policy: str = "keep"  # the traced program the additive quantities extend
    # The host optimizer's time the step waits for after the device work: all of it when it
    # runs after the backward, the part the backward does not hide when it overlaps.
    optimizer_exposed_s: float = 0.0
    backward_s: float = 0.0  # the device's backward (what per-layer gradient reductions overlap)

    @property
    def step_s(self) -> float:
        return self.device_s + self.optimizer_exposed_s

    @property
    def summary(self) -> str:
        used = [f"{p} {n}" for p, n in self.counts.items() if n]
        if self.counts.get(RESIDENT):
            return f"keep all {self.counts[RESIDENT]} layers, parameters resident (loaded once per step)"
        if len(used) == 1:
            return f"{used[0].rsplit(' ', 1)[0]} all {sum(self.counts.values())} layers"
        # "; " between policies: the streamed policy's own name has a comma.
        return "per-layer (" + ("; " if any("," in u for u in used) else ", ").join(used) + ")"

    @property
    def recomputed_layers(self) -> int:
        """Layers replayed in the backward (once each: from their saved or reloaded input)."""
        return self.counts.get("recompute", 0) + self.counts.get(STREAMED, 0)


def _uniform_peak(numbers, k: int, n: int) -> tuple[float, str]:
    """Peak of n layers under one policy, phase by phase (see full_depth_peak)."""
    ph = numbers.phases
    f, s = ph["front_loaded"], numbers.saved_device
    candidates = [
        (ph["early_fw"] + n * f, "early"), (ph["early_bw"], "early"),
        (numbers.head_base + n * s, "head"),
    ]
    if n >= 2:
        candidates += [(ph["layer_fw"] + n * f + (n - 1) * (s - f), "layers"), (ph["layer_bw"] + (n - 1) * s, "layers")]
    return max(candidates, key=lambda c: c[0])


def _ordered_peak(trace, runs: list) -> tuple[float, str]:
    """Peak of N layers in forward order ``runs`` = [(policy, count), ...] (see full_depth_peak)."""
    pol = trace.policies
    if len(runs) == 1 and getattr(pol[runs[0][0]], "phases", None):
        return _uniform_peak(pol[runs[0][0]], trace.k, runs[0][1])
    peak, region = pol[runs[0][0]].early_peak, "early"
    saved = 0  # saved device bytes of the layers before the current one
    prev = None
    for p, n in runs:
        s = pol[p].saved_device
        candidates = []
        if prev is None:
            if n >= 2:
                candidates.append(pol[p].layer_base + (n - 1) * s)
        else:
            candidates.append(trace.pair_base.get((prev, p), pol[p].layer_base) + saved)
            if n >= 2:
                candidates.append(pol[p].layer_base + saved + (n - 1) * s)
        saved += n * s
        for c in candidates:
            if c > peak:
                peak, region = c, "layers"
        prev = p
    head = pol[runs[-1][0]].head_base + saved
    if head > peak:
        peak, region = head, "head"
    return peak, region


def full_depth_peak(trace: Trace, counts: dict) -> tuple[int, str]:
    """The device peak of N = sum(counts) layers, from the traced k-layer plans.

    A layer's saved activations stay on the device from its forward to its backward (keep:
    all it saves; recompute: its input only; offload: none), so while layer j runs, forward
    or backward, the device holds the saved bytes of every earlier layer besides its own
    working set; at the head and the loss it holds every layer's. With s_p the saved bytes of
    a layer under policy p, W_p a layer's working set and H_p the head's (both on top of the
    embedding, mask and other glue, and both measured on the traced plan: W_p = peak while
    traced layer j runs - j * s_p, H_p = peak at the head - k * s_p), N layers in order
    p_1 .. p_N peak at

        max( early_{p_1},  max_j (W_{p_j} + sum_{i<j} s_{p_i}),  H_{p_N} + sum_i s_{p_i} )

    where early is the traced plan's peak over the embedding and the first layer. For one
    policy p this is the planner's peak for k layers plus (N-k) x s_p:
    max(early_k, late_k + (N - k) * s_p). Mixed plans put the upgraded layers first (the
    planner's solvers upgrade the earliest layers first) and keep layers last; a layer after
    one of another policy has the working set measured on a two-policy "pair" plan (its
    backward prefetches its predecessor's reloads), and both orders of offload and
    recompute (and streamed layers, "recompute, layer input offloaded") are tried, the largest
    peak taken. ``test_plan_cmd`` checks k=2 extrapolations
    against real k=4 plans, uniform and mixed. A uniform plan is evaluated phase by phase,
    which also covers resident parameters: they are all loaded at the start of the forward
    (every forward point holds N layers' worth) and leave in the backward with their layer.
    Returns (bytes, where: early | layers | head).
    """
    used = [p for p in ("offload", "recompute", STREAMED) if counts.get(p)]
    best = None
    orders = itertools.permutations(used)
    for order in orders:
        runs = [(p, counts[p]) for p in (*order, "keep", RESIDENT) if counts.get(p)]
        found = _ordered_peak(trace, runs)
        if best is None or found[0] > best[0]:
            best = found
    return int(best[0]), best[1]


def evaluate(trace: Trace, counts: dict) -> DepthPlan:
    """Peak, time, FLOPs and bytes of N = sum(counts) layers (policy -> number of layers).

    Every additive quantity X (device seconds, lane seconds, FLOPs, bytes) is a traced k-layer
    program's X plus what each other layer adds: X(N) = X_k(base) + sum_p (n_p - k [p == base]) * x_p.
    The base is the uniform policy's own program for a uniform plan, else the keep program:
    the one-off costs around the layers (exposed copies next to the embedding and the head)
    are those of keep layers there, for the layers next to the head are kept (checked against
    real mixed k=4 programs: exact, where another base is off by up to 1.4%).
    """
    peak, region = full_depth_peak(trace, counts)
    pol = trace.policies
    used = [p for p, n in counts.items() if n]
    base = used[0] if len(used) == 1 else "keep"
    extra = {p: n - (trace.k if p == base else 0) for p, n in counts.items() if n or p == base}

    def total(key: str) -> float:
        return extend_to_depth(pol[base].total[key], ((n, pol[p].per_layer[key]) for p, n in extra.items()))

    lanes = {lane: max(0.0, extend_to_depth(pol[base].total["lanes_s"][lane],
                                            ((n, pol[p].per_layer["lanes_s"][lane]) for p, n in extra.items())))
             for lane in ("compute", "h2d", "d2h")}
    lanes["host_optimizer"] = trace.host_optimizer["seconds"]
    return DepthPlan(
        optimizer_exposed_s=optimizer_exposed_seconds(trace.host_optimizer, total("backward_s")),
        counts=dict(counts), peak_bytes=peak, device_s=max(0.0, total("device_s")), lanes_s=lanes,
        flops=int(total("flops")), model_flops=int(total("model_flops")),
        h2d_bytes=int(total("h2d_bytes")), d2h_bytes=int(total("d2h_bytes")),
        offloaded_activation_bytes=host_activation_bytes(trace, counts),
        peak_region=region,
        bytes_by_direction={key: int(total(key)) for key in ("forward_h2d_bytes", "backward_h2d_bytes",
                                                              "forward_d2h_bytes", "backward_d2h_bytes")},
        base_policy=base, backward_s=max(0.0, total("backward_s")),
    )


def optimizer_exposed_seconds(host_optimizer: dict, backward_s: float) -> float:
    """The host optimizer's time not hidden by the device work, at full depth.

    After the backward (synchronous): all of it. Overlapped (megacompile/optimizer/overlap.py): one worker
    updates each gradient once it lands. Where it keeps up with the landings, what is left at
    the backward's end is the traced program's tail (the last landings), whatever the depth;
    where it falls behind, it is busy from the first landing on and the backward hides only
    what follows that landing. The overlapped ``cost_model.step_time`` of a real program checks
    both (tests/test_plan_cmd.py)."""
    total = host_optimizer["seconds"]
    if not host_optimizer.get("overlapped"):
        return total
    hidden_by = max(0.0, backward_s - host_optimizer["first_landing_s"])
    return min(total, max(host_optimizer["tail_seconds"], total - hidden_by))


def host_activation_bytes(trace, counts: dict) -> int:
    """Activations on the host (pinned) for the step: each offloaded or streamed layer's, and
    the glue's where one uniform policy covers the glue too (mixes keep the glue's)."""
    pol = trace.policies
    used = [p for p, n in counts.items() if n]
    glue = getattr(pol[used[0]], "glue_host", 0) if len(used) == 1 else 0
    return glue + sum(n * pol[p].saved_host for p, n in counts.items() if n)


def _all_counts(num_layers: int, policies=POLICIES):
    """Every count of layers per policy (each policy of ``POLICIES`` the trace has; keep only
    where the others were not built), as {policy: layers} with every policy of POLICIES named."""
    if not set(policies) >= set(POLICIES[:3]):
        yield {"keep": num_layers, **{p: 0 for p in POLICIES[1:]}}
        return
    others = [p for p in POLICIES[1:] if p in policies]

    def split(left: int, names: list):
        if not names:
            yield {}
            return
        for n in range(left + 1):
            for rest in split(left - n, names[1:]):
                yield {names[0]: n, **rest}

    for mix in split(num_layers, others):
        yield {"keep": num_layers - sum(mix.values()), **{p: mix.get(p, 0) for p in POLICIES[1:]}}


def choose_plan(trace, num_layers: int, *, budget: int, host_free: int | None) -> tuple:
    """The plan megatrain's planner would pick for N identical layers, and the smallest plan.

    The planner's order: keep every activation with the parameters resident, if that fits;
    else keep every activation (parameters streamed); otherwise the fastest (predicted step
    time) count of keep / offload / recompute / streamed ("recompute, layer input offloaded")
    layers whose extrapolated peak fits ``budget`` and whose offloaded activations fit
    ``host_free`` host bytes, with the largest peak (the least offload / recompute) among
    equally fast ones, as the planner's ladder breaks ties. A streamed layer is never faster
    than a recompute one (the same replay, plus its input's copies), so it is chosen only
    where the memory it frees (its input on the device, or an offload layer's host bytes) is
    needed to fit.
    Returns (chosen or None, the plan with the smallest peak among those the host can hold
    or None when not every policy was planned, the keep plan).
    """
    def host_ok(plan: DepthPlan) -> bool:
        return host_free is None or plan.offloaded_activation_bytes <= host_free

    keep = evaluate(trace, {"keep": num_layers, **{p: 0 for p in POLICIES[1:]}})
    smallest = None
    fitting = []
    for counts in _all_counts(num_layers, trace.policies) if trace.complete else ():
        plan = evaluate(trace, counts)
        if not host_ok(plan):
            continue
        if smallest is None or plan.peak_bytes < smallest.peak_bytes:
            smallest = plan
        if plan.peak_bytes <= budget:
            fitting.append(plan)
    if RESIDENT in trace.policies:
        resident = evaluate(trace, {RESIDENT: num_layers})
        if resident.peak_bytes <= budget:
            return resident, smallest, keep
    if keep.peak_bytes <= budget:
        return keep, smallest, keep
    if not fitting:
        return None, smallest, keep
    # The fastest; among plans as fast (within 0.1%: keep and offload layers often cost the same
    # when the link hides the copies, recompute and streamed layers too), the least aggressive
    # one (largest peak, fewest recomputed layers, least on the host), as the planner's ladder
    # breaks ties: no offload or streamed layer that buys nothing.
    fastest = min(p.step_s for p in fitting)
    best = min((p for p in fitting if p.step_s <= fastest * 1.001),
               key=lambda p: (-p.peak_bytes, p.recomputed_layers, p.offloaded_activation_bytes, p.step_s))
    return best, smallest, keep


def _min_peak(trace, num_layers: int, host_free: int | None) -> int:
    """The smallest extrapolated peak of any count of layers per policy (memory only)."""
    best = None
    for counts in _all_counts(num_layers, trace.policies):
        if host_free is not None and host_activation_bytes(trace, counts) > host_free:
            continue
        peak, _ = full_depth_peak(trace, counts)
        best = peak if best is None else min(best, peak)
    return best if best is not None else math.inf
