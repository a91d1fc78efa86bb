"""``plan_model``: one training step planned (trace, extrapolate, choose, search where it does
not fit) into the ``PlanResult`` the command prints."""
from __future__ import annotations

import dataclasses
import json
import math
import time

from megacompile.cli.plan_command import (
    DEFAULT_TRACED_LAYERS,
    DEVICE_PARAM_BYTES,
    PRECISIONS,
    RESIDENT,
    STREAMED,
    PlanError,
)
from megacompile.cli.plan_command.digest import Trace
from megacompile.cli.plan_command.full_depth import DepthPlan, _min_peak, choose_plan
from megacompile.cli.plan_command.host_memory import OVERLAPPED_HOST_BYTES_PER_PARAM, host_bytes
from megacompile.cli.plan_command.meta_model import TRACED_DEVICE
from megacompile.cli.plan_command.scale_out import scale_out
from megacompile.cli.plan_command.search import SearchResult, search_largest
from megacompile.cli.plan_command.text_report import format_text
from megacompile.cli.plan_command.traced_layers import trace_model
from megacompile.cli.presets import count_parameters
from megacompile.core.units import format_bytes
from megacompile.plan.cost_model import device_flops, is_cpu_standin, roofline_floor
from megacompile.plan.hardware import HardwareProfile


@dataclasses.dataclass
class PlanResult:
    """Everything ``megacompile plan`` reports; ``to_dict()`` is the ``--json`` object."""

    model: dict
    hardware: dict
    step: dict
    fits: bool
    device: dict
    host: dict
    transfers: dict
    time: dict
    problems: list
    suggestions: list
    max_seq_len: dict | None
    method: dict
    # --gpus / --nodes: the one-GPU plan carried to data parallel (scale_out.scale_out), or None.
    scale_out: dict | None = None
    depth_plan: DepthPlan | None = dataclasses.field(default=None, repr=False)
    trace: Trace | None = dataclasses.field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("depth_plan", "trace")}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default)

    def to_text(self) -> str:
        return format_text(self.to_dict())


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


# The smallest chunk of tokens the planner considers for a layer's per-token runs: a
# (512 x hidden) @ (hidden x MLP) product still keeps a GPU's matrix units busy.
MIN_CHUNK_TOKENS = 512


def token_chunk_counts(tokens: int) -> list[int]:
    """Chunk counts considered for ``tokens`` tokens: powers of two from 2 while chunks keep at
    least ``MIN_CHUNK_TOKENS`` tokens (none below twice that: layers stay whole)."""
    counts: list[int] = []
    while tokens // ((counts[-1] if counts else 1) * 2) >= MIN_CHUNK_TOKENS:
        counts.append((counts[-1] if counts else 1) * 2)
    return counts


def _fewest_fitting(counts: list[int], trace_with, fits):
    """The trace at the fewest of ``counts`` that ``fits`` (fitting only grows with the count),
    or at the most where none does."""
    most = trace_with(counts[-1])
    if not fits(most):
        return most
    lo, hi, best = 0, len(counts) - 1, most
    while lo < hi:
        mid = (lo + hi) // 2
        candidate = trace_with(counts[mid])
        if fits(candidate):
            hi, best = mid, candidate
        else:
            lo = mid + 1
    return best


def _where(at: tuple) -> str:
    phase, layer, node = at
    return f"{phase} of {layer or 'the loss'} (node {node})"


def _layout_text(precision: str, overlapped: bool, activations: bool) -> str:
    gradients = "" if overlapped else " + fp32 gradients (4 B)"
    text = {
        "fp32": f"pinned: fp32 weights (4 B){gradients}; pageable: AdamW exp_avg + exp_avg_sq (8 B)",
        "bf16": f"pageable: fp32 master weights (4 B){gradients} + AdamW exp_avg + exp_avg_sq (8 B); pinned: the bf16 "
                "weight copies the loads carry (2 B), rewritten by the update",
    }[precision] + ("; plus offloaded activations (pinned)" if activations else "")
    if overlapped:
        return text + ("; no gradient buffer: on a GPU the optimizer step overlaps the backward (each gradient "
                       "consumed as it lands)")
    return text + (f"; {OVERLAPPED_HOST_BYTES_PER_PARAM[precision]} B/param when the optimizer step overlaps the "
                   "backward (gradients consumed as they land; the runtime's default on a GPU)")


def plan_model(config: dict, profile: HardwareProfile, *, batch: int, seq_len: int, precision: str = "fp32",
               budget: int | None = None, host_memory: int | None = None, k: int = DEFAULT_TRACED_LAYERS,
               max_seq_len: bool = False, search: bool = True, seq_multiple: int = 128, max_probes: int = 5,
               model_name: str | None = None, data_parallel: dict | None = None) -> PlanResult:
    """Plan one training step of the model ``config`` on ``profile`` (see the module docstring).

    ``budget``: device bytes (default: the profile's HBM); ``host_memory``: host bytes
    (default: the profile's host memory; None there means unknown, not checked).
    ``max_seq_len``: also find the largest sequence length that fits. ``search``: when the
    step does not fit the device, find the largest batch / sequence length that does.
    ``seq_multiple``: the grid of sequence lengths searched. ``data_parallel``: keyword
    arguments of ``scale_out.scale_out`` (gpus, nodes, shard_optimizer, nic_bandwidth) to
    predict the data-parallel step too; ``batch`` is then per GPU.
    """
    t_start = time.perf_counter()
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be >= 1, got batch={batch}, seq_len={seq_len}")
    num_layers = int(config.get("num_hidden_layers") or 0)
    if num_layers < 2:
        raise PlanError(f"the model has {num_layers} decoder layer(s); plan needs at least 2")
    k = min(k, num_layers)
    budget = int(budget if budget is not None else profile.hbm_bytes)
    host_memory = host_memory if host_memory is not None else profile.host_memory_bytes
    num_params = count_parameters(config)
    # On a GPU the runtime overlaps the optimizer step with the backward (option overlap_optimizer,
    # "auto"), so the host keeps no gradient buffer; on the CPU stand-in it does.
    overlapped = not is_cpu_standin(profile)
    static_host = host_bytes(num_params, precision, overlapped=overlapped)
    host_free = None if host_memory is None else max(0, host_memory - static_host["total_bytes"])

    traces: dict = {}  # (batch, seq_len) -> Trace

    def traced(b: int, s: int, complete: bool, chunks: int | None) -> Trace:
        trace = trace_model(config, profile, batch=b, seq_len=s, precision=precision, k=k,
                            skip_if_keep_fits=None if complete else budget, token_chunks=chunks)
        trace.token_chunks = chunks
        return trace

    def trace_at(b: int, s: int, complete: bool = True) -> Trace:
        """The trace of the program megatrain would build: its layers whole, or, where no plan
        fits that way, their per-token runs in the fewest chunks (powers of two) whose plan fits
        (the most chunks where none does)."""
        if (b, s) not in traces or (complete and not traces[(b, s)].complete):
            whole = traced(b, s, complete, None)
            traces[(b, s)] = whole
            counts = token_chunk_counts(b * s)
            if counts and whole.complete and _min_peak(whole, num_layers, host_free) > budget:
                fewest = _fewest_fitting(counts, lambda c: traced(b, s, True, c),
                                         lambda t: _min_peak(t, num_layers, host_free) <= budget)
                if _min_peak(fewest, num_layers, host_free) < _min_peak(whole, num_layers, host_free):
                    traces[(b, s)] = fewest
        return traces[(b, s)]

    # When keeping every activation fits, the other policies are not built (unless a search
    # of the sequence length needs them).
    trace = trace_at(batch, seq_len, complete=max_seq_len)
    traced_params = sum(trace.param_bytes_by_layer.values()) // DEVICE_PARAM_BYTES[precision]
    expected = count_parameters({**config, "num_hidden_layers": k})
    if traced_params != expected:
        raise PlanError(f"the traced {k}-layer model has {traced_params} parameters, but counting from the "
                        f"config gives {expected}: the config and the built model disagree")

    chosen, smallest, keep = choose_plan(trace, num_layers, budget=budget, host_free=host_free)
    shown = chosen or smallest or keep
    device_fits = chosen is not None
    host = host_bytes(num_params, precision, shown.offloaded_activation_bytes, overlapped=overlapped)
    host_fits = host_memory is None or host["total_bytes"] <= host_memory
    pol = trace.policies

    def fits_memory(model) -> bool:
        return _min_peak(model, num_layers, host_free) <= budget

    searches: dict = {}

    search_traces: dict = {}  # (batch, seq_len) -> trace with each layer's runs in chunks of ~MIN_CHUNK_TOKENS

    def search_trace(b: int, s: int) -> Trace:
        """What a search probes: the program with the most chunks considered (the least memory
        chunking gives; any count fits if this one does), at a chunk size that does not change
        with the probe, so the probes' memory stays a smooth function of the size (layers whole
        below two chunks' worth of tokens)."""
        if (b, s) not in search_traces:
            chunks = b * s // MIN_CHUNK_TOKENS
            search_traces[(b, s)] = traced(b, s, True, chunks if chunks >= 2 else None)
        return search_traces[(b, s)]

    def search_axis(axis: str) -> SearchResult:
        if axis == "seq_len":
            probe_traces = {s: t for (b, s), t in search_traces.items() if b == batch}

            def fits_at(s: int) -> bool:
                probe_traces[s] = search_trace(batch, s)
                return fits_memory(probe_traces[s])

            step = max(1, min(seq_multiple, seq_len))
            return search_largest("seq_len", fits_at, probe_traces, start=seq_len, step=step, lo_limit=step,
                                  hi_limit=max(seq_len, 1 << 21), predict_fits=fits_memory, max_probes=max_probes)
        probe_traces = {b: t for (b, s), t in search_traces.items() if s == seq_len}

        def fits_at(b: int) -> bool:
            probe_traces[b] = search_trace(b, seq_len)
            return fits_memory(probe_traces[b])

        return search_largest("batch", fits_at, probe_traces, start=batch, step=1, lo_limit=1,
                              hi_limit=max(batch, 1 << 16), predict_fits=fits_memory, max_probes=max_probes)

    problems: list = []
    suggestions: list = []
    if not device_fits:
        need = smallest.peak_bytes if smallest is not None else None
        problems.append({
            "resource": "device memory", "needed_bytes": need, "available_bytes": budget,
            "short_by_bytes": None if need is None else need - budget,
            "message": (f"device memory runs out: the smallest plan ({smallest.summary}) needs "
                        f"{format_bytes(need)}, the budget is {format_bytes(budget)} "
                        f"(short by {format_bytes(need - budget)})") if smallest is not None else
                       "device memory runs out: no plan fits while its offloaded activations fit the host",
        })
        if need is not None:
            over_hbm = need > profile.hbm_bytes
            suggestions.append({
                "change": "budget", "value": need,
                "message": f"a device budget of at least {format_bytes(need)} ({need} bytes)"
                           + (f", more than the {profile.name}'s {format_bytes(profile.hbm_bytes)}"
                              if over_hbm else ""),
            })
        if search:
            if batch > 1:
                searches["batch"] = search_axis("batch")
                r = searches["batch"]
                suggestions.append({"change": "batch", "value": r.value,
                                    "message": (f"batch {r.value} (at seq_len {seq_len})" if r.value
                                                else f"no batch fits at seq_len {seq_len}")})
            searches["seq_len"] = search_axis("seq_len")
            r = searches["seq_len"]
            suggestions.append({"change": "seq_len", "value": r.value,
                                "message": (f"seq_len {r.value} (at batch {batch})" if r.value
                                            else f"no sequence length fits at batch {batch}")})
    if not host_fits:
        problems.append({
            "resource": "host memory", "needed_bytes": host["total_bytes"], "available_bytes": host_memory,
            "short_by_bytes": host["total_bytes"] - host_memory,
            "message": (f"host memory runs out: parameters, gradients and optimizer state "
                        f"({host['bytes_per_param']} B/param x {num_params:,})"
                        + (" and offloaded activations" if shown.offloaded_activation_bytes else "")
                        + f" need {format_bytes(host['total_bytes'])}, the host has {format_bytes(host_memory)} "
                        f"(short by {format_bytes(host['total_bytes'] - host_memory)})"),
        })
        suggestions.append({"change": "host_memory", "value": host["total_bytes"],
                            "message": f"a host with at least {format_bytes(host['total_bytes'])} of memory "
                                       f"(--host-memory {host['total_bytes']})"})
    max_seq = None
    if max_seq_len:
        r = searches.get("seq_len") or search_axis("seq_len")
        searches["seq_len"] = r
        max_seq = {"value": r.value, "batch": batch, "grid": r.step, "how": r.how,
                   "probes": {str(x): ok for x, ok in sorted(r.probes.items())}}
        if r.value is not None and r.value > int(config.get("max_position_embeddings") or r.value):
            max_seq["note"] = (f"above the model's max_position_embeddings "
                               f"({config['max_position_embeddings']})")

    # Time, bytes and FLOPs of the plan shown.

    plan = shown
    step_s = plan.step_s
    lanes = dict(plan.lanes_s)
    bottleneck = max(lanes, key=lambda lane: lanes[lane])
    tokens = batch * seq_len
    directions = plan.bytes_by_direction
    activations_in = activations_out = 0
    for p in ("offload", STREAMED):  # the layers whose activations cross to the host and back
        if plan.counts.get(p):
            activations_in += plan.counts[p] * max(
                0, pol[p].per_layer["backward_h2d_bytes"] - pol["keep"].per_layer["backward_h2d_bytes"])
            activations_out += plan.counts[p] * pol[p].per_layer["forward_d2h_bytes"]
    order = [p for p in ("offload", "recompute", STREAMED, "keep", RESIDENT) if plan.counts.get(p)]
    part_policy = {"early": order[0], "head": order[-1],
                   "layers": "keep" if plan.counts.get("keep", 0) > 1 else order[-1]}
    at = pol[part_policy[plan.peak_region]].where[plan.peak_region]
    base = pol[plan.base_policy]
    timings = {"total_s": time.perf_counter() - t_start,
               "trace_s": [round(t.trace_s, 3) for t in traces.values()]}
    return PlanResult(
        model={"name": model_name, "model_type": config.get("model_type"), "parameters": num_params,
               "layers": num_layers, "hidden_size": config.get("hidden_size"),
               "intermediate_size": config.get("intermediate_size"), "vocab_size": config.get("vocab_size")},
        hardware={"name": profile.name, "description": profile.description, "hbm_bytes": profile.hbm_bytes,
                  "host_memory_bytes": profile.host_memory_bytes},
        step={"batch": batch, "seq_len": seq_len, "tokens": tokens, "precision": precision,
              "token_chunks": trace.token_chunks},
        fits=device_fits and host_fits,
        device={
            "fits": device_fits, "budget_bytes": budget, "peak_bytes": plan.peak_bytes,
            "plan": plan.summary, "layer_policy_counts": plan.counts,
            "peak_at": {"early": "embedding / first layer: ", "layers": "a decoder layer (the last of its policy): ",
                        "head": "head and loss: "}[plan.peak_region] + _where(at),
            "recomputed_layers": plan.recomputed_layers,
            "keep_all_peak_bytes": keep.peak_bytes,
            "smallest_peak_bytes": smallest.peak_bytes if smallest is not None and trace.complete else None,
            "extrapolation": {
                "traced_layers": trace.k, "traced_plan": plan.base_policy,
                "traced_peak_bytes": base.peak,
                "saved_device_bytes_per_layer": {p: n.saved_device for p, n in pol.items()},
                "saved_host_bytes_per_layer": {p: n.saved_host for p, n in pol.items()},
                "formula": "one policy: peak(N) = max(early_k, late_k + (N - k) * saved_device_per_layer);"
                           " mixed plans (upgraded layers first, kept layers last): the largest of each layer's"
                           " working set plus the saved device bytes of the layers before it, and the head's"
                           " plus all layers' (plan_cmd.full_depth_peak)",
            },
        },
        host={
            "fits": host_fits, "capacity_bytes": host_memory, "total_bytes": host["total_bytes"],
            "pinned_bytes": host["pinned_bytes"], "pageable_bytes": host["pageable_bytes"],
            "parts_bytes": host["parts"], "bytes_per_param": host["bytes_per_param"],
            # Pinned host bytes of the plan's activations, per layer of each policy that offloads.
            "offloaded_activations": {
                "total_bytes": plan.offloaded_activation_bytes,
                "per_layer_bytes": {p: pol[p].saved_host for p in ("offload", STREAMED)
                                    if plan.counts.get(p)},
                "layers": {p: plan.counts[p] for p in ("offload", STREAMED) if plan.counts.get(p)},
            },
            "overlapped": overlapped,
            "overlapped_bytes_per_param": host["overlapped_bytes_per_param"],
            "layout": _layout_text(precision, overlapped, bool(plan.offloaded_activation_bytes)),
        },
        transfers={
            "h2d_bytes": plan.h2d_bytes, "d2h_bytes": plan.d2h_bytes,
            "h2d": {"parameters_forward": directions["forward_h2d_bytes"],
                    "parameters_backward": directions["backward_h2d_bytes"] - activations_in,
                    "activations": activations_in},
            "d2h": {"gradients": directions["backward_d2h_bytes"], "activations": activations_out,
                    "outputs": directions["forward_d2h_bytes"] - activations_out},
        },
        time={
            "step_s": step_s, "lanes_s": lanes, "bottleneck": bottleneck,
            "tokens_per_s": tokens / step_s if step_s > 0 else None,
            "achieved_tflops": plan.flops / step_s / 1e12 if step_s > 0 else None,
            "mfu": plan.model_flops / step_s / device_flops(profile, precision) if step_s > 0 else None,
            "flops": plan.flops, "model_flops": plan.model_flops,
            "roofline_s": roofline_floor(lanes["compute"], plan.h2d_bytes, plan.d2h_bytes,
                                         trace.host_optimizer["bytes"], profile),
            "host_optimizer_params": trace.host_optimizer["params"],
            "host_optimizer_overlapped": bool(trace.host_optimizer.get("overlapped")),
            "host_optimizer_exposed_s": plan.optimizer_exposed_s,
        },
        problems=problems,
        suggestions=suggestions,
        max_seq_len=max_seq,
        method={
            "traced_layers": trace.k, "device": TRACED_DEVICE[precision],
            "policies_built": list(trace.policies),
            "repeat_check": {"identical": True, "quantities": sorted(trace.layer_checks)},
            "probes": [{"batch": b, "seq_len": s} for (b, s) in list(traces) + list(search_traces)],
            "seconds": timings,
        },
        scale_out=(scale_out(plan, trace, profile, num_params=num_params, num_layers=num_layers,
                             tokens_per_gpu=tokens, device_grad_bytes_per_param=2 if precision == "bf16" else 4,
                             **data_parallel) if data_parallel is not None else None),
        depth_plan=plan, trace=trace,
    )
