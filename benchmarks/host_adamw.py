"""Host (CPU) AdamW throughput: megacompile's fused kernel vs torch, vs memory bandwidth.

Usage:  python benchmarks/host_adamw.py [--params 64M] [--repeats 7] [--threads N]
                                        [--target x86-64-v3] [--no-save]

Everything is measured in one process on the same buffers, with the variants interleaved
(each repeat runs every variant once, in a rotated order), so a noisy or throttling
machine affects all of them alike; the table reports the median (and the best) of the
repeats after warmup.

Byte accounting (fp32): an Adam step reads param, grad, exp_avg, exp_avg_sq (16 B) and
writes param, exp_avg, exp_avg_sq (12 B): 28 B per parameter. GB/s for the optimizer rows
is 28 B x parameters / time, i.e. the minimum traffic, whatever the implementation really
moves (torch's for-each/foreach paths make several passes and move much more).

Bandwidth references, all C++ loops in the same extension (same compiler, flags and
OpenMP pool and instruction-set target as the kernel), over buffers of the same total
size as the model:
  * rmw   : p += g; m += g; v += g, Adam's exact access pattern with trivial math
            (28 B/element). The ceiling for any one-pass optimizer step on this machine.
  * triad : a = b + s*c, STREAM's triad, counted STREAM's way (12 B/element; the
            write-allocate read of `a` that normal stores cause is not counted).
  * copy  : a = b, STREAM's copy (8 B/element, same convention).
"measured memory bandwidth" below is the highest of the three, so "ours / bandwidth" is
the conservative ratio.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BYTES_PER_PARAM = 28  # 16 read + 12 written


def _import_host_adam():
    try:
        from megacompile.runtime import host_adam  # installed package

        return host_adam
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "megacompile_host_adam_bench", REPO / "runtime" / "host_adam.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def _parse_count(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a count: {text!r}")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def model_like_shapes(total: int, d: int = 1024) -> list[int]:
    """Element counts of a decoder-only transformer's parameter list, summing to `total`.

    Per layer: two RMSNorm weights (d), q/k/v/o (d*d), gate/up/down (d*2816). Sizes that
    are not a multiple of the vector width (the 8191-row embedding, the odd bias) keep the
    kernel's remainder loops in the measurement, as a real model would.
    """
    hidden = 2816
    layer = [d, d * d, d * d, d * d, d * d, d, d * hidden, d * hidden, hidden * d, 3]
    shapes = [8191 * d]  # embedding
    while sum(shapes) < total:
        shapes.extend(layer)
    # Trim the tail so the total is exact.
    while sum(shapes) > total:
        excess = sum(shapes) - total
        if shapes[-1] > excess:
            shapes[-1] -= excess
        else:
            shapes.pop()
    return shapes


def machine_tag() -> str:
    slug = re.sub(r"\(r\)|\(tm\)|cpu|@.*", "", cpu_model().lower())
    slug = re.sub(r"[^a-z0-9]+", "-", slug).strip("-")
    return f"cpu-{os.cpu_count()}core-{slug}"


def isa_summary() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return "unknown"
    wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"]
    return " ".join(f for f in wanted if f in flags) or "no avx2"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=_parse_count, default=64 * 2**20, help="total parameters (default 64M)")
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats per variant (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--target", default=None,
                    help="the kernel's instruction-set target, e.g. x86-64, x86-64-v3, x86-64-v4 "
                         "(default: the best this CPU supports)")
    ap.add_argument("--no-foreach-false", action="store_true", help="skip the slow foreach=False reference")
    ap.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    host_adam = _import_host_adam()
    t0 = time.perf_counter()
    status = host_adam.host_adam_available()
    build_s = time.perf_counter() - t0
    if not status:
        print(f"host Adam kernel unavailable: {status.reason}", file=sys.stderr)
        return 1
    ops = host_adam.load_extension()
    target = args.target or status.target

    n = args.params
    shapes = model_like_shapes(n)
    torch.manual_seed(0)
    lr, betas, eps, wd = 1e-3, (0.9, 0.999), 1e-8, 0.01

    # Shared params and grads (every optimizer updates the same params; the values only
    # drift by lr-sized steps, which does not affect speed). Each optimizer has its own
    # state, allocated up front so no variant pays first-touch page faults while timed.
    params = [torch.randn(k).requires_grad_() for k in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad for p in params]

    # Our state is allocated as megatrain's host optimizer allocates it (and as torch.optim
    # does for the torch variants): per parameter, exp_avg then exp_avg_sq. Allocating all
    # exp_avgs and then all exp_avg_sqs instead puts the four streams of each tensor at
    # addresses equal modulo 2^21 or more (each group totals 2^28 bytes at 64M params),
    # where AMD Zen's L1 data cache aliases them (see runtime/csrc/host_adam_isa.h): the
    # kernel ran 2x (one thread) to 1.5x (two) slower there, and only ours had that layout.
    ours_m, ours_v = [], []
    for k in shapes:
        ours_m.append(torch.zeros(k))
        ours_v.append(torch.zeros(k))
    ours_steps = [torch.tensor(0.0) for _ in shapes]
    plist = [p.detach() for p in params]

    def ours():
        host_adam.fused_adam_step(
            plist, grads, ours_m, ours_v, ours_steps, lr=lr, beta1=betas[0], beta2=betas[1],
            eps=eps, weight_decay=wd, decoupled=True, target=target,
        )

    def torch_opt(**kw):
        opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, **kw)
        opt.step()  # creates the state outside the timed region
        return opt.step

    variants = {"ours (megacompile host_adam)": ours}
    variants["torch AdamW fused=True"] = torch_opt(fused=True)
    variants["torch AdamW foreach=True"] = torch_opt(foreach=True)
    if not args.no_foreach_false:
        variants["torch AdamW foreach=False"] = torch_opt(foreach=False)

    # Bandwidth probes over separate buffers of the same total size.
    a, b, c, d = (torch.rand(n) for _ in range(4))
    probes = {
        "rmw 4R/3W (C++ loop)": (lambda: ops.stream_rmw(a, b, c, d, 0, target), 28),
        "triad a=b+s*c (C++ loop)": (lambda: ops.stream_triad(a, b, c, 1.0001, 0, target), 12),
        "copy a=b (C++ loop)": (lambda: ops.stream_copy(a, b, 0, target), 8),
    }

    load_before = os.getloadavg()
    everything = {name: (fn, BYTES_PER_PARAM) for name, fn in variants.items()}
    everything.update(probes)
    names = list(everything)
    times = {name: [] for name in names}
    with torch.no_grad():
        for r in range(args.warmup + args.repeats):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                fn = everything[name][0]
                t = time.perf_counter()
                fn()
                dt = time.perf_counter() - t
                if r >= args.warmup:
                    times[name].append(dt)

    load_after = os.getloadavg()

    def row(name):
        bytes_per = everything[name][1]
        med = statistics.median(times[name])
        best = min(times[name])
        return med, best, n / med, bytes_per * n / med / 1e9, bytes_per * n / best / 1e9

    lines = []
    now = datetime.datetime.now()
    lines.append(f"host AdamW benchmark  {now:%Y-%m-%d %H:%M}  ({machine_tag()})")
    python = os.path.relpath(sys.executable)
    lines.append(f"command: {shlex.join([python if not python.startswith('..') else sys.executable] + sys.argv)}")
    lines.append(
        f"cpu: {cpu_model()} x{os.cpu_count()} logical, ISA: {isa_summary()}; torch {torch.__version__}, "
        f"threads {threads}, python {platform.python_version()}"
    )
    lines.append(
        f"kernel: target {target} (compiled: {', '.join(status.compiled_targets)}; "
        f"this CPU runs: {', '.join(status.cpu_targets)}), load/build took {build_s:.1f} s"
    )
    lines.append(
        f"problem: {n:,} fp32 params in {len(shapes)} tensors (transformer-like list), AdamW "
        f"lr={lr} betas={betas} eps={eps} wd={wd}; {args.warmup} warmup + {args.repeats} repeats, interleaved"
    )
    lines.append(
        f"1-min load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f} on {os.cpu_count()} "
        "logical CPUs (other processes competing for the cores make the medians noisy)"
    )
    lines.append(
        "accounting: optimizer rows move 28 B/param (read p,g,m,v = 16 B; write p,m,v = 12 B); "
        "rmw 28 B, triad 12 B, copy 8 B per element (STREAM convention: write-allocate not counted)"
    )
    lines.append("")
    header = f"{'variant':34s} {'median ms':>10s} {'best ms':>9s} {'Mparam/s':>10s} {'GB/s(med)':>10s} {'GB/s(best)':>10s}"
    lines.append(header)
    lines.append("-" * len(header))
    results = {}
    for name in names:
        med, best, pps, gbs, gbs_best = row(name)
        results[name] = (med, gbs)
        if name == next(iter(probes)):
            lines.append("-- memory bandwidth references --")
        mps = f"{pps / 1e6:10.1f}" if name in variants else f"{'-':>10s}"
        lines.append(
            f"{name:34s} {med * 1e3:10.1f} {best * 1e3:9.1f} {mps} {gbs:10.2f} {gbs_best:10.2f}"
        )
    lines.append("")

    ours_name = "ours (megacompile host_adam)"
    ours_t, ours_gbs = results[ours_name]
    bw_name = max(probes, key=lambda k: results[k][1])
    bw = results[bw_name][1]
    rmw_bw = results["rmw 4R/3W (C++ loop)"][1]
    fused_t = results["torch AdamW fused=True"][0]
    speed_vs_fused = fused_t / ours_t
    lines.append(f"ours / torch fused=True      : {speed_vs_fused:.2f}x speed (target >= 1.00x)")
    lines.append(f"ours / torch foreach=True    : {results['torch AdamW foreach=True'][0] / ours_t:.2f}x speed")
    if "torch AdamW foreach=False" in results:
        lines.append(f"ours / torch foreach=False   : {results['torch AdamW foreach=False'][0] / ours_t:.2f}x speed")
    lines.append(
        f"ours / measured bandwidth    : {ours_gbs / bw:.0%} of {bw:.2f} GB/s ({bw_name}) (target >= 60%)"
    )
    lines.append(f"ours / rmw 4R/3W stream      : {ours_gbs / rmw_bw:.0%} of {rmw_bw:.2f} GB/s (same access pattern)")
    verdict = []
    verdict.append("fused target " + ("MET" if speed_vs_fused >= 1.0 else "MISSED"))
    verdict.append("bandwidth target " + ("MET" if ours_gbs / bw >= 0.6 else "MISSED"))
    lines.append("verdict: " + ", ".join(verdict))

    text = "\n".join(lines)
    print(text)
    if not args.no_save:
        date = subprocess.run(["date", "+%F"], capture_output=True, text=True).stdout.strip() or f"{now:%Y-%m-%d}"
        out = REPO / "benchmarks" / "results" / f"host_adamw-{date}-{machine_tag()}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        print(f"\nwritten to {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
