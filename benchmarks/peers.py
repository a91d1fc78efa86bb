"""megatrain side by side with the systems people use to train models larger than the GPU.

Usage:  python benchmarks/peers.py [--layers 8 --seq 4096 --batch 8 --steps 5 --budget 60GiB]
            [--systems megatrain,fsdp2_cpu_offload,...] [--hardware CALIBRATE.json]
            [--merge-into RESULT.json] [--out-dir benchmarks/results]

Every system trains the same Hugging Face Llama (Llama-2-7B's shape by default, as deep as
``--layers``), from the same weights, on the same batches, in bf16 compute with fp32 master
weights and AdamW, each in its own process on the same GPU, one after the other:
  megatrain                 torch.compile(step, backend="megatrain"), model on the host
  fsdp2_cpu_offload         FSDP2 fully_shard + CPUOffloadPolicy + MixedPrecisionPolicy + AC
  deepspeed_zero3_offload   DeepSpeed ZeRO-3, parameters and optimizer offloaded to the CPU
  megatrain_reference       MegaTrain's own code (carried in .peers/MegaTrain, not in the repo)
  resident_torch_compile    everything on the GPU, torch.compile, where it fits
(one module per system in benchmarks/peer_systems/). A system that fails is listed with its
error. The step time is the median of the steps after the first two (compile and warm-up);
tokens/s and TFLOPS follow from it (6 x params x tokens, MegaTrain's formula, and with causal
attention). Host memory: the worker's peak RSS, and its process tree's peak (the worker's RSS plus
its descendants' PSS, e.g. Inductor's compile workers: ``host_memory_sample``), sampled here.

Writes ``peers-<date>-<gpu>.json`` and a ``.txt`` table beside it; ``--merge-into`` adds this
run's systems to an earlier file of the same workload (a device call is at most 10 minutes,
so the systems may run in two calls).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # peer_systems, and megacompile from this checkout

from peer_systems.workload import Workload  # noqa: E402

SYSTEMS = ("megatrain", "fsdp2_cpu_offload", "deepspeed_zero3_offload", "megatrain_reference",
           "resident_torch_compile")
WARMUP_STEPS = 2
GiB = 1024**3


# ----------------------------------------------------------------------------- worker side

def run_worker(system: str, workload: Workload, result_path: str) -> int:
    """Train with one system in this process and write its measurements to ``result_path``."""
    import importlib
    import resource

    import torch

    result: dict = {"error": None}
    start = time.perf_counter()
    try:
        module = importlib.import_module(f"peer_systems.{system}")
        out = module.train(workload)
        times, losses = out.pop("step_times"), out.pop("losses")
        steady = times[WARMUP_STEPS:] or times
        step_s = statistics.median(steady)
        result.update(
            step_times=times, losses=losses, step_s=step_s,
            tokens_per_s=workload.tokens_per_step / step_s,
            tflops_6nt=workload.flops_6nt() / step_s / 1e12,
            tflops_with_attention=workload.flops_with_attention() / step_s / 1e12,
            **out,
        )
    except BaseException as exc:  # noqa: B036 - a failed peer is a result, not a crash
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    result["wall_s"] = time.perf_counter() - start
    if torch.cuda.is_available():
        result["allocated_peak_bytes"] = torch.cuda.max_memory_allocated()
        result["reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
        result["gpu"] = torch.cuda.get_device_name()
    result["worker_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["torch"] = torch.__version__
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


# ----------------------------------------------------------------------------- driver side

def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB


def _status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _descendants(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        p = stack.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                found += kids
                stack += kids
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def host_memory_sample(pid: int) -> dict:
    """The worker's resident set, and its process tree's: the worker's RSS plus each descendant's
    proportional set size (PSS). A sum of RSS over the tree counts pages the processes share once per
    process: Inductor's 16 compile workers, forked from one sidecar, came to 6.5 GiB of summed RSS on
    the GPU machine (2026-11-27); PSS splits each shared page among its sharers. The worker's own PSS
    is not read: /proc/PID/smaps_rollup walks the page tables of its ~100 GiB every time."""
    sample = {"rss": 0, "tree": 0, "tree_rss_sum": 0}
    try:
        sample["rss"] = _status_bytes(pid, "VmRSS:")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return sample
    sample["tree"] = sample["tree_rss_sum"] = sample["rss"]
    for child in _descendants(pid):
        try:
            sample["tree_rss_sum"] += _status_bytes(child, "VmRSS:")
            with open(f"/proc/{child}/smaps_rollup") as f:
                sample["tree"] += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (FileNotFoundError, ProcessLookupError, PermissionError, StopIteration):
            continue
    return sample


def run_system(system: str, workload: Workload, timeout_s: float, log_dir: str) -> dict:
    """One system in its own process; its host memory (``host_memory_sample``) is sampled every 0.2 s."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    log_path = os.path.join(log_dir, f"{system}.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system,
           "--workload", json.dumps(dataclasses.asdict(workload)), "--result", result_path]
    print(f"[peers {time.strftime('%H:%M:%S')}] {system} ...", file=sys.stderr, flush=True)
    peak = {"rss": 0, "tree": 0, "tree_rss_sum": 0}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        done = threading.Event()

        def sample():
            while not done.wait(0.2):
                for key, value in host_memory_sample(proc.pid).items():
                    peak[key] = max(peak[key], value)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
            code = f"timeout after {timeout_s:.0f} s"
        done.set()
        sampler.join()
    try:
        with open(result_path) as f:
            result = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        with open(log_path) as f:
            # Python's warnings (and the source line each quotes) say nothing about why the worker died.
            lines = [line.rstrip() for line in f if line.strip() and "Warning:" not in line
                     and not line.startswith("  ")]
        tail = "\n".join(lines[-8:])[-1200:] or "(nothing but warnings)"
        result = {"error": f"worker ended without a result (exit {code}; -9 is a kill, e.g. host out of memory; "
                           f"its RSS peaked at {peak['rss'] / GiB:.1f} GiB of the host's {host_memory_gib():.0f}); "
                           f"the log's last lines: {tail}"}
    os.unlink(result_path) if os.path.exists(result_path) else None
    # The worker's peak RSS as the kernel kept it (ru_maxrss) where it reported one: no sample misses it.
    result["host_rss_peak_bytes"] = max(result.get("worker_maxrss_bytes") or 0, peak["rss"])
    result["host_tree_peak_bytes"] = peak["tree"]
    result["host_tree_rss_sum_peak_bytes"] = peak["tree_rss_sum"]
    result.setdefault("budget_bytes", workload.budget_bytes if system == "megatrain" else None)
    status = result["error"] or f"{result['step_s']:.3f} s/step, {result['tflops_6nt']:.1f} TFLOPS (6NT)"
    print(f"[peers {time.strftime('%H:%M:%S')}] {system}: {status}", file=sys.stderr, flush=True)
    return result


FIELDS = ("tokens_per_s", "tflops_6nt", "tflops_with_attention", "allocated_peak_bytes", "reserved_peak_bytes",
          "budget_bytes", "host_rss_peak_bytes", "host_tree_peak_bytes", "losses", "error")


def table(doc: dict) -> str:
    w = doc["workload"]
    lines = [
        f"megatrain and its peers, side by side  {doc['date']}",
        f"gpu: {doc['gpu']}; host: {doc.get('host', '?')}; torch {doc.get('torch', '?')}",
        f"model: {doc['model']}: {doc['params'] / 1e9:.3f} B parameters",
        f"{w['batch']} x {w['seq']} = {doc['tokens_per_step']} tokens per step; bf16 compute, fp32 master weights, "
        f"AdamW lr {w['lr']}; step time = median of steps {WARMUP_STEPS + 1}..{w['steps']}",
        f"command: {doc['command']}",
        "",
        f"{'system':<26}{'step s':>8}{'tokens/s':>10}{'TFLOPS 6NT':>11}{'w/ attn':>9}{'alloc GiB':>10}"
        f"{'reserved':>9}{'host RSS':>9}{'tree':>7}  losses / error",
    ]
    for name in SYSTEMS:
        r = doc["systems"].get(name)
        if r is None:
            continue
        gib = lambda v: f"{v / GiB:.1f}" if v else "-"  # noqa: E731
        if r.get("error"):
            lines.append(f"{name:<26}{'-':>8}{'-':>10}{'-':>11}{'-':>9}{gib(r.get('allocated_peak_bytes')):>10}"
                         f"{gib(r.get('reserved_peak_bytes')):>9}{gib(r.get('host_rss_peak_bytes')):>9}"
                         f"{gib(r.get('host_tree_peak_bytes')):>7}  ERROR {r['error'][:300]}")
            continue
        losses = " ".join(f"{v:.4f}" for v in r["losses"])
        lines.append(f"{name:<26}{r['step_s']:>8.3f}{r['tokens_per_s']:>10,.0f}{r['tflops_6nt']:>11.1f}"
                     f"{r['tflops_with_attention']:>9.1f}{gib(r.get('allocated_peak_bytes')):>10}"
                     f"{gib(r.get('reserved_peak_bytes')):>9}{gib(r.get('host_rss_peak_bytes')):>9}"
                     f"{gib(r.get('host_tree_peak_bytes')):>7}  {losses}")
    ours = doc["systems"].get("megatrain")
    if ours and not ours.get("error"):
        lines.append("")
        for name in SYSTEMS[1:]:
            r = doc["systems"].get(name)
            if r and not r.get("error"):
                lines.append(f"megatrain / {name}: {ours['tokens_per_s'] / r['tokens_per_s']:.2f}x tokens/s")
        m = ours.get("megatrain", {})
        if m.get("predicted_step_s"):
            lines.append(f"megatrain step {ours['step_s']:.3f} s vs cost model {m['predicted_step_s']:.3f} s "
                         f"(measured / predicted {ours['step_s'] / m['predicted_step_s']:.2f}; {m.get('predicted')})")
            if m.get("predicted_step_s_at_in_step_adamw_rate"):
                rates = m.get("host_adamw_params_per_s") or {}
                lines.append(f"  priced with the host AdamW rate measured in the step ({rates.get('in_step', 0) / 1e9:.2f} "
                             f"G params/s; profile {rates.get('profile', 0) / 1e9:.2f}): "
                             f"{m['predicted_step_s_at_in_step_adamw_rate']:.3f} s (measured / predicted "
                             f"{ours['step_s'] / m['predicted_step_s_at_in_step_adamw_rate']:.2f})")
            if m.get("predicted_timeline"):
                lines.append(f"  cost model timeline: {m['predicted_timeline']}")
        if m.get("host_thread"):
            h = m["host_thread"]
            lines.append(f"megatrain host thread, one traced step: busy {h['busy_s']:.3f} s of {h['program_s']:.3f} s "
                         f"in its programs ({h['busy_fraction']:.0%}); instructions {h['instructions']}")
            if "working_s" in h:
                lines.append(f"  of which blocked on the device {h['blocked_s']:.3f} s, the thread's own work "
                             f"{h['working_s']:.3f} s ({h['working_fraction']:.0%} of the programs); waiting to stay "
                             f"within host_lead_layers {h['throttled_s']:.3f} s")
            if h.get("busy_s_by_kind"):
                lines.append("  busy by kind: " + ", ".join(
                    f"{k} {t * 1e3:.0f} ms ({h['instructions'].get(k, 0)})"
                    for k, t in sorted(h["busy_s_by_kind"].items(), key=lambda kv: -kv[1])))
        if m.get("compile_times") and ours.get("step_times"):
            c, first = m["compile_times"], ours["step_times"][0]
            parts = sum(v for k, v in c.items() if k.endswith("_s"))
            lines.append(f"megatrain first step {first:.1f} s: capture (AOTAutograd) {c['capture_s']:.1f} s, planning "
                         f"{c['planning_s']:.1f} s ({c['plans_built']} plans built), lowering {c['lowering_s']:.1f} s, "
                         f"segments (Inductor) {c['segments_s']:.1f} s; the rest (Dynamo, the step's own work) "
                         f"{first - parts:.1f} s")
        if ours.get("budget_bytes") and ours.get("allocated_peak_bytes"):
            lines.append(f"megatrain budget {ours['budget_bytes'] / GiB:.1f} GiB: allocated peak "
                         f"{ours['allocated_peak_bytes'] / ours['budget_bytes']:.2f}x, reserved peak "
                         f"{ours['reserved_peak_bytes'] / ours['budget_bytes']:.2f}x of it; host "
                         f"{m.get('host_bytes_per_param', 0):.1f} B/param by the report, RSS "
                         f"{ours['host_rss_peak_bytes'] / doc['params']:.1f} B/param, its process tree "
                         f"{(ours.get('host_tree_peak_bytes') or 0) / doc['params']:.1f} B/param (issue 17: RSS <= "
                         f"14 B/param x N + 6 GiB = {(14 * doc['params'] + 6 * GiB) / GiB:.1f} GiB)")
            lines.append(host_rss_breakdown(ours, m, doc["params"]))
    for name, r in doc["systems"].items():
        if not (r.get("notes") or r.get("wall_s")):  # listed above with its error only
            continue
        lines.append(f"{name}: {r.get('notes', '')}  (process wall {r.get('wall_s', 0):.0f} s; "
                     f"step times {', '.join(f'{t:.2f}' for t in r.get('step_times', []))})")
    return "\n".join(lines)


def host_rss_breakdown(ours: dict, report: dict, params: int) -> str:
    """megatrain's host RSS as the report's host buffers account for it, and against issue 17's
    target (14 B/param x N + 6 GiB): what is not a buffer is the process (CUDA context, torch, Python)."""
    rss = ours["host_rss_peak_bytes"]
    state = report.get("host_bytes_per_param", 0) * params
    arena, landing = report.get("offload_arena_bytes") or 0, report.get("gradient_landing_bytes") or 0
    target = 14 * params + 6 * GiB
    return (f"megatrain host RSS {rss / GiB:.1f} GiB = training state {state / GiB:.1f} + offloaded activations' buffer "
            f"{arena / GiB:.1f} + gradient landing {landing / GiB:.1f} + the rest {(rss - state - arena - landing) / GiB:.1f}"
            f"; the target {target / GiB:.1f} GiB {'met' if rss <= target else 'missed'} (its process tree "
            f"{(ours.get('host_tree_peak_bytes') or 0) / GiB:.1f} GiB)")


def write_result(doc: dict, args) -> tuple[str, str]:
    gpu = re.sub(r"[^a-z0-9]+", "-", (doc.get("gpu") or "unknown").lower()).strip("-")
    path = args.merge_into or os.path.join(
        args.out_dir, f"peers-{datetime.date.today()}-{gpu}{'-' + args.tag if args.tag else ''}.json")
    # The systems in their fixed order, whatever order the calls ran them in.
    doc["systems"] = {s: doc["systems"][s] for s in SYSTEMS if s in doc["systems"]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    text = table(doc)
    with open(os.path.splitext(path)[0] + ".txt", "w") as f:
        f.write(text + "\n")
    return path, text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--budget", default="60GiB", help="megatrain's memory_budget")
    p.add_argument("--hardware", default=None, help="megatrain's cost-model profile (name or calibrate JSON)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--timeout", type=float, default=540, help="seconds per system")
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--merge-into", default=None, help="add this run's systems to this earlier result file")
    p.add_argument("--tag", default="", help="appended to the result file name")
    args = p.parse_args(argv)
    if args.worker:
        return run_worker(args.worker, Workload(**json.loads(args.workload)), args.result)

    from megacompile.core.units import parse_bytes

    workload = Workload(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=args.heads,
                        kv_heads=args.kv_heads, vocab=args.vocab, seq=args.seq, batch=args.batch, steps=args.steps,
                        lr=args.lr, budget_bytes=parse_bytes(args.budget), hardware=args.hardware)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.merge_into:
        with open(args.merge_into) as f:
            doc = json.load(f)
        if doc["workload"] != dataclasses.asdict(workload):
            p.error(f"--merge-into {args.merge_into} holds another workload: {doc['workload']}")
        doc["command"] += f"  &&  {' '.join(['python', 'benchmarks/peers.py', *sys.argv[1:]])}"
    else:
        doc = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
               "command": " ".join(["python", "benchmarks/peers.py", *sys.argv[1:]]),
               "model": f"HF Llama (Llama-2-7B shape: hidden {args.hidden}, MLP {args.intermediate}, heads "
                        f"{args.heads}/{args.kv_heads}, vocab {args.vocab}), {args.layers} layers, sdpa attention",
               "params": workload.num_params(), "tokens_per_step": workload.tokens_per_step,
               "workload": dataclasses.asdict(workload), "systems": {}}
    os.makedirs(args.out_dir, exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix="peers-logs-")
    doc["host"] = f"{os.cpu_count()} cores, {host_memory_gib():.0f} GiB"
    doc["logs"] = log_dir
    for system in systems:
        result = run_system(system, workload, args.timeout, log_dir)
        doc["systems"][system] = result
        for key in ("gpu", "torch"):  # a system that died before it looked leaves them to the next one
            doc[key] = doc.get(key) or result.get(key)
        path, text = write_result(doc, args)  # after each system: a call cut off keeps what ran
    print(text)
    print(f"\nwrote {path} and its .txt; worker logs in {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
