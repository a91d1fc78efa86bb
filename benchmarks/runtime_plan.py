"""The plan megatrain's own planner chooses for a model at full depth, and its cost-model price,
without running anything: the step of ``benchmarks/peers.py`` (HF causal LM, ``labels=``,
AdamW, decoder layers marked repeated) compiled with the megatrain backend and stopped once
the plan is chosen.

The parameters are host tensors allocated but never written (``to_empty``: a 7B model costs
its page tables, not 27 GB), so the trace is the one a GPU run makes: autocast casts host
tensors, so the weights' bf16 casts, bf16 loads and the fp32 residual stream are all there.
(On the meta device autocast casts nothing: the program would be an fp32 one.) The lowering
is Inductor's and the optimizer overlapped, as on CUDA, so the plan's merged-runs variant is
built too; only the attention op is the CPU's (the GPU's is substituted at lowering).

``megacompile plan`` answers "does it fit, how fast" by tracing a few layers and extrapolating;
this runs the runtime's planner itself over every layer, as a GPU run would, and prints the
ladder of plans it built (peak, predicted seconds, recomputed ops) with the one it chose.

    python benchmarks/runtime_plan.py MODEL --seq-len 4096 --batch 8 --budget 60GiB \\
        --hardware benchmarks/results/calibrate-2026-11-22-nvidia-h100-80gb-hbm3.json

MODEL: a preset of ``megacompile plan`` or a Hugging Face config.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _machine import write_result  # noqa: E402

import megacompile  # noqa: E402
from megacompile.capture import training_compiler  # noqa: E402
from megacompile.cli.plan_command.meta_model import build_model  # noqa: E402
from megacompile.cli.presets import load_model_config  # noqa: E402
from megacompile.core import torch_compat as compat  # noqa: E402
from megacompile.core.units import format_bytes, parse_bytes  # noqa: E402
from megacompile.plan import flat_planner  # noqa: E402
from megacompile.plan.cost_model import predict_record  # noqa: E402
from megacompile.plan.flat_planner import Attempt  # noqa: E402
from megacompile.plan.hardware import get_profile  # noqa: E402


class _Chosen(Exception):
    """Raised once the plan is recorded: nothing is lowered or run."""


def plan(config: dict, *, seq_len: int, batch: int, budget: int, hardware: str, options: dict,
         policy: str | None = None) -> tuple:
    """(record, ladders, seconds, model). ``policy``: take the plan of that name (as
    ``TrainingPlan.policy`` spells it, without ", merged runs") instead of the planner's pick."""
    model = build_model(config, int(config["num_hidden_layers"]), "fp32").to_empty(device="cpu")
    megacompile.mark_repeated_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

    def step(x, y):
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    ladders: list = []
    original_ladder, original_add = flat_planner._ladder, training_compiler.records.add
    chosen: dict = {}

    def ladder(candidates):
        out = original_ladder(candidates)
        ladders.append((list(candidates), out))
        named = [c for c in candidates if c.plan.policy == policy]
        return named or out  # the planner draws ladders before it builds every mix

    def add(record):
        original_add(record)
        if record.backward is not None:
            chosen["record"] = record
            raise _Chosen()

    flat_planner._ladder, training_compiler.records.add = ladder, add
    compat.reset_dynamo()
    compiled = torch.compile(step, backend="megatrain", options={
        "device": "cpu", "lowering": "inductor", "precision": "bf16", "memory_budget": budget, "hardware": hardware,
        "overlap_optimizer": True, "autocast_lists": "cuda", **options})
    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    started = time.perf_counter()
    try:
        compiled(ids, ids)
    except Exception:  # noqa: BLE001  (Dynamo wraps _Chosen)
        if "record" not in chosen:
            raise
    finally:
        flat_planner._ladder, training_compiler.records.add = original_ladder, original_add
        compat.reset_dynamo()
    taken = chosen["record"].plan.policy.removesuffix(", merged runs")
    if policy is not None and taken != policy:
        built = sorted({c.plan.policy for candidates, _ in ladders for c in candidates})
        raise ValueError(f"no plan named {policy!r} was built (the planner took {taken!r}); built: {built}")
    # The record holds its parameters weakly: the model goes back with it, to be held while
    # the record is priced (the host optimizer's share counts the parameters alive).
    return chosen["record"], ladders, time.perf_counter() - started, model


def _runs(per_layer: dict) -> list[str]:
    """Consecutive layers of one policy as one entry: ``model.layers.0 .. model.layers.19 keep``."""
    runs: list[list] = []
    for layer, policy in per_layer.items():
        if runs and runs[-1][2] == policy:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer, policy])
    return [f"{first}{'' if first == last else ' .. ' + last} {policy}" for first, last, policy in runs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--budget", required=True)
    p.add_argument("--hardware", required=True)
    p.add_argument("--options", default="{}", help="more megatrain options, as JSON (e.g. '{\"host_activation_budget\": 0}')")
    p.add_argument("--out", default=None, help="result file (default: benchmarks/results/runtime_plan-<date>-cpu-<N>core.txt)")
    args = p.parse_args()
    config = load_model_config(args.model)
    budget = parse_bytes(args.budget)
    record, ladders, seconds, model = plan(config, seq_len=args.seq_len, batch=args.batch, budget=budget,
                                    hardware=args.hardware, options=json.loads(args.options))
    profile = get_profile(args.hardware)
    tokens = args.seq_len * args.batch
    predicted = predict_record(record, profile, tokens=tokens)
    params = sum(p.numel() for p in model.parameters())
    if predicted.optimizer_params != params:
        raise RuntimeError(f"the record counts {predicted.optimizer_params} parameters, the model has {params}")
    host_s = predicted.forward.host_s + predicted.backward.host_s
    optimizer_end = max((e.end_s for e in predicted.events if e.lane == "host_optimizer"), default=0.0)
    lines = [f"# benchmarks/runtime_plan.py, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"torch {torch.__version__} (planned on unwritten host parameters; nothing ran)",
             "# command: python " + shlex.join(sys.argv),
             f"model {args.model}: {config['num_hidden_layers']} layers; {args.batch} x {args.seq_len} tokens; bf16; "
             f"budget {format_bytes(budget)}; profile {profile.name}; planned in {seconds:.0f} s",
             f"chosen: {record.plan.policy}; planned peak {format_bytes(record.plan.peak_bytes)}; activations on the "
             f"host {format_bytes(Attempt(record.plan, record.forward, record.backward, []).host_activation_bytes)}; "
             + ("each layer's per-token runs chunked (token_chunks: no plan fits with the layers whole)" if any(
                 n.name.startswith("token_chunked") for n in record.forward.graph.nodes) else "layers whole"),
             f"predicted step {predicted.total_s:.3f} s (compute {predicted.compute_s:.3f}, h2d {predicted.h2d_s:.3f}, "
             f"d2h {predicted.d2h_s:.3f}, host optimizer {predicted.host_optimizer_s:.3f}, stalls "
             f"{predicted.exposed_wait_s:.3f}, host ops {host_s:.3f}); forward {predicted.forward.total_s:.3f}, "
             f"backward {predicted.backward.total_s:.3f}, host optimizer done at {optimizer_end:.3f}", ""]
    template = record.plan.template
    if template:  # planned on short copies of the step (template_planner)
        kept = {layer: row["name"] for layer, row in record.plan.layer_costs.items()}
        lines += [f"template planner: {template['repeated_layers']} repeated layers on copies of "
                  f"{' and '.join(map(str, template['template_layers']))} layers; {template['candidates']} candidates "
                  f"built there, {template.get('per_layer_mixes', 0)} per-layer splits priced from them; "
                  f"{template['full_builds']} full build(s); extrapolated {format_bytes(template['extrapolated_peak'])}, "
                  f"{template['extrapolated_seconds']:.3f} s",
                  "per layer: " + "; ".join(_runs(kept)), ""]
    if ladders:
        candidates, rungs = ladders[-1]
        lines.append("plans built (* on the ladder): peak, predicted step, recomputed ops")
        for c in sorted(candidates, key=lambda c: (c.peak, c.plan.predicted_seconds or 0)):
            mark = "*" if c in rungs else " "
            fits = "fits" if c.peak <= budget else "    "
            lines.append(f"  {mark} {fits} {c.peak / 2**30:8.2f} GiB {c.plan.predicted_seconds or 0:7.3f} s "
                         f"{len(c.plan.recomputed_ops):6d}  {c.plan.policy}")
    write_result("\n".join(lines), "runtime_plan-{date}-cpu-{cores}core.txt", args.out)


if __name__ == "__main__":
    main()
