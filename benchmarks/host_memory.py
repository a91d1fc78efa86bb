"""Host memory of a bf16 megatrain step, measured as process RSS (issue 17, item 1).

A Hugging Face Llama is built on the host (fp32, initialised in place), compiled with
``backend="megatrain"``, ``precision="bf16"`` and the host AdamW overlapped with the backward,
and trained a few steps on the CPU stand-in. A thread samples the process's resident set
every 20 ms; per step this prints the RSS after it and its peak during it, in bytes per
parameter above the RSS before the model was built, beside what ``last_report()`` counts
(fp32 weights 4 + AdamW 8 + persistent bf16 weight copies 2 = 14 B/param) and the stand-in's
own device peak (on the stand-in the "device" is host memory too; on CUDA it is not). The
compiled step trims the C heap after each backward (option release_host_heap, on by default;
``--keep-host-heap`` turns it off); the last line trims it once more (``malloc_trim``) to show
what the allocator still kept of freed memory.

    python benchmarks/host_memory.py [--layers 12] [--hidden 1024] [--budget 600MiB] [--steps 4]
        [--keep-host-heap] [--gradients-in-landing-buffers] [--out FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
from _machine import cpu_model, write_result  # noqa: E402
from reference_models import labels_training_step  # noqa: E402

import megacompile  # noqa: E402
from megacompile.core.units import parse_bytes  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    def __init__(self) -> None:
        self.peak = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.02)

    def restart(self) -> None:
        self.peak = rss_bytes()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--budget", default="600MiB")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lowering", default="eager", choices=("eager", "inductor"))
    p.add_argument("--keep-host-heap", action="store_true",
                   help="option release_host_heap=False: no malloc_trim after each backward")
    p.add_argument("--gradients-in-landing-buffers", action="store_true",
                   help="as before 2026-11-27: each bf16 gradient lands in host memory of its own, not in its "
                        "weight's bf16 copy (for a side-by-side run)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.gradients_in_landing_buffers:
        from megacompile.optimizer.overlap import GradientLander
        from megacompile.runtime.gradient_sink import GradientSink

        GradientLander.landing_place = GradientSink.landing_place  # the default sink's: offers none
    from transformers import LlamaConfig, LlamaForCausalLM

    sampler = PeakSampler()
    base = rss_bytes()
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64, max_position_embeddings=args.seq,
                         use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")  # fp32 on the host, no second copy made while building
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    n = sum(param.numel() for param in model.parameters())
    megacompile.mark_repeated_layers(model)
    step = labels_training_step(model, lr=1e-4)

    options = {"device": "cpu", "precision": "bf16", "memory_budget": parse_bytes(args.budget, "--budget"),
               "overlap_optimizer": True, "lowering": args.lowering, "release_host_heap": not args.keep_host_heap}
    compiled = torch.compile(step, backend="megatrain", options=options)
    x = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1))

    def per_param(b: int) -> str:
        return f"{(b - base) / n:6.2f}"

    rows = [("model built", per_param(rss_bytes()), per_param(sampler.peak), "", "")]
    for i in range(args.steps):
        sampler.restart()
        started = time.perf_counter()
        float(compiled(x))
        seconds = time.perf_counter() - started
        time.sleep(0.05)
        report = megacompile.last_report()
        overlapped = report.optimizer["overlapped"] if report.optimizer else None
        rows.append((f"step {i} ({seconds:.1f} s)", per_param(rss_bytes()), per_param(sampler.peak),
                     f"{report.measured_peak_device_bytes / n:6.2f}", str(overlapped)))
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rows.append(("after malloc_trim(0)", per_param(rss_bytes()), "", "", ""))
    report = megacompile.last_report()
    lines = [
        f"host memory of a bf16 megatrain step (CPU stand-in), {time.strftime('%Y-%m-%d %H:%M')}, {cpu_model()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}",
        f"command: python benchmarks/host_memory.py {' '.join(sys.argv[1:])}",
        f"HF Llama {args.layers} layers, hidden {args.hidden}, {n / 1e6:.1f} M parameters; batch 1 x {args.seq}; "
        f"budget {args.budget}; AdamW; options {options}",
        f"last_report(): host state {report.host_bytes_per_param:.2f} B/param "
        f"({', '.join(f'{k} {v / n:.2f}' for k, v in report.host_bytes.items())})",
        *([f"host optimizer: {report.optimizer['landed_in_weight_copies']} gradients landed in their weight's bf16 "
           f"copy; peak {report.optimizer['peak_pending_grad_bytes'] / n:.2f} B/param of gradients held for updates"]
          if report.optimizer else []),
        f"RSS before the model: {base / 2**30:.2f} GiB; columns in bytes per parameter above it",
        "",
        f"{'phase':<24}{'RSS after':>10}{'RSS peak':>10}{'device peak':>13}  optimizer overlapped",
    ]
    lines += [f"{a:<24}{b:>10}{c:>10}{d:>13}  {e}" for a, b, c, d, e in rows]
    write_result("\n".join(lines), "host_memory-{date}-cpu-{cores}core.txt", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
