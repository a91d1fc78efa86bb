"""How much host optimizer time the step exposes, with and without overlap (issue 4).

Three copies of one model train side by side, step by step interleaved (this machine is
noisy), under ``backend="megatrain"``:
- "no optimizer": forward + backward + ``zero_grad()``: the step without any update;
- "synchronous": ``overlap_optimizer=False``: the fused host AdamW runs after the backward;
- "overlapped": the default: each layer's AdamW update runs on a host worker thread as its
  gradients land, while the backward goes on (megacompile/optimizer/overlap.py).
Exposed optimizer time = a variant's median step time minus "no optimizer"'s.

On the CPU stand-in the "device" is the same CPU as the host: the device lane and the host
optimizer compete for the same cores and memory bandwidth, which a GPU machine does not.
``--threads`` sets torch's intra-op threads, used by the device lane's compute and by the
host AdamW kernel alike: with 1 on a 2-core machine, the device lane and the host worker
each get a core, which is closer to a GPU machine (there the device computes on the GPU).

    python benchmarks/optimizer_overlap.py [--width 1024] [--depth 8] [--batch 64] [--steps 15]
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from _machine import cpu_model, write_result  # noqa: E402

import megacompile  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--lowering", default="eager", choices=("eager", "inductor"))
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--trace", default=None, help="write a Chrome trace of one overlapped step here")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    layers = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    base = nn.Sequential(*layers, nn.Linear(args.width, 16))
    n_params = sum(p.numel() for p in base.parameters())
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, 16)

    def variant(overlap: bool, update: bool):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # The whole step is compiled, so both updating variants run the same fused host
        # AdamW kernel: only when it runs differs.
        if update:
            def step():
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
        else:
            def step():
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.zero_grad()
        return torch.compile(step, backend="megatrain",
                             options={"device": "cpu", "lowering": args.lowering, "overlap_optimizer": overlap})

    variants = {
        "no optimizer": variant(overlap=True, update=False),
        "synchronous": variant(overlap=False, update=True),
        "overlapped": variant(overlap=True, update=True),
    }
    stats = {}
    for name, step in variants.items():
        for _ in range(3):  # compile, optimizer state, the overlapped path's recompile of step()
            step()
        stats[name] = megacompile.last_report().optimizer
    assert stats["overlapped"]["overlapped"], stats["overlapped"]
    assert not stats["synchronous"]["overlapped"]

    times = {name: [] for name in variants}
    lander = []
    for _ in range(args.steps):
        for name, step in variants.items():  # interleaved: noise hits all variants alike
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
            if name == "overlapped":
                lander.append(megacompile.last_report().optimizer)

    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    exposed_sync = med["synchronous"] - med["no optimizer"]
    exposed_overlap = med["overlapped"] - med["no optimizer"]
    update_ms = statistics.median(s["update_seconds"] for s in lander) * 1e3
    waited_ms = statistics.median(s["exposed_seconds"] for s in lander) * 1e3
    lines = [
        f"# optimizer_overlap: {datetime.date.today()} on {cpu_model()} ({os.cpu_count()} cores), "
        f"torch {torch.__version__}, {platform.python_version()}",
        f"# MLP width {args.width} depth {args.depth} batch {args.batch} ({n_params / 1e6:.1f}M params), AdamW fp32, "
        f"lowering={args.lowering}, CPU stand-in; median of {args.steps} interleaved steps; "
        f"torch threads {torch.get_num_threads()}",
        f"{'variant':16}{'step ms':>10}{'exposed optimizer ms':>22}",
        f"{'no optimizer':16}{med['no optimizer']:10.2f}{'-':>22}",
        f"{'synchronous':16}{med['synchronous']:10.2f}{exposed_sync:22.2f}",
        f"{'overlapped':16}{med['overlapped']:10.2f}{exposed_overlap:22.2f}",
        f"exposed optimizer time, overlapped / synchronous: {exposed_overlap / exposed_sync:.2f}"
        if exposed_sync > 0 else "exposed optimizer time, synchronous: not measurable (<= 0)",
        f"overlapped path: updates took {update_ms:.2f} ms on the worker per step; the backward waited "
        f"{waited_ms:.2f} ms for them at its end",
    ]
    if args.trace:
        if hasattr(megacompile, "trace_runtime"):
            with megacompile.trace_runtime(args.trace):
                variants["overlapped"]()
            lines.append(f"Chrome trace of one overlapped step: {args.trace}")
        else:
            lines.append("(this build has no runtime trace)")
    write_result("\n".join(lines), "optimizer_overlap-{date}-cpu-{cores}core-" + f"{torch.get_num_threads()}thread.txt",
                 args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
