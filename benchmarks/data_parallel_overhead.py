"""What the data-parallel path costs when there is nothing to share (issue 21, item 5).

Two copies of one model train side by side in one process, step by step interleaved (the
machine is noisy), under ``backend="megatrain"``: "plain" is the ordinary compiled step;
"data parallel" is the same step after ``megacompile.data_parallel(model)`` in a process group
of world size 1 (gloo). A world of one rank has nothing to average, so its backward is the
plain one (no reducing sink, no all-reduce, no waits); what the ratio measures is what the
data-parallel model costs on top of that (its groups, the per-backward decisions, the report).
Overhead = the median step time of "data parallel" over "plain"; the issue's target is
<= 1.03x on one GPU.

    python benchmarks/data_parallel_overhead.py [--device cpu|cuda] [--width 1024] [--depth 8]
        [--batch 64] [--steps 15] [--shard-optimizer]

On the CPU stand-in the device lane and the host share the same cores, so this measures the
host-side bookkeeping of the data-parallel path, not a GPU's overlap of it.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from _machine import cpu_model, write_result  # noqa: E402

import megacompile  # noqa: E402


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 16))


def _step(model: nn.Module, device: str, budget: int | None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return torch.compile(step, backend="megatrain", options={"device": device, "memory_budget": budget})


def _timed(step, x, y, device: str) -> float:
    start = time.perf_counter()
    loss = step(x, y)
    if device == "cuda":
        torch.cuda.synchronize()
    float(loss)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-fraction", type=float, default=0.25,
                   help="memory_budget as a fraction of the training state (parameters stream)")
    p.add_argument("--shard-optimizer", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    plain = _model(args.width, args.depth)
    parallel = megacompile.data_parallel(copy.deepcopy(plain), shard_optimizer=args.shard_optimizer)
    n_params = sum(q.numel() for q in plain.parameters())
    budget = int(n_params * 16 * args.budget_fraction)
    steps = {"plain": _step(plain, args.device, budget), "data parallel": _step(parallel, args.device, budget)}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, 16, generator=gen)
    # The batch stays on the host like the model: the compiled step moves it (a CUDA batch beside a CPU
    # model is a device mismatch Dynamo rejects while tracing, as eager would at the first matmul).

    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.warmup + args.steps):
        order = list(steps) if i % 2 == 0 else list(reversed(steps))  # alternate who goes first
        for name in order:
            t = _timed(steps[name], x, y, args.device)
            if i >= args.warmup:
                times[name].append(t)
    for a, b in zip(plain.parameters(), parallel.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the same training, step for step

    med = {name: statistics.median(ts) for name, ts in times.items()}
    ratio = med["data parallel"] / med["plain"]
    machine = (torch.cuda.get_device_name() if args.device == "cuda"
               else f"{cpu_model()}, {os.cpu_count()} cores")
    lines = [
        f"data-parallel path at world size 1 vs the plain step  {datetime.datetime.now():%Y-%m-%d %H:%M}",
        f"machine: {machine}; torch {torch.__version__}; python {platform.python_version()}; device {args.device}",
        f"model: {args.depth} x Linear({args.width}) + GELU, {n_params / 1e6:.1f} M parameters; batch {args.batch}; "
        f"AdamW; memory_budget {budget} bytes ({args.budget_fraction} of the training state); "
        f"shard_optimizer={args.shard_optimizer}",
        f"command: python benchmarks/data_parallel_overhead.py {' '.join(sys.argv[1:])}",
        f"{args.steps} timed steps each after {args.warmup} warm-up steps, interleaved; parameters equal after",
        "",
    ]
    for name, ts in times.items():
        lines.append(f"{name:14s} median {med[name] * 1e3:8.1f} ms   min {min(ts) * 1e3:8.1f}   max {max(ts) * 1e3:8.1f}")
    lines += ["", f"data parallel / plain: {ratio:.3f}x (target <= 1.03x on one GPU)"]
    suffix = "" if args.device == "cpu" else "-" + torch.cuda.get_device_name().lower().replace(" ", "-")
    suffix += "-sharded" if args.shard_optimizer else ""
    write_result("\n".join(lines), f"data_parallel_overhead-{{date}}-{args.device}-{{cores}}core{suffix}.txt", args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
