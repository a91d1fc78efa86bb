"""The cost model against a step measured on a GPU, offline: the program of a
``benchmarks/peers.py`` megatrain run rebuilt here with the plan it ran, priced by the cost
model of this checkout, beside the step time the run measured.

The rebuild is ``runtime_plan.plan`` (unwritten host parameters, the bf16 trace a GPU run
makes, Inductor lowering, overlapped optimizer) with the run's plan taken by name. Its link
lanes are checked against the run's record (the seconds the run's own prediction gave the h2d
and d2h lanes): equal bytes each way is the evidence that the program is the one that ran.
Two prices: with the calibrated profile's host AdamW rate, and with the rate the run's own
optimizer measured (its updates' seconds per parameter), so that what of a miss is the
optimizer's shows apart from the device's.

    python benchmarks/reprice_measured.py benchmarks/results/peers-2026-11-26-nvidia-h100-80gb-hbm3-megatrain-32layers.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import runtime_plan  # noqa: E402
from _machine import cpu_model, write_result  # noqa: E402

from megacompile.plan.cost_model import predict_record  # noqa: E402
from megacompile.plan.hardware import get_profile  # noqa: E402

_MERGED = ", merged runs"


def _config(workload: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": workload["hidden"],
            "intermediate_size": workload["intermediate"], "num_hidden_layers": workload["layers"],
            "num_attention_heads": workload["heads"], "num_key_value_heads": workload["kv_heads"],
            "vocab_size": workload["vocab"], "max_position_embeddings": max(workload["seq"], 128),
            "tie_word_embeddings": False}


def _line(name: str, prediction, measured: float) -> str:
    optimizer_end = max((e.end_s for e in prediction.events if e.lane == "host_optimizer"), default=0.0)
    device_end = prediction.forward.total_s + prediction.backward.total_s
    return (f"  {name:<34} {prediction.total_s:7.3f} s  measured / predicted {measured / prediction.total_s:5.2f}  "
            f"(forward {prediction.forward.total_s:.3f}, backward {prediction.backward.total_s:.3f}, device done "
            f"{device_end:.3f}, host AdamW {prediction.host_optimizer_s:.3f} s done {optimizer_end:.3f}, "
            f"bottleneck {'host optimizer' if optimizer_end > device_end else prediction.bottleneck})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("peers_json", help="a peers.py result with a megatrain row")
    p.add_argument("--hardware", default=None, help="profile to price with (default: the run's)")
    p.add_argument("--out", default=None, help="result file (default: benchmarks/results/reprice_measured-<date>-cpu-<N>core.txt)")
    args = p.parse_args()
    run = json.load(open(args.peers_json, encoding="utf-8"))
    workload, row = run["workload"], run["systems"]["megatrain"]
    ran = row["megatrain"]
    policy = row["notes"].split("plan: ", 1)[1]
    policy = policy[: -len(_MERGED)] if policy.endswith(_MERGED) else policy
    hardware = args.hardware or workload["hardware"]
    record, _, seconds, model = runtime_plan.plan(
        _config(workload), seq_len=workload["seq"], batch=workload["batch"], budget=workload["budget_bytes"],
        hardware=hardware, options={}, policy=policy)
    profile = get_profile(hardware)
    tokens = workload["seq"] * workload["batch"]
    priced = predict_record(record, profile, tokens=tokens)
    params = sum(p.numel() for p in model.parameters())
    in_step = params / ran["optimizer"]["update_seconds"]
    at_in_step = predict_record(record, dataclasses.replace(profile, host_adamw_params_per_s=in_step), tokens=tokens)
    measured = row["step_s"]
    same = (abs(priced.h2d_s - ran["predicted"]["h2d_s"]) < 1e-9 and abs(priced.d2h_s - ran["predicted"]["d2h_s"]) < 1e-9)
    lines = [
        f"# benchmarks/reprice_measured.py, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{cpu_model()}, torch {torch.__version__} (priced here; nothing ran)",
        "# command: python " + shlex.join(sys.argv),
        f"run: {args.peers_json} ({run['date']}, {run['gpu']}, torch {run['torch']}): {run['model']}; "
        f"{workload['batch']} x {workload['seq']} tokens; measured step {measured:.3f} s",
        f"plan rebuilt: {record.plan.policy} (the run's: {row['notes'].split('plan: ', 1)[1]}); rebuilt in {seconds:.0f} s",
        f"same program as the run's record: {'yes' if same else 'NO'} (h2d {priced.h2d_s:.6f} s vs "
        f"{ran['predicted']['h2d_s']:.6f}, d2h {priced.d2h_s:.6f} s vs {ran['predicted']['d2h_s']:.6f}: bytes over "
        f"the link each way at the profile's bandwidth)",
        f"the run's own prediction (cost model of its commit): {ran['predicted_step_s']:.3f} s, measured / predicted "
        f"{measured / ran['predicted_step_s']:.2f}",
        "this checkout's cost model:",
        _line(f"profile AdamW {profile.estimated_host_adamw_params_per_s() / 1e9:.2f} G params/s", priced, measured),
        _line(f"in-step AdamW {in_step / 1e9:.2f} G params/s", at_in_step, measured),
    ]
    write_result("\n".join(lines), "reprice_measured-{date}-cpu-{cores}core.txt", args.out)


if __name__ == "__main__":
    main()
