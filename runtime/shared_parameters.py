"""One copy of the parameters per node: the ranks of one host map the same shared memory.

With a sharded optimizer every parameter has one owner that updates it. Where all ranks of the
group run on one host, the parameters live in one shared-memory file (``/dev/shm``) that each
rank maps and points its parameters at: the owner's update writes the values every rank reads,
so nothing is broadcast and the node holds one copy of the weights whatever its number of
GPUs. A barrier after each update says the owners are done; the parameters another rank
updated get their version counter bumped here, so anything cached from their old values (the
bf16 weight copies a load carries) is rebuilt.
"""
from __future__ import annotations

import os
import socket
import uuid

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"


def why_not_shared(params: list[torch.Tensor], group) -> str | None:
    """None where ``params`` can be mapped from one shared file by every rank of ``group``
    (a collective: every rank gets the same answer), else the reason."""
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, (socket.gethostname(), _free_shm_bytes()), group=group)
    if len({h for h, _ in hosts}) > 1:
        return "the ranks run on several hosts (each keeps its own copy; updates are broadcast)"
    if len({p.dtype for p in params}) > 1:
        return "the parameters have several dtypes"
    need = sum(p.numel() * p.element_size() for p in params)
    free = min(f for _, f in hosts)
    if need > free:
        return (f"{SHM_DIR} has {free} bytes free, the parameters need {need} (raise the container's shared "
                f"memory, e.g. docker --shm-size)")
    return None


def _free_shm_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def map_shared(params: list[torch.Tensor], group) -> None:
    """Points every parameter at one shared buffer holding the group's rank 0's values (a
    collective). The file is unlinked once every rank has mapped it: the memory lives as long
    as a mapping does."""
    numel = sum(p.numel() for p in params)
    dtype = params[0].dtype
    names = [f"{SHM_DIR}/megatrain-params-{uuid.uuid4().hex}" if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0), group=group)
    path = names[0]
    first = dist.get_rank(group) == 0
    if first:
        buffer = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        offset = 0
        with torch.no_grad():
            for p in params:
                buffer[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                offset += p.numel()
    dist.barrier(group=group)
    if not first:
        buffer = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    dist.barrier(group=group)
    if first:
        os.unlink(path)
    # On CUDA the device page-locks the buffer in place at its first load, within the pinned
    # memory budget (runtime/device.py, CudaDevice._pinned_source).
    offset = 0
    with torch.no_grad():
        for p in params:
            p.data = buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


def others_updated(params: list[torch.Tensor]) -> None:
    """``params`` were rewritten by another process: their version counters move as if the
    write had been an in-place op here."""
    for p in params:
        torch.autograd.graph.increment_version(p)
