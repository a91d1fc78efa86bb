"""Throughput on a real GPU: megatrain streaming a Hugging Face Llama vs the same model resident.

Usage:  python benchmarks/gpu_throughput.py [--hidden 2048 --layers 8 --seq 1024 --batch 4]
            [--budget-frac 0.25] [--lowering inductor|eager] [--hardware NAME|PATH.json]
            [--steps 4] [--device cuda|cpu] [--precision fp32|bf16] [--no-resident]
            [--trace FILE.json] [--out FILE]

One run, side by side, from the same initial weights on the same batches:
  * megatrain: ``torch.compile(step, backend="megatrain")`` with the model on the host and a
    device budget of ``--budget-frac`` x (parameters + gradients + AdamW states): parameters
    stream in layer by layer, gradients stream out, AdamW runs on the host;
  * resident: plain PyTorch with everything on the device (the model fits here, so this is
    the ceiling a streaming system is measured against), eager, AdamW (foreach).
Both in full fp32 with TF32 off, or with ``--precision bf16`` both in bf16 compute with fp32
master weights, gradients and AdamW states (megatrain's ``precision="bf16"``; the resident side
under ``torch.autocast(bfloat16)``). For each it prints the median step time over ``--steps``
timed steps (after two warm-up steps, the first of which compiles), tokens/s and achieved
TFLOPS (6 x parameters x tokens plus causal attention, the MFU convention); for megatrain
also the planned and measured device peak, the budget, the bytes moved each way per step,
the cost model's predicted step time and the host optimizer's exposed time. The ratio
megatrain / resident is the number to read; the losses of the two are compared too
(largest relative difference over all steps).

``--no-resident`` is for a model whose training state does not fit the device: no baseline,
and no copy of the initial weights is kept (the host holds the training state once). The
host's peak resident set and the pinned bytes the runtime holds are printed beside the
plan's host-memory figure. ``--trace`` writes a Chrome trace of one more megatrain step
(megacompile.trace_runtime: the compute lane and the copy streams, timed with CUDA events).
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import cpu_model  # noqa: E402
from peer_systems.workload import parallel_initialized_llama  # noqa: E402  (the same weights for seed 0)
from reference_models import labels_training_step, training_state_bytes  # noqa: E402

import megacompile  # noqa: E402
from megacompile.capture.records import recording  # noqa: E402
from megacompile.plan.cost_model import predict_record  # noqa: E402
from megacompile.plan.hardware import get_profile  # noqa: E402

# Every graph megatrain compiles in this run, oldest first (filled by records.recording).
COMPILED: list = []

GiB = 1024**3


def build_llama(args):
    from transformers import LlamaForCausalLM

    config = llama_config(args)
    torch.manual_seed(0)
    if not args.parallel_init:
        return LlamaForCausalLM(config)
    return parallel_initialized_llama(config)


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 128), use_cache=False, attn_implementation=args.attn,
        tie_word_embeddings=False,
    )


def model_flops_per_step(model, args) -> float:
    """6 N T for the weights plus causal attention (QK^T and PV, forward and backward)."""
    n = sum(p.numel() for p in model.parameters()) - args.vocab * args.hidden  # the lookup does no matmul
    tokens = args.batch * args.seq
    attention = 6 * 2 * args.layers * args.batch * args.seq * args.seq * args.hidden / 2  # causal: half
    return 6 * n * tokens + attention


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def resident_training_step(model, precision: str, device: str):
    """labels_training_step, under autocast for bf16 (megatrain does this itself)."""
    step = labels_training_step(model)
    if precision == "fp32":
        return step

    def autocast_step(x):
        with torch.autocast(device, dtype=torch.bfloat16):
            return step(x)
    return autocast_step


def progress(message: str) -> None:
    """A line on stderr as each phase ends: a long run that is cut off still says how far it got."""
    print(f"[gpu_throughput {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def host_peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def timed_steps(step, batches, device: str) -> tuple[list[float], list[float]]:
    losses, times = [], []
    for x in batches:
        sync(device)
        start = time.perf_counter()
        loss = float(step(x))  # float(): the step is complete when its loss reaches the host
        sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss)
    return losses, times


def main(argv=None) -> int:
    has_cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if has_cuda else "cpu")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--budget-frac", type=float, default=0.25,
                   help="device budget as a fraction of parameters + gradients + AdamW states")
    p.add_argument("--lowering", choices=("inductor", "eager"), default=None,
                   help="default: inductor on cuda, eager on cpu")
    p.add_argument("--hardware", default=None, help="profile name or calibrate JSON for the cost model")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="Hugging Face attention implementation")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--no-resident", action="store_true",
                   help="skip the resident baseline (and keep no copy of the initial weights)")
    p.add_argument("--parallel-init", action="store_true",
                   help="draw the initial weights on all host cores (for models of billions of parameters)")
    p.add_argument("--trace", default=None, help="write a Chrome trace of one more megatrain step here")
    p.add_argument("--mark-repeats", action="store_true",
                   help="megacompile.mark_repeated_layers(model) before compiling (Dynamo traces one layer)")
    p.add_argument("--plan-repeats", choices=("auto", "template", "flat"), default=None,
                   help="the plan_repeats option (how marked repeated layers are planned)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = args.device
    lowering = args.lowering or ("inductor" if device == "cuda" else "eager")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    build_start = time.perf_counter()
    model = build_llama(args)
    build_s = time.perf_counter() - build_start
    progress(f"model built in {build_s:.0f} s")
    initial = None if args.no_resident else copy.deepcopy(model.state_dict())
    num_params = sum(p.numel() for p in model.parameters())
    state = training_state_bytes(model)
    budget = int(state * args.budget_frac)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen) for _ in range(args.steps + 2)]
    flops = model_flops_per_step(model, args)
    tokens = args.batch * args.seq

    options = {"device": device, "lowering": lowering, "memory_budget": budget, "precision": args.precision}
    if args.hardware:
        options["hardware"] = args.hardware
    if args.plan_repeats:
        options["plan_repeats"] = args.plan_repeats
    if args.mark_repeats:
        progress(f"marked {len(megacompile.mark_repeated_layers(model))} repeated layers")
    step = torch.compile(labels_training_step(model), backend="megatrain", options=options)
    start = time.perf_counter()
    warm_losses, warm_times = timed_steps(step, batches[:2], device)
    first_call_s = time.perf_counter() - start
    progress(f"first two megatrain calls (compile + warm-up) {first_call_s:.0f} s; losses {warm_losses}")
    ours, ours_t = timed_steps(step, batches[2:], device)
    ours = warm_losses + ours
    report = megacompile.last_report()
    if args.trace:
        with megacompile.trace_runtime(args.trace):
            step(batches[-1])
            sync(device)
    record = [r for r in COMPILED if r.backward is not None][-1]
    profile = get_profile(record.options.hardware_profile())
    prediction = predict_record(record, profile, tokens=tokens)
    host_rss = host_peak_rss_bytes()
    # The CUDA host allocator rounds each pinned block up to a power of two.
    pinned = torch.cuda.host_memory_stats().get("allocated_bytes.peak") if device == "cuda" else None
    del step, model
    torch._dynamo.reset()

    theirs, theirs_t, resident_peak = None, None, None
    if not args.no_resident:
        from transformers import LlamaForCausalLM

        reference = LlamaForCausalLM(llama_config(args))
        reference.load_state_dict(initial)
        reference.to(device)
        ref_step = resident_training_step(reference, args.precision, device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        theirs, theirs_t = timed_steps(ref_step, [x.to(device) for x in batches], device)
        theirs_t = theirs_t[2:]
        if device == "cuda":
            resident_peak = torch.cuda.max_memory_allocated()

    ours_s = statistics.median(ours_t)
    lines = [
        f"megatrain GPU throughput  {datetime.datetime.now():%Y-%m-%d %H:%M}",
        f"device: {device} ({torch.cuda.get_device_name() if device == 'cuda' else cpu_model()}), "
        f"host: {os.cpu_count()} cores ({cpu_model()}), torch {torch.__version__}, python {platform.python_version()}",
        f"model: HF Llama, hidden {args.hidden}, intermediate {args.intermediate}, layers {args.layers}, "
        f"heads {args.heads}/{args.kv_heads}, vocab {args.vocab}, attention {args.attn}: "
        f"{num_params / 1e9:.3f} B parameters",
        f"batch {args.batch} x seq {args.seq} = {tokens} tokens/step; "
        + ("fp32" if args.precision == "fp32" else "bf16 compute (autocast), fp32 master weights/grads/AdamW")
        + f", TF32 off; AdamW lr 1e-3; "
        f"model FLOPs/step {flops / 1e12:.1f} TFLOP",
        f"training state (params + grads + AdamW) {state / GiB:.2f} GiB; megatrain budget "
        f"{budget / GiB:.2f} GiB ({args.budget_frac:.0%}); lowering {lowering}; policy {report.policy}",
        f"layers marked by mark_repeated_layers: {args.mark_repeats}; plan_repeats {args.plan_repeats or 'auto'}; "
        f"template planning: {record.plan.template}",
        "",
        f"{'':<26}{'step s (median)':>16}{'tokens/s':>12}{'TFLOPS':>9}",
        f"{'megatrain (streaming)':<26}{ours_s:>16.3f}{tokens / ours_s:>12,.0f}{flops / ours_s / 1e12:>9.1f}",
    ]
    if theirs_t:
        theirs_s = statistics.median(theirs_t)
        lines.append(f"{'resident (plain PyTorch)':<26}{theirs_s:>16.3f}{tokens / theirs_s:>12,.0f}"
                     f"{flops / theirs_s / 1e12:>9.1f}")
        lines.append(f"megatrain / resident step time: {ours_s / theirs_s:.2f}x")
        rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs))
        lines.append(f"loss agreement over {len(ours)} steps: largest relative difference {rel:.2e} "
                     f"(first {ours[0]:.4f} vs {theirs[0]:.4f}, last {ours[-1]:.4f} vs {theirs[-1]:.4f})")
    measured = report.measured_peak_device_bytes
    lines += [
        "",
        f"megatrain step times (s): {', '.join(f'{t:.3f}' for t in ours_t)}; first two calls "
        f"(compile + warm-up) {first_call_s:.1f} s",
        f"megatrain losses, every step: {', '.join(f'{v:.4f}' for v in ours)}",
        f"predicted step time (cost model, profile {profile.name}): {prediction.total_s:.3f} s "
        f"(compute {prediction.compute_s:.3f}, h2d {prediction.h2d_s:.3f}, d2h {prediction.d2h_s:.3f}, "
        f"host optimizer {prediction.host_optimizer_s:.3f}; bottleneck {prediction.bottleneck}) "
        f"-> measured / predicted {ours_s / prediction.total_s:.2f}",
        f"device peak: planned {report.planned_peak_device_bytes / GiB:.3f} GiB, measured "
        + (f"{measured / GiB:.3f} GiB (measured / planned {measured / report.planned_peak_device_bytes:.3f}), "
           f"within budget: {measured <= budget}" if measured is not None else "not measured"),
        f"resident baseline device peak: {resident_peak / GiB:.2f} GiB" if resident_peak else None,
        f"device memory: {torch.cuda.get_device_properties(0).total_memory / GiB:.1f} GiB; training state / device "
        f"memory {state / torch.cuda.get_device_properties(0).total_memory:.2f}" if device == "cuda" else None,
        f"host: peak resident set {host_rss / GiB:.1f} GiB (process; model built in {build_s:.0f} s)"
        + (f", pinned by the CUDA host allocator (peak, power-of-two blocks) {pinned / GiB:.1f} GiB" if pinned is not None else ""),
        f"moved per step: host->device {report.h2d_bytes / GiB:.2f} GiB, device->host {report.d2h_bytes / GiB:.2f} GiB",
        f"host optimizer: {report.optimizer}",
        f"segments: {report.segments}",
        f"Chrome trace of one more step: {args.trace}" if args.trace else None,
    ]
    text = "\n".join(line for line in lines if line is not None)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    with recording(into=COMPILED):
        sys.exit(main())
