"""One rank of tests/test_data_parallel.py: ``python data_parallel_worker.py OUTDIR`` with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (what torchrun sets).

It runs the scenarios in order on one gloo job and writes what it saw to OUTDIR/rank{R}.json;
the test asserts on those. Each scenario compares with a plain eager PyTorch model trained on
the concatenated global batch (computed on every rank: the models are tiny).
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

import megacompile

WIDTH, DEPTH, GLOBAL_BATCH = 16, 4, 8
OPTIONS = {"device": "cpu", "lowering": "eager"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def batches(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, WIDTH, generator=gen), torch.randn(GLOBAL_BATCH, WIDTH, generator=gen))
            for _ in range(n)]


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_every_rank(model) -> bool:
    mine = flat(model)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(mine, other) for other in everyone)


def max_diff(model, reference) -> float:
    return (flat(model) - flat(reference)).abs().max().item()


def state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")


def new_training(seed: int = 0, **dp):
    torch.manual_seed(seed)
    model = Net()
    reference = copy.deepcopy(model)
    megacompile.data_parallel(model, timeout=20, **dp)
    opts = []
    for m in (model, reference):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
        opts += [opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]
    return model, reference, *opts


def who_sees_rank0s_write(model, rank: int, world: int) -> list[int]:
    """Per rank, whether a value rank 0 writes into its parameter is what that rank's
    parameter holds, with no collective moving it (one copy in shared memory)."""
    p = next(iter(model.parameters()))
    old = p.detach()[0, 0].item()
    dist.barrier()
    if rank == 0:
        with torch.no_grad():
            p[0, 0] = 1234.5
    dist.barrier()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, int(p.detach()[0, 0].item() == 1234.5))
    dist.barrier()
    if rank == 0:
        with torch.no_grad():
            p[0, 0] = old
    dist.barrier()
    return everyone


def parameters_shared(model, rank: int) -> bool:
    """Whether rank 0's write reaches every rank through memory (rank 0 sees its own anyway)."""
    return all(who_sees_rank0s_write(model, rank, dist.get_world_size()))


def compiled_step_for(m, o, s):
    """The whole step compiled, the host optimizer overlapped with the backward."""
    @torch.compile(backend="megatrain", options={**OPTIONS, "overlap_optimizer": True})
    def step(x, y):
        loss = F.mse_loss(m(x), y)
        loss.backward()
        o.step()
        s.step()
        o.zero_grad()
        return loss.detach()
    return step


def train_overlapped(rank: int, world: int, step, data, eager_training) -> list[bool]:
    """``step`` on this rank's part of each batch, eager on the whole batch beside; whether
    each step's update overlapped the backward."""
    reference, ref_opt, ref_sched = eager_training
    per_rank = GLOBAL_BATCH // world
    overlapped = []
    for x, y in data:
        step(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
        overlapped.append(megacompile.last_report().optimizer["overlapped"])
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
    return overlapped


def accumulate_clip_and_step(rank: int, world: int, compiled, data, training, eager_training,
                             no_sync_steps=None, after_backward=None) -> float:
    """Steps of two micro-batches each (the first under no_sync in ``no_sync_steps``, None:
    every step), clipping on the global norm, the optimizer and scheduler after the backward;
    eager on the global batch beside. ``after_backward()`` is called after each backward.
    Returns the largest difference of an averaged gradient from eager's (AdamW and clipping
    would hide a wrong scale)."""
    (model, opt, sched), (reference, ref_opt, ref_sched) = training, eager_training
    per_rank = GLOBAL_BATCH // world
    grad_diff = 0.0
    for i, (x, y) in enumerate(data):
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank].chunk(2), y[rank * per_rank:(rank + 1) * per_rank].chunk(2)
        local = no_sync_steps is None or i in no_sync_steps
        with megacompile.no_sync(model) if local else contextlib.nullcontext():
            (F.mse_loss(compiled(xs[0]), ys[0]) / 2).backward()
        if after_backward is not None:
            after_backward()
        (F.mse_loss(compiled(xs[1]), ys[1]) / 2).backward()
        if after_backward is not None:
            after_backward()
        # Eager on the global batch: each micro-batch is every rank's k-th micro-batch.
        for k in range(2):
            idx = torch.cat([torch.arange(r * per_rank, (r + 1) * per_rank).chunk(2)[k] for r in range(world)])
            (F.mse_loss(reference(x[idx]), y[idx]) / 2).backward()
        grad_diff = max(grad_diff, max((p.grad - q.grad).abs().max().item()
                                       for p, q in zip(model.parameters(), reference.parameters())))
        for m, o, s in ((model, opt, sched), (reference, ref_opt, ref_sched)):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            o.step()
            s.step()
            o.zero_grad()
    return grad_diff


def accumulate_and_clip(rank: int, world: int) -> dict:
    """The model compiled inside an eager loop: two micro-batches (the first under no_sync),
    clipping on the global norm, a scheduler, the optimizer sharded, the parameters one copy
    in the host's shared memory."""
    model, reference, opt, sched, ref_opt, ref_sched = new_training(shard_optimizer=True)
    shared = parameters_shared(model, rank)
    compiled = torch.compile(model, backend="megatrain", options=OPTIONS)
    grad_diff = accumulate_clip_and_step(rank, world, compiled, batches(3, seed=1), (model, opt, sched),
                                         (reference, ref_opt, ref_sched))
    report = megacompile.last_report()
    return compiled, {"max_diff": max_diff(model, reference), "grad_diff": grad_diff,
                      "same_on_every_rank": same_on_every_rank(model),
            "state_bytes": state_bytes(opt), "reference_state_bytes": state_bytes(ref_opt),
            "report": report.data_parallel, "optimizer": report.optimizer, "parameters_shared": shared}


def overlapped_and_resumed(rank: int, world: int, outdir: str) -> tuple[dict, object]:
    """The whole step compiled, the host optimizer overlapped with the backward (updates wait
    for each layer's all-reduce), sharded, each rank with its own parameters (as on several
    hosts: owners broadcast their updates); a DCP checkpoint after two steps is loaded into a
    fresh model that goes on as the original does, and into a one-rank job."""
    model, reference, opt, sched, ref_opt, ref_sched = new_training(seed=3, shard_optimizer=True, shared_memory=False)
    shared = parameters_shared(model, rank)
    step = compiled_step_for(model, opt, sched)
    per_rank = GLOBAL_BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    data = batches(5, seed=2)
    overlapped = []
    checkpoint = os.path.join(outdir, "checkpoint")
    for i, (x, y) in enumerate(data):
        step(x[mine], y[mine])
        overlapped.append(megacompile.last_report().optimizer["overlapped"])
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        if i == 1:
            dcp.save({"model": model.state_dict(), "optim": megacompile.optimizer_state_dict(model, opt),
                      "sched": sched.state_dict()}, checkpoint_id=checkpoint)
    out = {"max_diff": max_diff(model, reference), "same_on_every_rank": same_on_every_rank(model),
           "overlapped": overlapped, "state_bytes": state_bytes(opt), "reference_state_bytes": state_bytes(ref_opt),
           "parameters_shared": shared, "report": megacompile.last_report().data_parallel}

    # Resume on the same ranks: a fresh model, optimizer and scheduler, loaded, go on.
    resumed, _, r_opt, r_sched, _, _ = new_training(seed=7, shard_optimizer=True, shared_memory=False)
    state = {"model": resumed.state_dict(), "optim": megacompile.optimizer_state_dict(resumed, r_opt),
             "sched": r_sched.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint)
    megacompile.load_optimizer_state_dict(resumed, r_opt, state["optim"])
    r_sched.load_state_dict(state["sched"])
    r_step = compiled_step_for(resumed, r_opt, r_sched)
    for x, y in data[2:]:
        r_step(x[mine], y[mine])
    out["resumed_max_diff"] = max_diff(resumed, model)

    # Resume on one rank: rank 0 alone (a one-rank group) reads both ranks' shards.
    solo = dist.new_group([0], backend="gloo")
    torch.manual_seed(11)
    alone = Net()
    # Every rank calls it (its process groups are made by the whole job); rank 1 is no member.
    megacompile.data_parallel(alone, process_group=solo, shard_optimizer=True, timeout=20)
    if rank == 0:
        a_opt = torch.optim.AdamW(alone.parameters(), lr=1e-2, weight_decay=0.01)
        state = {"model": alone.state_dict(), "optim": megacompile.optimizer_state_dict(alone, a_opt)}
        dcp.load(state, checkpoint_id=checkpoint, process_group=solo)
        megacompile.load_optimizer_state_dict(alone, a_opt, state["optim"])
        out["one_rank_state_bytes"] = state_bytes(a_opt)
        out["one_rank_lr"] = a_opt.param_groups[0]["lr"]
    return out, step


def averaged_on_the_device(rank: int, world: int) -> dict:
    """``reduce_gradients_on="device"``: each gradient's all-reduce runs on the (stand-in)
    device before its copy to the host. First an eager loop (the reducing sink): two synced
    micro-batches a step (the second adds the average to the first's), then a step whose first
    micro-batch is under no_sync (its local gradients must be averaged too: the host path);
    then the whole step compiled with the optimizer overlapped and sharded."""
    model, reference, opt, sched, ref_opt, ref_sched = new_training(seed=5, reduce_gradients_on="device")
    compiled = torch.compile(model, backend="megatrain", options=OPTIONS)
    reports = []
    grad_diff = accumulate_clip_and_step(
        rank, world, compiled, batches(3, seed=4), (model, opt, sched), (reference, ref_opt, ref_sched),
        no_sync_steps={2}, after_backward=lambda: reports.append(megacompile.last_report().data_parallel))
    out = {"grad_diff": grad_diff, "max_diff": max_diff(model, reference),
           "same_on_every_rank": same_on_every_rank(model), "reports": reports}

    model, reference, opt, sched, ref_opt, ref_sched = new_training(seed=6, shard_optimizer=True,
                                                                    reduce_gradients_on="device")

    overlapped = train_overlapped(rank, world, compiled_step_for(model, opt, sched), batches(4, seed=8),
                                  (reference, ref_opt, ref_sched))
    report = megacompile.last_report()
    out["overlapped"] = {"overlapped": overlapped, "max_diff": max_diff(model, reference),
                         "same_on_every_rank": same_on_every_rank(model), "report": report.data_parallel,
                         "d2h_bytes": report.d2h_bytes,
                         "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                         "owned_bytes": sum(p.numel() * p.element_size() for p in model.parameters()
                                            if megacompile_owner(model, p) == rank)}
    return out


def megacompile_owner(model, p) -> int:
    """The rank that updates ``p`` under the sharded optimizer."""
    from megacompile.runtime.data_parallel import group_of

    return group_of(model.parameters()).owner_of(p)


def rank_dies(rank: int, world: int, compiled) -> dict:
    """Rank 1 exits before a step; rank 0's backward must fail with a clear error, not hang."""
    x = torch.randn(GLOBAL_BATCH // world // 2, WIDTH)  # the micro-batch's shape: no recompile
    dist.barrier()
    if rank == 1:
        sys.stdout.flush()
        os._exit(17)
    started = time.perf_counter()
    try:
        F.mse_loss(compiled(x), x).backward()
    except Exception as e:  # noqa: BLE001 - the test reads what it was
        return {"error_type": type(e).__name__, "error": str(e), "seconds": time.perf_counter() - started}
    return {"error_type": None, "seconds": time.perf_counter() - started}


def two_hosts(rank: int, world: int) -> dict:
    """Four ranks on two hosts (``MEGACOMPILE_HOST_ID``), the optimizer sharded: each host keeps
    one copy of the parameters that its two ranks share, and updates cross between the hosts
    through one rank each. An eager loop (micro-batches under no_sync, clipping, the update
    after the backward), then the whole step compiled with the update overlapped, per layer."""
    model, reference, opt, sched, ref_opt, ref_sched = new_training(seed=9, shard_optimizer=True)
    # A write by rank 0 reaches rank 1 (same host) through memory, not rank 2 or 3.
    everyone = who_sees_rank0s_write(model, rank, world)
    compiled = torch.compile(model, backend="megatrain", options=OPTIONS)
    accumulate_clip_and_step(rank, world, compiled, batches(2, seed=10), (model, opt, sched),
                             (reference, ref_opt, ref_sched))
    eager_loop = {"max_diff": max_diff(model, reference), "same_on_every_rank": same_on_every_rank(model)}

    overlapped = train_overlapped(rank, world, compiled_step_for(model, opt, sched), batches(3, seed=11),
                                  (reference, ref_opt, ref_sched))
    return {"seen_rank0_write": everyone, "eager_loop": eager_loop, "overlapped": overlapped,
            "max_diff": max_diff(model, reference), "same_on_every_rank": same_on_every_rank(model),
            "report": megacompile.last_report().data_parallel, "state_bytes": state_bytes(opt),
            "reference_state_bytes": state_bytes(ref_opt)}


def main_two_hosts(outdir: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    result = {"two_hosts": two_hosts(rank, world)}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main(outdir: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    result: dict = {}
    path = os.path.join(outdir, f"rank{rank}.json")

    def save():
        with open(path, "w") as f:
            json.dump(result, f)

    compiled, result["accumulate_and_clip"] = accumulate_and_clip(rank, world)
    save()
    result["averaged_on_the_device"] = averaged_on_the_device(rank, world)
    save()
    result["overlapped_and_resumed"], _ = overlapped_and_resumed(rank, world, outdir)
    save()
    result["rank_dies"] = rank_dies(rank, world, compiled)
    save()
    os._exit(0)  # the group cannot be destroyed cleanly with a peer gone


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "two_hosts":
        main_two_hosts(sys.argv[1])
    else:
        main(sys.argv[1])
