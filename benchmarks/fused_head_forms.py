"""The LM head + loss, forward and backward, in its three forms side by side (issue 19: the fused
head must not be slower than the unfused one where both fit).

- unfused: ``F.cross_entropy(F.linear(h, W).float(), y)`` (the logits whole, four bytes a logit);
- two-op: ``lm_head_loss`` and ``lm_head_loss_backward`` (the backward makes each chunk's logits
  again: four head matmuls);
- with grads: ``lm_head_loss_and_grads`` (the gradients made in the forward from the same
  logits: three head matmuls, as unfused), what ``fuse_lm_head`` emits for a mean or sum loss.

Each iteration runs the three once, in a rotating order (the machine is noisy); the time is the
loss and ``torch.autograd.grad`` w.r.t. the hidden state and the weight, synchronised. Prints the
median per form and the ratios, and checks the forms' gradients agree.

    python benchmarks/fused_head_forms.py [--device cpu|cuda] [--tokens 2048] [--hidden 512]
        [--vocab 16000] [--chunk 512] [--dtype bf16|fp32] [--repeats 7] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _machine import cpu_model, write_result  # noqa: E402

from megacompile.core import fused_head  # noqa: E402


def _forms(chunk: int):
    def unfused(h, w, y):
        return F.cross_entropy(F.linear(h, w).float(), y)

    def two_op(h, w, y):
        return fused_head.lm_head_loss(h, w, None, y, chunk, -100, "mean", 0.0, torch.float32)[0]

    def with_grads(h, w, y):
        return fused_head.lm_head_loss_and_grads(h, w, None, y, chunk, -100, "mean", 0.0, torch.float32, True)[0]

    return {"unfused": unfused, "two-op": two_op, "with grads": with_grads}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out")
    args = p.parse_args()
    if args.device == "cuda":
        from megacompile.runtime import fused_head_triton

        fused_head_triton.register_for_cuda()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(args.tokens, args.hidden, generator=gen) / args.hidden ** 0.5).to(dtype).to(args.device)
    w = torch.randn(args.vocab, args.hidden, generator=gen).to(dtype).to(args.device)
    y = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(args.device)
    h.requires_grad_()
    w.requires_grad_()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    forms = _forms(args.chunk)
    grads, times = {}, {name: [] for name in forms}
    for i in range(args.repeats + 1):  # the first round warms up (kernels, allocator)
        names = list(forms)
        names = names[i % len(names):] + names[:i % len(names)]
        for name in names:
            sync()
            start = time.perf_counter()
            loss = forms[name](h, w, y)
            got = torch.autograd.grad(loss, (h, w))
            sync()
            if i:
                times[name].append(time.perf_counter() - start)
            grads[name] = got
    for name in ("two-op", "with grads"):
        for g, r in zip(grads[name], grads["unfused"]):
            scale = float(r.abs().max())
            torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2 * scale)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    machine = torch.cuda.get_device_name() if args.device == "cuda" else f"{cpu_model()}, {os.cpu_count()} cores"
    lines = [
        f"LM head + loss, forward and backward, three forms  (torch {torch.__version__})",
        f"machine: {machine}; device {args.device}",
        f"shape: {args.tokens} tokens x hidden {args.hidden} -> vocab {args.vocab}, {args.dtype}, chunks of "
        f"{args.chunk} tokens; mean loss; gradients w.r.t. the hidden state and the weight",
        f"command: python benchmarks/fused_head_forms.py {' '.join(sys.argv[1:])}",
        f"{args.repeats} timed rounds after one warm-up, the forms in a rotating order; gradients agree",
        "",
    ]
    for name, ts in times.items():
        lines.append(f"{name:12s} median {med[name] * 1e3:9.1f} ms   min {min(ts) * 1e3:9.1f}   max {max(ts) * 1e3:9.1f}")
    lines += ["", f"with grads / unfused: {med['with grads'] / med['unfused']:.3f}x (target <= 1.0)",
              f"with grads / two-op:  {med['with grads'] / med['two-op']:.3f}x",
              f"two-op / unfused:     {med['two-op'] / med['unfused']:.3f}x"]
    suffix = "cpu-{cores}core" if args.device == "cpu" else torch.cuda.get_device_name().lower().replace(" ", "-")
    write_result("\n".join(lines), "fused_head_forms-{date}-" + suffix + f"-{args.dtype}.txt", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
