"""``megacompile.data_parallel(model)``: a model replicated across the ranks of a torch.distributed job.

Used like ``fully_shard`` / ``DistributedDataParallel``: every rank calls it once on its model,
after ``init_process_group`` and before compiling the step. It checks that every rank holds
the same parameters, makes them equal to rank 0's (and the buffers), and registers them: from
then on a megatrain backward that computes their gradients averages them across the ranks
(``runtime/data_parallel.py``), bucket by bucket while it runs. The model is returned as it is:
the step compiled with ``backend="megatrain"`` is unchanged.

The collectives run on process groups of their own, so they never interleave with collectives
the user issues on the default group, whatever its backend: gloo over host memory for what lives
on the host (gradients averaged there, updated parameters), and a device group (NCCL for CUDA
tensors, gloo for the CPU stand-in's) for gradients averaged on the GPU before they leave it
(``reduce_gradients_on``; ``megacompile.plan.gradient_reduction`` says which is faster).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
from typing import Iterator

import torch
import torch.distributed as dist

from megacompile.core.errors import DataParallelError
from megacompile.runtime.data_parallel import DataParallelGroup, group_of, register
from megacompile.runtime.shared_parameters import gather_hosts, host_layout, map_shared, why_not_shared

log = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # gloo's own default


_REDUCE_ON = ("auto", "host", "device")


def data_parallel(model: torch.nn.Module, *, process_group=None, shard_optimizer: bool = False,
                  shared_memory: bool = True, reduce_gradients_on: str = "auto",
                  timeout: float | datetime.timedelta | None = None) -> torch.nn.Module:
    """Make ``model`` data parallel over ``process_group`` (default: every rank).

    ``shard_optimizer``: each rank keeps the Adam / AdamW state of, and updates, only its
    shard of the parameters (about 1/world of the bytes, whole tensors, in parameter order);
    the updated parameters are broadcast from their owner, so every rank ends the step with
    the same parameters. With ``shared_memory`` the parameters live once per host, in shared
    memory every rank of the host maps: an owner's update needs no broadcast within its host,
    and between hosts one rank per host carries it (``runtime/shared_parameters.py``). ``reduce_gradients_on``:
    where gradients are averaged: ``"device"`` (on the GPU before they are copied to the host:
    NCCL; on the CPU stand-in, gloo on its device tensors), ``"host"`` (gloo after they land),
    or ``"auto"`` (the faster by ``megacompile.plan.gradient_reduction``: the device where NCCL
    reduces CUDA tensors, else the host). ``timeout`` (seconds): how long a collective may
    wait for the other ranks before the step fails with ``DataParallelError``.
    """
    if reduce_gradients_on not in _REDUCE_ON:
        raise DataParallelError(f"megacompile.data_parallel(): reduce_gradients_on={reduce_gradients_on!r}; "
                                f"use one of {', '.join(map(repr, _REDUCE_ON))}")
    if not dist.is_available() or not dist.is_initialized():
        raise DataParallelError(
            "megacompile.data_parallel() needs torch.distributed: launch with torchrun and call "
            "torch.distributed.init_process_group() (backend 'gloo' on CPUs, 'nccl' or 'cpu:gloo,cuda:nccl' on "
            "GPUs) before it")
    if not isinstance(model, torch.nn.Module):
        raise DataParallelError(f"megacompile.data_parallel() takes an nn.Module, not {type(model).__name__}")
    named = [(n, p) for n, p in model.named_parameters()]
    if not named:
        raise DataParallelError("megacompile.data_parallel(): the model has no parameters")
    for name, p in named:
        if p.device.type != "cpu":
            raise DataParallelError(
                f"megacompile.data_parallel(): parameter '{name}' is on {p.device}; megatrain keeps parameters in "
                f"host memory and streams them to each rank's GPU itself: keep the model on the CPU")
    if group_of(p for _, p in named) is not None:
        raise DataParallelError("megacompile.data_parallel(): this model is data parallel already")
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    timeout = timeout or _DEFAULT_TIMEOUT

    ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
    # Our own gloo groups: host tensors, and no interleaving with the user's collectives.
    # (new_group is collective over the whole job: every rank takes part, member or not.)
    reduce_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    broadcast_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout) if shard_optimizer else None
    # The device group: NCCL for CUDA tensors where this build has both (its communicator is
    # made at the first collective, so an unused group costs nothing), gloo for the stand-in's.
    device_backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else None
    device_group = None
    if reduce_gradients_on != "host":
        device_group = dist.new_group(ranks=ranks, timeout=timeout,
                                      backend="cpu:gloo,cuda:nccl" if device_backend else "gloo")
    if ranks is not None and dist.get_rank() not in ranks:
        return model  # not a member: the groups exist, nothing to do here

    _check_same_structure(model, reduce_group)
    params = [p for _, p in named]
    hosts = gather_hosts(reduce_group)
    src = dist.get_global_rank(reduce_group, 0)
    with torch.no_grad():  # rank 0's values everywhere
        for t in params + list(model.buffers()):
            dist.broadcast(t.data, src=src, group=reduce_group)
    layout = None
    if shard_optimizer and shared_memory:
        why_not = why_not_shared(params, hosts)
        if why_not is None and ranks is not None and len({h for h, _ in hosts}) > 1:
            # The hosts' groups are made by every rank of the job; a group over part of it
            # cannot ask the others.
            why_not = "a process_group over part of the job spans several hosts"
        if why_not is None:
            layout = host_layout(reduce_group, hosts, timeout)
            map_shared(params, layout.node_group)  # one copy for each host
        else:
            log.info("megacompile.data_parallel: parameters are not shared between the ranks: %s", why_not)
    owners = _partition(params, dist.get_world_size(reduce_group)) if shard_optimizer else None
    group = DataParallelGroup(reduce_group, broadcast_group, timeout, owners, shared_parameters=layout is not None,
                              device_group=device_group, device_backend=device_backend or "gloo",
                              reduce_on=reduce_gradients_on, nodes=len({h for h, _ in hosts}), hosts=layout)
    register([p for _, p in named], group)
    return model


def _check_same_structure(model: torch.nn.Module, group) -> None:
    """Every rank must hold the same parameter names, shapes and dtypes, or the buckets of
    the ranks' all-reduces would not pair up."""
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs != mine:
            diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), (len(mine), len(theirs)))
            raise DataParallelError(
                f"megacompile.data_parallel(): rank {rank}'s model differs from rank {dist.get_rank(group)}'s "
                f"(first difference: {diff[1]} there, {diff[0]} here); every rank must build the same model")


def _partition(params: list[torch.Tensor], world: int) -> dict[int, int]:
    """Owner rank of each parameter: contiguous runs in parameter order, about 1/world of the
    bytes each (whole tensors: the fused kernel updates a tensor at a time)."""
    total = sum(p.numel() * p.element_size() for p in params)
    owners, seen = {}, 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        # The rank whose share the tensor's middle byte falls in.
        owners[id(p)] = min(world - 1, (seen + nbytes // 2) * world // max(total, 1))
        seen += nbytes
    return owners


@contextlib.contextmanager
def no_sync(model: torch.nn.Module) -> Iterator[None]:
    """Inside it, backward passes of ``model`` accumulate gradients locally without reducing
    them (like ``DistributedDataParallel.no_sync``); the first backward after it reduces the
    gradients accumulated so far along with its own."""
    group = group_of(p for p in model.parameters())
    if group is None:
        raise DataParallelError("megacompile.no_sync(model): the model is not data parallel "
                                "(call megacompile.data_parallel(model) first)")
    previous, group.sync = group.sync, False
    try:
        yield
    finally:
        group.sync = previous
