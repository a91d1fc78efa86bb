"""megatrain: the user's training step compiled with ``backend="megatrain"``, the model on the host.

bf16 compute with fp32 master weights, gradients and AdamW states on the host; the decoder
layers marked repeated so one layer is traced and the template planner prices the plans."""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import torch

from .workload import DEVICE, timed_steps


def train(workload) -> dict:
    import megacompile
    from megacompile.capture.records import recording
    from megacompile.plan.cost_model import predict_record
    from megacompile.plan.hardware import get_profile

    model = workload.build_model()
    marked = megacompile.mark_repeated_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=workload.lr, weight_decay=0.0)

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    options = {"device": DEVICE, "precision": "bf16", "memory_budget": workload.budget_bytes}
    if workload.hardware:
        options["hardware"] = workload.hardware
    # Variants for diagnosis, e.g. PEERS_MEGATRAIN_OPTIONS='{"recompute": "always"}'.
    options.update(json.loads(os.environ.get("PEERS_MEGATRAIN_OPTIONS", "{}")))
    records: list = []
    with recording(into=records):
        compiled = torch.compile(step, backend="megatrain", options=options)
        batches = workload.batches()
        times, losses = timed_steps(compiled, batches)
        # One more step under the runtime trace (not timed above): the host thread's share.
        trace_path = os.environ.get("PEERS_MEGATRAIN_TRACE") or os.path.join(tempfile.mkdtemp(), "trace.json")
        with megacompile.trace_runtime(trace_path) as recorder:
            float(compiled(batches[-1]))
        host_thread = recorder.host_thread_summary()
    report = megacompile.last_report()
    record = [r for r in records if r.backward is not None][-1]
    profile = get_profile(record.options.hardware_profile())
    prediction = predict_record(record, profile, tokens=workload.tokens_per_step)
    # The same program priced with the host AdamW rate this step measured (its updates' seconds
    # per parameter), beside the profile's idle-host rate: what of a miss is the optimizer's.
    optimizer = report.optimizer or {}
    in_step_rate = (record.num_params / optimizer["update_seconds"]
                    if optimizer.get("update_seconds") and record.num_params else None)
    at_in_step_rate = (predict_record(record, dataclasses.replace(profile, host_adamw_params_per_s=in_step_rate),
                                      tokens=workload.tokens_per_step).total_s if in_step_rate else None)
    return {
        "step_times": times,
        "losses": losses,
        "notes": f"megacompile, options {options}; {len(marked)} layers marked repeated; plan: {report.policy}",
        "megatrain": {
            "predicted_step_s": prediction.total_s,
            "host_adamw_params_per_s": {"profile": profile.estimated_host_adamw_params_per_s(), "in_step": in_step_rate},
            "predicted_step_s_at_in_step_adamw_rate": at_in_step_rate,
            "predicted": {"compute_s": prediction.compute_s, "h2d_s": prediction.h2d_s, "d2h_s": prediction.d2h_s,
                          "host_optimizer_s": prediction.host_optimizer_s, "bottleneck": prediction.bottleneck},
            # Where the predicted step's time goes: the planner's own price, the end of the device work,
            # the stalls, the host lane and when the overlapped optimizer's worker ends.
            "predicted_timeline": _timeline(prediction, record),
            "planned_peak_device_bytes": report.planned_peak_device_bytes,
            "measured_peak_device_bytes": report.measured_peak_device_bytes,
            "measured_reserved_device_bytes": report.measured_reserved_device_bytes,
            "host_bytes_per_param": report.host_bytes_per_param,
            "host_lead": report.host_lead,
            "gradient_landing_bytes": report.gradient_landing_bytes,
            "offload_arena_bytes": report.offload_arena_bytes,
            "h2d_bytes": report.h2d_bytes, "d2h_bytes": report.d2h_bytes,
            "optimizer": report.optimizer, "segments": report.segments,
            "graphs": report.graphs,
            "compile_times": report.compile_times,
            "host_thread": host_thread,
        },
    }


def _timeline(prediction, record) -> dict:
    device_end = sum(t.total_s for t in (prediction.forward, prediction.backward) if t is not None)
    lanes: dict = {}
    for e in prediction.events:
        lanes[e.lane] = lanes.get(e.lane, 0.0) + (e.end_s - e.start_s)
    updates = [e for e in prediction.events if e.lane == "host_optimizer"]
    return {
        "planner_predicted_s": getattr(record.plan, "predicted_seconds", None),
        "forward_s": prediction.forward.total_s if prediction.forward is not None else None,
        "backward_s": prediction.backward.total_s if prediction.backward is not None else None,
        "device_end_s": device_end,
        "exposed_wait_s": prediction.exposed_wait_s,
        "lane_seconds": lanes,
        "optimizer_updates": len(updates),
        "updates_starting_at_device_end": sum(1 for e in updates if abs(e.start_s - device_end) < 1e-9),
        "optimizer_end_s": max((e.end_s for e in updates), default=None),
    }
