"""Data-parallel training with the megatrain backend, launched with torchrun.

    torchrun --nproc-per-node 2 examples/train_data_parallel.py --device cpu --check
    torchrun --nproc-per-node 8 examples/train_data_parallel.py --device cuda --shard-optimizer

Each rank keeps its model on the CPU, calls ``megacompile.data_parallel(model)`` once, and
compiles the ordinary training step with ``backend="megatrain"``; it trains on its own slice
of every global batch, and the backward averages the gradients across the ranks. With
``--check``, rank 0 also trains a plain eager PyTorch copy on the whole global batch, and the
script exits 0 only when every rank's parameters equal that copy's (and each other's).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import megacompile

# fp32 tolerance for a few AdamW steps against eager on the concatenated batch: the ranks'
# averaged gradient and the global batch's differ only in rounding, but AdamW divides by
# sqrt(v) + eps, so a gradient near eps turns that rounding into a visible part of lr (two
# ranks: ~1e-7 here; three: ~2e-5).
ATOL, RTOL = 1e-4, 1e-4
# The averaged gradient itself: AdamW and clipping hide a gradient's scale, this check does not.
GRAD_ATOL = 1e-6
# bf16: the ranks' bf16 matmuls see other row blocks than the global batch's, so gradients
# round differently (about 2^-8 relative) before they are averaged, and AdamW turns a near-zero
# gradient of the other sign into a step the other way: parameters agree to a few lr.
BF16_GRAD_RTOL, BF16_GRAD_ATOL, BF16_ATOL = 2e-2, 4e-3, 3e-2


class Net(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16, help="samples per step over all ranks")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument("--clip", type=float, default=None, help="clip the global gradient norm to this")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--lowering", choices=["eager", "inductor"], default="eager")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: compute under autocast (the eager reference too), fp32 master weights")
    p.add_argument("--overlap", action="store_true", help="overlap the host optimizer with the backward")
    p.add_argument("--shard-optimizer", action="store_true", help="each rank holds 1/world of the AdamW state")
    p.add_argument("--reduce-gradients-on", choices=["auto", "host", "device"], default="auto",
                   help="average gradients on the GPU before their copies (NCCL) or on the host (gloo); "
                        "auto: the faster")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective waits for the other ranks")
    p.add_argument("--check", action="store_true", help="exit 1 unless the parameters equal eager training "
                   "on the concatenated global batch")
    return p.parse_args(argv)


def make_batches(args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    n = args.global_batch
    return [(torch.randn(n, args.width, generator=gen), torch.randn(n, 4, generator=gen)) for _ in range(args.steps)]


def train_step(model, opt, sched, x, y, args, sync) -> torch.Tensor:
    """One optimizer step over ``args.accumulate`` micro-batches of ``x``: the same function
    trains the rank's slice (compiled) and the whole global batch (eager reference)."""
    total = torch.zeros(())
    for k, (mx, my) in enumerate(zip(x.chunk(args.accumulate), y.chunk(args.accumulate))):
        with sync(k < args.accumulate - 1):  # gradients are averaged at the last micro-batch
            loss = F.mse_loss(model(mx), my) / args.accumulate
            loss.backward()
        total += loss.detach()
    if args.clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    sched.step()
    opt.zero_grad()
    return total


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % (world * args.accumulate):
        raise SystemExit(f"--global-batch {args.global_batch} must divide by world size x --accumulate")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))

    torch.manual_seed(0)
    model = Net(args.width, args.depth)  # on the CPU: megatrain streams it to this rank's device
    reference = copy.deepcopy(model) if args.check and rank == 0 else None
    megacompile.data_parallel(model, shard_optimizer=args.shard_optimizer, timeout=args.timeout,
                              reduce_gradients_on=args.reduce_gradients_on)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    options = {"device": args.device, "lowering": args.lowering, "overlap_optimizer": args.overlap,
               "precision": args.precision}

    def sync(skip: bool):
        return megacompile.no_sync(model) if skip else _nothing()

    @torch.compile(backend="megatrain", options=options)
    def compiled_step(x, y):
        # The common loop shape: the backend sees backward(); step(); zero_grad() (and may
        # overlap the update with the backward where nothing else runs in between).
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        return loss.detach()

    compiled_model = torch.compile(model, backend="megatrain", options=options)
    batches = make_batches(args)
    per_rank = args.global_batch // world
    ok = True
    if args.check:
        ok = _gradients_match(compiled_model, model, reference, batches[0], per_rank, args)
    for step, (x, y) in enumerate(batches):
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        if args.accumulate == 1 and args.clip is None:
            loss = compiled_step(x[mine], y[mine])
        else:
            # Accumulation or clipping: the model compiled, the loop around it eager.
            loss = train_step(compiled_model, opt, sched, x[mine], y[mine], args, sync)
        dist.all_reduce(loss)
        if rank == 0:
            print(f"step {step}: loss {loss.item() / world:.6f}", flush=True)
    if rank == 0:
        print(megacompile.last_report(), flush=True)

    ok = _same_on_every_rank(model) and ok
    if reference is not None:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
        # The reference runs the global batch: its micro-batches span every rank's slice of
        # them (rank-major within each micro-batch), as the ranks' averaged gradients do.
        for x, y in batches:
            order = torch.arange(args.global_batch).view(world, args.accumulate, -1).transpose(0, 1).reshape(-1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                train_step(reference, ref_opt, ref_sched, x[order], y[order], args, lambda skip: _nothing())
        atol = BF16_ATOL if args.precision == "bf16" else ATOL
        worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
        close = all(torch.allclose(p, q, atol=atol, rtol=RTOL) for p, q in zip(model.parameters(),
                                                                               reference.parameters()))
        print(f"parity with eager on the global batch: max |difference| {worst:.3g} "
              f"({'within' if close else 'OUTSIDE'} atol={atol}, rtol={RTOL})", flush=True)
        ok = ok and close
    verdict = torch.tensor([1 if ok else 0])
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    if args.check and not verdict.item():
        print(f"rank {rank}: CHECK FAILED", file=sys.stderr, flush=True)
        return 1
    return 0


def _gradients_match(compiled_model, model, reference, batch, per_rank: int, args) -> bool:
    """One backward on every rank's slice: rank 0's averaged ``param.grad`` against eager's
    gradient on the whole batch (then both are cleared)."""
    x, y = batch
    rank = dist.get_rank()
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    F.mse_loss(compiled_model(x[mine]), y[mine]).backward()
    close = True
    if reference is not None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            F.mse_loss(reference(x), y).backward()
        rtol, atol = (BF16_GRAD_RTOL, BF16_GRAD_ATOL) if args.precision == "bf16" else (RTOL, GRAD_ATOL)
        pairs = list(zip(model.parameters(), reference.parameters()))
        worst = max((p.grad - q.grad).abs().max().item() for p, q in pairs)
        close = all(torch.allclose(p.grad, q.grad, rtol=rtol, atol=atol) for p, q in pairs)
        print(f"averaged gradient vs eager on the global batch: max |difference| {worst:.3g} "
              f"({'within' if close else 'OUTSIDE'} atol={atol}, rtol={rtol})", flush=True)
        reference.zero_grad()
    model.zero_grad()
    return close


def _same_on_every_rank(model: nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = flat.clone()
    dist.broadcast(first, src=0)
    same = torch.equal(first, flat)
    if not same:
        print(f"rank {dist.get_rank()}: parameters differ from rank 0's", file=sys.stderr, flush=True)
    return same


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
