"""What one traced k-layer program says per layer: for each uniform policy, the program's
numbers (peak by part, device seconds by lane, FLOPs, bytes each way) and what one more
steady-state layer adds to them, measured on the layers' own regions of the program; and the
per-layer quantities that must be identical for the layers to count as repeats."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from megacompile.cli.plan_command import (
    BASIC_POLICIES,
    DECODER_LAYER,
    DEVICE_PARAM_BYTES,
    PAIRS,
    POLICIES,
    RESIDENT,
    STREAMED,
    PlanError,
)
from megacompile.core import ops
from megacompile.core.host_ops import is_host_op
from megacompile.core.node_info import has_info, info, layer_of_module_path
from megacompile.plan import cost_model
from megacompile.plan import memory_estimate as plan_mod
from megacompile.plan.cost_model import COST_KEY
from megacompile.plan.hardware import HardwareProfile
from megacompile.plan.memory_estimate import storage_root


@dataclasses.dataclass
class PolicyNumbers:
    """One uniform policy's traced k-layer program, and what one more layer adds to it."""

    policy: str
    # Memory (bytes). peak: the plan's peak for k layers; early/late: its peak before / after
    # the point where the extra N-k layers are inserted (see full_depth.full_depth_peak); saved_device:
    # activations one layer keeps on the device from its forward to its backward;
    # saved_host: activations one layer offloads to the host for that time.
    peak: int
    early_peak: int
    late_peak: int
    saved_device: int
    saved_host: int
    # The parts of the peak model (full_depth.full_depth_peak): a layer's working set when every earlier
    # layer's saved bytes are excluded, and the head's / loss's, both on top of the glue.
    layer_base: int
    head_base: int
    # The same for one policy over all layers, by phase (see full_depth._uniform_peak): front_loaded
    # (bytes per layer live from the start of the forward: resident parameters), early_fw,
    # early_bw, layer_fw, layer_bw.
    phases: dict
    # Where each part's peak is: part (early | layers | head) -> (forward | backward, layer, node).
    where: dict
    # The k-layer program: device seconds (forward + backward), busy seconds per lane,
    # FLOPs (executed, and without recompute), bytes each way.
    total: dict
    # What one more layer adds: the same keys. Time is the compute lane's span over a
    # steady-state layer's region of the program (its ops, the untagged ops among them such
    # as gradient accumulation, and its waits), or its copy lane's busy time where that is
    # longer (the link is then the bottleneck).
    per_layer: dict
    # Activations the glue (embedding, mask, rotary tables, the head's input) offloads beyond
    # what the keep program sends to the host: a uniform offload or streamed plan's one-off share.
    glue_host: int = 0


@dataclasses.dataclass
class Trace:
    """One meta-device trace of k layers at one (batch, seq_len), digested."""

    k: int
    batch: int
    seq_len: int
    precision: str
    policies: dict  # policy -> PolicyNumbers
    pair_base: dict  # (earlier policy, later policy) -> working set of the later layer (see PolicyNumbers)
    param_bytes_by_layer: dict
    layer_checks: dict  # quantity -> per-layer values (identical when the repeat holds)
    host_optimizer: dict  # seconds and bytes of the host AdamW over all N layers' parameters
    trace_s: float
    prediction: Any = None  # cost_model.StepTimePrediction of the traced keep program
    token_chunks: int | None = None  # each layer's per-token runs in this many chunks (None: whole)

    @property
    def complete(self) -> bool:
        """Whether every policy was built (else only keep: it fits, nothing else is needed).
        ``STREAMED`` is built wherever recompute saves anything, so it is not required here."""
        return all(p in self.policies for p in BASIC_POLICIES)


def _layer_of(node) -> str | None:

    return info(node).layer if has_info(node) else None


def _is_compute(node) -> bool:
    """A device compute op. Host ops are not: under bf16 the weights' host casts run ahead of
    the loads, so a layer's first cast is no mark of where its compute starts."""
    return node.op == "call_function" and has_info(node) and info(node).role == "compute" and not is_host_op(node)


def _regions(gm, decoder: list[str]) -> dict[str, tuple[int, int]]:
    """Node index range of each decoder layer's stretch of a program, by position.

    A layer's region runs from its first compute op to the first compute op of the next
    layer (or of the next tagged non-decoder module: the final norm in the forward, the
    embedding in the backward). Ops in between that carry no layer (gradient accumulation of
    the residual stream, for one) belong to the region they sit in.
    """
    nodes = list(gm.graph.nodes)
    firsts: dict[str, int] = {}
    for i, node in enumerate(nodes):
        layer = _layer_of(node)
        if layer in decoder and layer not in firsts and _is_compute(node):
            firsts[layer] = i
    order = sorted(firsts, key=firsts.get)
    if len(order) != len(decoder):
        raise PlanError(f"decoder layers without compute ops in the traced graph: {set(decoder) - set(order)}")
    out = {}
    for j, layer in enumerate(order):
        if j + 1 < len(order):
            stop = firsts[order[j + 1]]
        else:
            stop = next((i for i in range(firsts[layer], len(nodes))
                         if _is_compute(nodes[i]) and _layer_of(nodes[i]) not in (None, *decoder)), len(nodes))
        out[layer] = (firsts[layer], stop)
    return out


def _span(gm, timeline, start: int, stop: int) -> float:
    """Compute-lane seconds from node ``start`` to node ``stop`` of a simulated program."""
    index = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    starts = sorted((index[e.name], e.start_s) for e in timeline.events
                    if e.lane in ("compute", "stall") and e.name in index)
    end = max((e.end_s for e in timeline.events), default=0.0)

    def clock(i: int) -> float:
        return next((t for j, t in starts if j >= i), end)

    return clock(stop) - clock(start)


def _compute_busy(gm, start: int, stop: int) -> float:

    nodes = list(gm.graph.nodes)[start:stop]
    return sum(n.meta[COST_KEY].time_s for n in nodes
               if COST_KEY in n.meta and n.meta[COST_KEY].lane == "compute")


def _curves(attempt) -> tuple[list, list]:
    """(node name, live device bytes) at each node of the forward and the backward, as the plan counts them."""

    fw: list = []
    bw: list = []
    plan_mod.estimate_memory(attempt.forward, keep_outputs_alive=True, curve=fw)
    kwargs = {}
    if "input_storage" in inspect.signature(plan_mod.estimate_memory).parameters:
        kwargs["input_storage"] = plan_mod.storage_roots(attempt.forward)
        kwargs["input_storage_bytes"] = plan_mod.storage_root_bytes(attempt.forward)
    plan_mod.estimate_memory(attempt.backward, keep_outputs_alive=False, curve=bw, **kwargs)
    return fw, bw


def _storage_root(node, memo: dict):
    """The node whose storage ``node`` views, as plan.estimate_memory sees it."""

    return storage_root(node, memo)


def _saved_device_bytes_by_layer(attempt) -> dict:
    """Device bytes each layer keeps alive from its forward to its backward.

    Counted by storage: a saved view (``view``, ``_unsafe_view``, ``unsqueeze`` of a matmul
    output) has no bytes of its own but keeps its base alive, so the base's bytes count, once,
    for the layer that produced the base. Values the plan offloads are on the host.
    """

    memo: dict = {}
    roots: dict = {}
    saved = set(attempt.plan.saved_values)
    for node in attempt.forward.graph.nodes:
        if node.name not in saved or not has_info(node) or info(node).decision == "offload":
            continue
        root = _storage_root(node, memo)
        if root.op == "call_function" and has_info(root) and info(root).placement == "device":
            roots[root] = info(root)
    out: dict = {}
    for ni in roots.values():
        key = ni.layer or "(glue)"
        out[key] = out.get(key, 0) + ni.nbytes_hint
    return out


def _resident_bytes_by_layer(attempt) -> dict:
    """Bytes of the parameters each layer keeps resident on the device for the whole step."""

    out: dict = {}
    for node in attempt.forward.graph.nodes:
        if node.op == "call_function" and node.target is ops.load and has_info(node) \
                and info(node).decision == "resident":
            key = info(node).layer or "(glue)"
            out[key] = out.get(key, 0) + info(node).nbytes_hint
    return out


def _sum_by_layer(gm, attr: str, where: Callable | None = None) -> dict:

    out: dict = {}
    for node in gm.graph.nodes:
        c = node.meta.get(COST_KEY)
        if c is None or (where is not None and not where(node, c)):
            continue
        key = _layer_of(node) or "(glue)"
        out[key] = out.get(key, 0) + getattr(c, attr)
    return out


def _peak_parts(fw_curve: list, bw_curve: list, fw_regions: dict, bw_regions: dict, decoder: list) -> dict:
    """The traced program's peak in each part: "early" (embedding and the first layer, forward
    and backward), "layers" (one per later decoder layer: its forward and backward regions),
    "head" (final norm, head and loss, forward and backward). Each a (phase, node, bytes)."""
    fw = [("forward", name, live) for name, live in fw_curve]
    bw = [("backward", name, live) for name, live in bw_curve]
    top = lambda pts: max(pts, key=lambda t: t[2]) if pts else ("forward", "", 0)  # noqa: E731
    f1, b0 = fw_regions[decoder[1]][0], bw_regions[decoder[0]][0]
    f_end, b_start = fw_regions[decoder[-1]][1], bw_regions[decoder[-1]][0]
    layers = [top(fw[slice(*fw_regions[d])] + bw[slice(*bw_regions[d])]) for d in decoder[1:]]
    return {"early": top(fw[:f1] + bw[b0:]), "layers": layers, "head": top(fw[f_end:] + bw[:b_start]),
            "early_fw": top(fw[:f1])[2], "early_bw": top(bw[b0:])[2],
            "layers_fw": [top(fw[slice(*fw_regions[d])])[2] for d in decoder[1:]],
            "layers_bw": [top(bw[slice(*bw_regions[d])])[2] for d in decoder[1:]]}


def _optimizer_landing_seconds(attempt, pred, profile: HardwareProfile, synchronous: bool) -> dict:
    """What the overlapped host optimizer needs to be extrapolated (see
    full_depth.optimizer_exposed_seconds), from the traced program's backward: whether the runtime
    overlaps it on this hardware (on a GPU, by default); how long after the backward starts the
    first gradient lands; and the tail, how long the worker runs past the backward's end when
    it updates this program's own gradients as they land (the last landings: the embedding,
    the last tensors of the first layer)."""

    if synchronous or pred.backward is None:
        return {"overlapped": False, "first_landing_s": 0.0, "tail_seconds": 0.0}
    rate = profile.estimated_host_adamw_params_per_s()
    backward_start = pred.forward.total_s
    device_end = backward_start + pred.backward.total_s
    landings = cost_model.optimizer_landings(attempt.backward, pred.backward, device_end)
    worker = 0.0
    for landed, numel, _ in landings:
        worker = max(worker, landed) + numel / rate
    return {
        "overlapped": True,
        "first_landing_s": (landings[0][0] - backward_start) if landings else pred.backward.total_s,
        "tail_seconds": max(0.0, worker - device_end),
    }


def _digest(raw: dict, profile: HardwareProfile, *, k: int, batch: int, seq_len: int, precision: str,
            num_params_full: int) -> Trace:

    attempts = raw["attempts"]
    decoder = [layer for layer in raw["layers"] if DECODER_LAYER.search(layer)]
    if len(decoder) != k:
        raise PlanError(f"expected {k} decoder layers in the traced graph, found {decoder}")
    first, second = decoder[0], decoder[1]
    synchronous = cost_model.is_cpu_standin(profile)
    opt_bytes = num_params_full * DEVICE_PARAM_BYTES[precision]

    param_bytes_by_layer: dict = {}
    for name, p in raw["model"].named_parameters():
        layer = layer_of_module_path(name.rsplit(".", 1)[0]) if "." in name else None
        key = layer or "(glue)"
        # What the device holds of it (bf16 traces fp32 host masters; their loads carry bf16 copies).
        param_bytes_by_layer[key] = param_bytes_by_layer.get(key, 0) + p.numel() * DEVICE_PARAM_BYTES[precision]

    checks: dict = {"param_bytes": [param_bytes_by_layer.get(layer, 0) for layer in decoder]}
    policies: dict = {}
    keep_pred = keep_by_layer = None
    host_optimizer: dict = {}

    def glue_d2h(by_layer: dict) -> int:
        """Bytes the forward sends to the host outside the decoder layers (activations, loss)."""
        return sum(v for key, v in by_layer["saved_host_bytes"].items() if key not in decoder)

    for policy in [p for p in (*POLICIES, RESIDENT) if p in attempts]:
        a = attempts[policy]
        # Overlapped where the runtime overlaps it (a GPU): the host casts it serves cost nothing.
        pred = cost_model.step_time(a.forward, a.backward, profile, optimizer_param_bytes=opt_bytes,
                                    precision=precision, overlap_optimizer=not synchronous)
        fw_curve, bw_curve = _curves(a)
        fw_regions, bw_regions = _regions(a.forward, decoder), _regions(a.backward, decoder)
        layer_by_name = {n.name: _layer_of(n) for g in (a.forward, a.backward) for n in g.graph.nodes}
        parts = _peak_parts(fw_curve, bw_curve, fw_regions, bw_regions, decoder)
        early_at, late_at = parts["early"], max(parts["layers"] + [parts["head"]], key=lambda t: t[2])
        early, late = early_at[2], late_at[2]
        layers_at = max(parts["layers"], key=lambda t: t[2])
        where = {part: (at[0], layer_by_name.get(at[1]), at[1])
                 for part, at in (("early", early_at), ("layers", layers_at), ("head", parts["head"]))}
        saved_dev = _saved_device_bytes_by_layer(a)
        s_dev = saved_dev.get(first, 0)
        layer_base = max(pt[2] - j * s_dev for j, pt in enumerate(parts["layers"], start=1))
        head_base = parts["head"][2] - k * s_dev
        # Resident parameters are loaded at the start of the forward: every forward point holds
        # all N layers' (f per layer); in the backward they leave with their layer, like saved bytes.
        front = _resident_bytes_by_layer(a).get(first, 0)
        s_act = s_dev - front
        phases = {
            "front_loaded": front,
            "early_fw": parts["early_fw"] - k * front,
            "early_bw": parts["early_bw"],
            "layer_fw": max(v - j * s_act for j, v in enumerate(parts["layers_fw"], start=1)) - k * front,
            "layer_bw": max(v - j * s_dev for j, v in enumerate(parts["layers_bw"], start=1)),
        }
        is_recompute = lambda n, c: has_info(n) and info(n).phase == "recompute"  # noqa: E731
        lane_is = lambda lane: (lambda n, c: c.lane == lane)  # noqa: E731
        by_layer = {
            "saved_device_bytes": saved_dev,
            "saved_host_bytes": _sum_by_layer(a.forward, "bytes_touched", lane_is("d2h")),
            "forward_flops": _sum_by_layer(a.forward, "flops"),
            "backward_flops": _sum_by_layer(a.backward, "flops"),
            "recompute_flops": _sum_by_layer(a.backward, "flops", is_recompute),
            "forward_h2d_bytes": _sum_by_layer(a.forward, "bytes_touched", lane_is("h2d")),
            "backward_h2d_bytes": _sum_by_layer(a.backward, "bytes_touched", lane_is("h2d")),
            "forward_d2h_bytes": _sum_by_layer(a.forward, "bytes_touched", lane_is("d2h")),
            "backward_d2h_bytes": _sum_by_layer(a.backward, "bytes_touched", lane_is("d2h")),
        }
        for name, values in by_layer.items():
            checks[f"{policy}.{name}"] = [values.get(layer, 0) for layer in decoder]
        # Compute time of each layer's own ops (region busy times include the neighbours'
        # untagged ops at the ends only for the first and last traced layer).
        for gname, g in (("forward", a.forward), ("backward", a.backward)):
            busy = _sum_by_layer(g, "time_s", lambda n, c: c.lane == "compute" and _layer_of(n) in decoder)
            checks[f"{policy}.{gname}_compute_seconds"] = [round(busy.get(layer, 0.0), 15) for layer in decoder]

        one = {key: values.get(first, 0) for key, values in by_layer.items()}
        f_busy = _compute_busy(a.forward, *fw_regions[second])
        b_busy = _compute_busy(a.backward, *bw_regions[first])
        h2d_s = (one["forward_h2d_bytes"] + one["backward_h2d_bytes"]) / profile.h2d_bandwidth
        d2h_s = (one["forward_d2h_bytes"] + one["backward_d2h_bytes"]) / profile.d2h_bandwidth
        f_span = _span(a.forward, pred.forward, *fw_regions[second])
        b_span = _span(a.backward, pred.backward, *bw_regions[first])
        if synchronous:
            # Copies run on the compute lane, one after another; a region holds the copies it
            # issues (the next layer's parameters), so count the layer's own copies instead.
            device_s = f_busy + b_busy + h2d_s + d2h_s
            backward_s = b_busy + (one["backward_h2d_bytes"] / profile.h2d_bandwidth
                                   + one["backward_d2h_bytes"] / profile.d2h_bandwidth)
        else:
            f_link = max(one["forward_h2d_bytes"] / profile.h2d_bandwidth,
                         one["forward_d2h_bytes"] / profile.d2h_bandwidth)
            b_link = max(one["backward_h2d_bytes"] / profile.h2d_bandwidth,
                         one["backward_d2h_bytes"] / profile.d2h_bandwidth)
            device_s = max(f_span, f_link) + max(b_span, b_link)
            backward_s = max(b_span, b_link)
        flops = one["forward_flops"] + one["backward_flops"]
        per_layer = {
            "device_s": device_s, "backward_s": backward_s,
            "lanes_s": {"compute": f_busy + b_busy, "h2d": h2d_s, "d2h": d2h_s},
            "flops": flops, "model_flops": flops - one["recompute_flops"],
            "h2d_bytes": one["forward_h2d_bytes"] + one["backward_h2d_bytes"],
            "d2h_bytes": one["forward_d2h_bytes"] + one["backward_d2h_bytes"],
            **{key: one[key] for key in ("forward_h2d_bytes", "backward_h2d_bytes", "forward_d2h_bytes",
                                         "backward_d2h_bytes")},
        }
        total = {
            "device_s": pred.forward.total_s + (pred.backward.total_s if pred.backward is not None else 0.0),
            "backward_s": pred.backward.total_s if pred.backward is not None else 0.0,
            "lanes_s": {"compute": pred.compute_s, "h2d": pred.h2d_s, "d2h": pred.d2h_s},
            "flops": pred.flops, "model_flops": pred.model_flops,
            "h2d_bytes": pred.h2d_bytes, "d2h_bytes": pred.d2h_bytes,
            "forward_h2d_bytes": pred.forward.h2d_bytes, "backward_h2d_bytes": pred.backward.h2d_bytes,
            "forward_d2h_bytes": pred.forward.d2h_bytes, "backward_d2h_bytes": pred.backward.d2h_bytes,
        }
        policies[policy] = PolicyNumbers(
            policy=policy, peak=a.plan.peak_bytes, early_peak=early, late_peak=late,
            layer_base=layer_base, head_base=head_base, phases=phases,
            where=where,
            saved_device=saved_dev.get(first, 0),
            saved_host=one["saved_host_bytes"] if policy in ("offload", STREAMED) else 0,
            total=total, per_layer=per_layer,
            glue_host=max(0, glue_d2h(by_layer) - glue_d2h(keep_by_layer)) if keep_by_layer is not None else 0,
        )
        if policy == "keep":
            keep_by_layer = by_layer
            keep_pred = pred
            host_optimizer = {"seconds": pred.host_optimizer_s, "bytes": pred.host_optimizer_bytes,
                              "params": pred.optimizer_params,
                              **_optimizer_landing_seconds(a, pred, profile, synchronous)}
    # Working set of a layer after one with another policy (its backward prefetches the
    # predecessor's reloads): the second traced layer of a "pair" plan, less the first's saved bytes.
    pair_base: dict = {}
    for prev, cur in PAIRS:
        a = attempts.get(f"pair:{prev}>{cur}")
        if a is None:
            continue
        fw_curve, bw_curve = _curves(a)
        parts = _peak_parts(fw_curve, bw_curve, _regions(a.forward, decoder), _regions(a.backward, decoder), decoder)
        pair_base[(prev, cur)] = parts["layers"][0][2] - policies[prev].saved_device
    return Trace(k=k, batch=batch, seq_len=seq_len, precision=precision, policies=policies, pair_base=pair_base,
                 param_bytes_by_layer=param_bytes_by_layer, layer_checks=checks, host_optimizer=host_optimizer,
                 trace_s=raw["trace_s"], prediction=keep_pred)


def check_repeat(trace: Trace, rel_tol: float = 1e-9) -> list[str]:
    """The quantities in which the traced decoder layers differ (empty: they repeat)."""
    differ = []
    for name, values in trace.layer_checks.items():
        lo, hi = min(values), max(values)
        if hi - lo > rel_tol * max(abs(hi), 1):
            differ.append(f"{name} {values}")
    return differ


def _uniform_peak_at_depth(attempt, layers: list, num_layers: int) -> int:
    """full_depth.full_depth_peak of one uniform plan, straight from its attempt (no cost model)."""
    decoder = [layer for layer in layers if DECODER_LAYER.search(layer)]
    fw_curve, bw_curve = _curves(attempt)
    parts = _peak_parts(fw_curve, bw_curve, _regions(attempt.forward, decoder), _regions(attempt.backward, decoder),
                        decoder)
    s = _saved_device_bytes_by_layer(attempt).get(decoder[0], 0)
    layer_base = max(pt[2] - j * s for j, pt in enumerate(parts["layers"], start=1))
    return max(parts["early"][2], layer_base + (num_layers - 1) * s,
               parts["head"][2] - len(decoder) * s + num_layers * s)
