"""Which bf16 numerics megatrain's precision="bf16" gives on a GPU, beside eager autocast's.

megatrain traces the step on host tensors under ``torch.autocast("cpu", bfloat16)``, following
the op lists of the device that runs it (option ``autocast_lists``, core/autocast_lists.py):
on CUDA, CUDA autocast's (more ops forced to fp32 than CPU's, e.g. softmax, layer_norm, pow).
Eager training on a GPU uses ``torch.autocast("cuda")``, and cuBLAS may reduce bf16 GEMMs in
reduced precision (``allow_bf16_reduced_precision_reduction``, on by default). For each
reference model this prints the first-step loss (same weights, same batch) of: fp32 eager on
the GPU, eager CPU autocast, eager CPU autocast following CUDA's lists, eager CUDA autocast
(with and without reduced precision reductions), and megatrain bf16 on the GPU (eager
lowering) with CUDA's lists (the default) and with CPU's, each with its relative distance
from megatrain's and from fp32's.

    python benchmarks/bf16_autocast_policy.py [--out FILE]   (default benchmarks/results/bf16_autocast_policy-<date>-cuda.txt)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]  # run from a checkout, installed or not
from reference_models import REFERENCE_MODELS, make_training_step, training_state_bytes  # noqa: E402

import megacompile  # noqa: E402,F401
from megacompile.core.autocast_lists import cuda_autocast_lists  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import write_result  # noqa: E402


def first_loss(model, make_batch, loss_fn, device: str, autocast: str | None) -> float:
    x, y = make_batch(torch.Generator().manual_seed(1))
    model = copy.deepcopy(model).to(device)
    with torch.no_grad(), torch.autocast(autocast or "cpu", dtype=torch.bfloat16, enabled=autocast is not None):
        return float(loss_fn(model(x.to(device)), y.to(device)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    lines = [f"bf16 autocast policy, {datetime.datetime.now():%Y-%m-%d %H:%M}, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}; first-step loss; rel = |a - b| / |b|", ""]
    for name, (ctor, make_batch, loss_fn) in REFERENCE_MODELS.items():
        torch.manual_seed(0)
        model = ctor()
        row = {"fp32 (cuda)": first_loss(model, make_batch, loss_fn, "cuda", None),
               "cpu autocast (cpu)": first_loss(model, make_batch, loss_fn, "cpu", "cpu")}
        with cuda_autocast_lists():
            row["cpu autocast, cuda lists (cpu)"] = first_loss(model, make_batch, loss_fn, "cpu", "cpu")
        row["cuda autocast (cuda)"] = first_loss(model, make_batch, loss_fn, "cuda", "cuda")
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        row["cuda autocast, no reduced-precision reduction"] = first_loss(model, make_batch, loss_fn, "cuda", "cuda")
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        for label, lists in (("megatrain bf16 (cuda)", "device"), ("megatrain bf16, cpu lists (cuda)", "cpu")):
            ours = copy.deepcopy(model)
            step, _ = make_training_step(ours, loss_fn)
            step = torch.compile(step, backend="megatrain", options={
                "device": "cuda", "lowering": "eager", "precision": "bf16", "autocast_lists": lists,
                "memory_budget": training_state_bytes(model) // 4})
            row[label] = float(step(*make_batch(torch.Generator().manual_seed(1))))
            torch._dynamo.reset()
        mt, fp = row["megatrain bf16 (cuda)"], row["fp32 (cuda)"]
        lines.append(f"{name}:")
        for k, v in row.items():
            lines.append(f"  {k:<48}{v:>14.8f}   rel to megatrain {abs(v - mt) / abs(mt):.2e}   "
                         f"rel to fp32 {abs(v - fp) / abs(fp):.2e}")
    write_result("\n".join(lines), "bf16_autocast_policy-{date}-cuda.txt", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
