"""One copy of the parameters per node: the ranks of one host map the same shared memory.

With a sharded optimizer every parameter has one owner that updates it. The ranks of one host
keep the parameters in one shared-memory file (``/dev/shm``) that each of them maps and points
its parameters at: an owner's update writes the values every rank of its host reads, so the
node holds one copy of the weights whatever its number of GPUs. A barrier after each update
says the host's owners are done; the parameters another rank updated get their version
counter bumped here, so anything cached from their old values (the bf16 weight copies a load
carries) is rebuilt.

Where the ranks run on several hosts, each host has its copy, and the first rank of each host
(its leader) carries the updates between hosts: after the host's owners are done, every
leader broadcasts the parameters its host's ranks own to the other leaders, which write them
into their host's copy (``HostLayout``; ``runtime.data_parallel.share_updated``). A host
receives each update once, not once per rank. A host is what shares ``/dev/shm``: its hostname,
or ``MEGACOMPILE_HOST_ID`` where set (containers that share a host's ``/dev/shm`` under
different hostnames).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from typing import Any

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
HOST_ID_ENV = "MEGACOMPILE_HOST_ID"


def host_id() -> str:
    return os.environ.get(HOST_ID_ENV) or socket.gethostname()


def gather_hosts(group) -> list[tuple[str, int]]:
    """(host id, free ``/dev/shm`` bytes) of every rank of ``group`` (a collective)."""
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, (host_id(), _free_shm_bytes()), group=group)
    return hosts


@dataclasses.dataclass
class HostLayout:
    """Which host each rank of a group runs on, and the groups that carry updates between hosts."""

    host_of: list[int]  # group rank -> host index (hosts numbered by their first rank)
    leader_of: list[int]  # host index -> the group rank of its first rank
    node_group: Any  # this rank's host's ranks (gloo)
    leaders_group: Any  # one rank per host (gloo); None on one host

    @property
    def hosts(self) -> int:
        return len(self.leader_of)


def host_layout(group, hosts: list[tuple[str, int]], timeout) -> HostLayout:
    """The layout of ``group``'s ranks over hosts, making a node group per host and the
    leaders' group (collective over the whole job: call it where every rank of the job is a
    member of ``group``)."""
    order: dict[str, int] = {}
    for h, _ in hosts:
        order.setdefault(h, len(order))
    host_of = [order[h] for h, _ in hosts]
    members = [[r for r, h in enumerate(host_of) if h == k] for k in range(len(order))]
    to_global = [dist.get_global_rank(group, r) for r in range(len(hosts))]
    mine = host_of[dist.get_rank(group)]
    node_group = None
    for k, ranks in enumerate(members):  # every rank makes every host's group, in one order
        made = dist.new_group(ranks=[to_global[r] for r in ranks], backend="gloo", timeout=timeout)
        if k == mine:
            node_group = made
    leaders = [ranks[0] for ranks in members]
    leaders_group = dist.new_group(ranks=[to_global[r] for r in leaders], backend="gloo", timeout=timeout) \
        if len(members) > 1 else None
    return HostLayout(host_of, leaders, node_group, leaders_group)


def why_not_shared(params: list[torch.Tensor], hosts: list[tuple[str, int]]) -> str | None:
    """None where ``params`` can be mapped from one shared file by the ranks of each host
    (``hosts``: ``gather_hosts``, the same on every rank, so is the answer), else the reason."""
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
