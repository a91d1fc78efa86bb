"""Measure the current machine and produce a HardwareProfile.

`megacompile calibrate` runs a handful of micro-benchmarks, each warmed up and
reported as the median of several repeats:

* dense matmul FLOP/s on the device, fp32 (true FP32: TF32 is switched off for the
  measurement) and bf16;
* host->device and device->host copy bandwidth from/to pinned host memory;
* device memory bandwidth (device-to-device copy) and capacity;
* host memory bandwidth (large-array copy, STREAM convention: read + write bytes);
* host cores and RAM;
* host AdamW throughput as the host optimizer runs it (megacompile's fused kernel, bf16
  gradients in and bf16 weight copies out; torch's fused AdamW where the kernel does not build).

Without CUDA the device is the host CPU (the "cpu-standin" setup): the link is a
memcpy between two host buffers, so h2d/d2h are that memcpy's bandwidth and device
memory bandwidth is host memory bandwidth. The device memory capacity of the CPU
stand-in is a budget rather than a measurement: the cpu-standin default, capped at
half of host RAM.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from megacompile.plan.hardware import GiB, HardwareProfile, get_profile, profile_to_json
from megacompile.runtime.host_adam import fused_adam_step, host_adam_available

MiB = 1024**2


@dataclass(frozen=True)
class _Sizes:
    """How big and how many: quick mode trades accuracy for a short run on a small CPU."""

    matmul_n: int
    copy_bytes: int
    adamw_params: int
    warmup: int
    repeats: int
    budget_s: float  # soft cap on the timed repeats of one measurement


def _sizes(device: torch.device, quick: bool) -> _Sizes:
    if device.type == "cuda":
        # GPU matmuls need to be big to reach peak; copies big enough to hide latency.
        if quick:
            return _Sizes(4096, 256 * MiB, 4_000_000, warmup=2, repeats=5, budget_s=2.0)
        return _Sizes(8192, 1024 * MiB, 32_000_000, warmup=3, repeats=10, budget_s=10.0)
    if quick:
        return _Sizes(1024, 64 * MiB, 2_000_000, warmup=1, repeats=5, budget_s=1.0)
    return _Sizes(2048, 256 * MiB, 16_000_000, warmup=2, repeats=7, budget_s=5.0)


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _median_seconds(fn: Callable[[], None], sync: Callable[[], None], sizes: _Sizes) -> float:
    """Median wall time of fn() after warmup.

    Stops early once budget_s is spent (but always takes at least 3 samples), so a
    slow machine still finishes in bounded time.
    """
    for _ in range(sizes.warmup):
        fn()
    sync()
    samples: list[float] = []
    spent = 0.0
    while len(samples) < sizes.repeats and (len(samples) < 3 or spent < sizes.budget_s):
        start = time.perf_counter()
        fn()
        sync()
        elapsed = time.perf_counter() - start
        samples.append(elapsed)
        spent += elapsed
    return statistics.median(samples)


@contextlib.contextmanager
def _true_fp32_matmul() -> Iterator[None]:
    # With TF32 allowed, an "fp32" matmul on Ampere+ runs on tensor cores at ~8x the
    # FP32 rate; the profile's fp32 number must be the honest one.
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, sizes: _Sizes) -> float:
    n = sizes.matmul_n
    a = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    with _true_fp32_matmul():
        seconds = _median_seconds(lambda: torch.mm(a, b, out=out), _synchronizer(device), sizes)
    return 2 * n**3 / seconds


def measure_link_bandwidth(device: torch.device, sizes: _Sizes) -> tuple[float, float]:
    """(h2d, d2h) bytes/s between pinned host memory and the CUDA device."""
    numel = sizes.copy_bytes // 4
    host = torch.empty(numel, dtype=torch.float32, pin_memory=True)
    host.fill_(1.0)
    dev = torch.empty(numel, dtype=torch.float32, device=device)
    sync = _synchronizer(device)
    h2d = sizes.copy_bytes / _median_seconds(lambda: dev.copy_(host, non_blocking=True), sync, sizes)
    d2h = sizes.copy_bytes / _median_seconds(lambda: host.copy_(dev, non_blocking=True), sync, sizes)
    return h2d, d2h


def measure_copy_bandwidth(device: torch.device, sizes: _Sizes) -> float:
    """Bytes/s of memcpy within one memory, counting read + write (STREAM 'copy')."""
    numel = sizes.copy_bytes // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.zeros(numel, dtype=torch.float32, device=device)  # zeros: pages touched before timing
    seconds = _median_seconds(lambda: dst.copy_(src), _synchronizer(device), sizes)
    return 2 * sizes.copy_bytes / seconds


def measure_host_adamw(sizes: _Sizes) -> tuple[float, str]:
    """(params/s, which implementation) for one AdamW step as megatrain's host optimizer runs it:
    its fused kernel (``runtime/host_adam.py``) reading bf16 gradients and writing each weight's
    bf16 copy in the same pass, as under ``precision="bf16"`` (28 bytes a parameter, as an fp32
    update moves too). Where that kernel does not build: torch's fused AdamW on fp32."""
    # A few tensors rather than one, like real layers; fp32 master weights and state.
    chunks = 4
    per_chunk = sizes.adamw_params // chunks
    params = [torch.randn(per_chunk) for _ in range(chunks)]
    if host_adam_available():
        grads = [torch.randn(per_chunk).to(torch.bfloat16) for _ in range(chunks)]
        exp_avgs = [torch.zeros(per_chunk) for _ in range(chunks)]
        exp_avg_sqs = [torch.zeros(per_chunk) for _ in range(chunks)]
        copies = [p.to(torch.bfloat16) for p in params]

        def step() -> None:
            fused_adam_step(params, grads, exp_avgs, exp_avg_sqs, 1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.01, decoupled=True, bf16_copies=copies)

        seconds = _median_seconds(step, lambda: None, sizes)
        return per_chunk * chunks / seconds, "megacompile's fused kernel (bf16 gradients, bf16 weight copies)"
    params = [torch.nn.Parameter(p) for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    try:
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
        optimizer.step()  # fails here, not at construction, on builds without the CPU kernel
        kind = "torch fused"
    except (RuntimeError, NotImplementedError):
        optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        kind = "torch foreach"
    seconds = _median_seconds(optimizer.step, lambda: None, sizes)
    return per_chunk * chunks / seconds, kind


def host_cores() -> int:
    # Cores this process may use (cgroup/affinity limits), not the machine's total.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def host_memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"invalid device {device!r}: expected 'auto', 'cpu' or 'cuda[:N]'") from e
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"calibrate supports 'auto', 'cpu' and 'cuda[:N]', not {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _hostname() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "localhost"


def calibrate(device: str = "auto", quick: bool = False) -> HardwareProfile:
    """Measure this machine; device is 'auto' (CUDA if available, else CPU), 'cpu' or 'cuda[:N]'."""
    dev = _resolve_device(device)
    sizes = _sizes(dev, quick)

    flops_fp32 = measure_matmul_flops(dev, torch.float32, sizes)
    flops_bf16 = measure_matmul_flops(dev, torch.bfloat16, sizes)
    host_bw = measure_copy_bandwidth(torch.device("cpu"), sizes)
    adamw, adamw_kind = measure_host_adamw(sizes)
    ram = host_memory_bytes()

    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        h2d, d2h = measure_link_bandwidth(dev, sizes)
        hbm_bw = measure_copy_bandwidth(dev, sizes)
        hbm_bytes = int(props.total_memory)
        description = f"{props.name} (measured), host {host_cores()} cores"
        link_note = "h2d/d2h pinned-memory copies"
    else:
        # CPU stand-in: the "link" is a memcpy between two host buffers, which is the
        # very copy host_bw timed; it moves each byte once, host_bw counts read+write.
        h2d = d2h = host_bw / 2
        hbm_bw = host_bw
        hbm_bytes = get_profile("cpu-standin").hbm_bytes
        if ram is not None:
            hbm_bytes = min(hbm_bytes, ram // 2)
        description = (
            f"CPU stand-in (measured): host CPU as device, {hbm_bytes / GiB:.1f} GiB device-memory budget, "
            "link = host memcpy"
        )
        link_note = "h2d/d2h = host memcpy (no real link on a CPU-only machine)"

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    return HardwareProfile(
        name=f"calibrated-{_hostname()}",
        description=description,
        device_flops_fp32=flops_fp32,
        device_flops_bf16=flops_bf16,
        hbm_bytes=hbm_bytes,
        hbm_bandwidth=hbm_bw,
        h2d_bandwidth=h2d,
        d2h_bandwidth=d2h,
        host_memory_bandwidth=host_bw,
        host_cores=host_cores(),
        host_adamw_params_per_s=adamw,
        source=(
            f"measured by megacompile calibrate{' --quick' if quick else ''} on {_hostname()} at {stamp}, "
            f"torch {torch.__version__}; medians of up to {sizes.repeats} repeats; {link_note}; AdamW {adamw_kind}"
        ),
        host_memory_bytes=ram,
    )


# --- command line -------------------------------------------------------------


def default_output_path() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "megacompile", f"profile-{_hostname()}.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megacompile calibrate`."""
    parser.add_argument("--out", default=None, metavar="PATH",
                        help=f"where to write the profile JSON (default: {default_output_path()})")
    parser.add_argument("--quick", action="store_true", help="smaller, fewer measurements (~10 s)")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON instead of a table")
    parser.add_argument("--device", default="auto", help="'auto' (default), 'cpu' or 'cuda[:N]'")


def format_profile(profile: HardwareProfile) -> str:
    """A human-readable table of a profile's numbers."""

    def rate(value: Optional[float], unit: str) -> str:
        if value is None:
            return "unknown"
        for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if value >= scale:
                return f"{value / scale:.2f} {prefix}{unit}"
        return f"{value:.2f} {unit}"

    def size(value: Optional[int]) -> str:
        return "unknown" if value is None else f"{value / GiB:.1f} GiB"

    rows = [
        ("profile", profile.name),
        ("description", profile.description),
        ("device matmul fp32", rate(profile.device_flops_fp32, "FLOP/s")),
        ("device matmul bf16", rate(profile.device_flops_bf16, "FLOP/s")),
        ("device memory", size(profile.hbm_bytes)),
        ("device memory bandwidth", rate(profile.hbm_bandwidth, "B/s")),
        ("host -> device", rate(profile.h2d_bandwidth, "B/s")),
        ("device -> host", rate(profile.d2h_bandwidth, "B/s")),
        ("host memory bandwidth", rate(profile.host_memory_bandwidth, "B/s")),
        ("host memory", size(profile.host_memory_bytes)),
        ("host cores", str(profile.host_cores)),
        ("host AdamW", rate(profile.host_adamw_params_per_s, "params/s")),
        ("source", profile.source),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def run(args: argparse.Namespace) -> int:
    """Entry point of `megacompile calibrate`; returns the process exit code."""
    print(f"calibrating ({'quick' if args.quick else 'full'}, device={args.device}) ...", file=sys.stderr)
    try:
        profile = calibrate(device=args.device, quick=args.quick)
    except ValueError as e:
        print(f"megacompile calibrate: error: {e}", file=sys.stderr)
        return 2
    out = os.path.expanduser(args.out) if args.out else default_output_path()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(profile_to_json(profile))
    if args.json:
        sys.stdout.write(profile_to_json(profile))
    else:
        print(format_profile(profile))
    print(f"wrote {out} (pass this path wherever a hardware profile name is accepted)", file=sys.stderr)
    return 0
