"""Data parallel over ``torch.distributed``: the replicated parameters and their gradient all-reduce.

Every rank runs the same compiled step on its own part of the batch. A backward program hands
each gradient to its sink as it lands on the host; for a data-parallel parameter that sink is
a ``ReducingSink`` (or the overlapped optimizer's lander, which reduces before it updates).
The gradients of one layer are one bucket: flattened and all-reduced asynchronously over a
host (gloo) process group while the backward goes on with the layers before it, then divided
by the world size. Every collective is issued from one thread, in the order the program
produces the layers, so the ranks' collectives always pair up (the programs are identical).

The bucket holds ``param.grad + gradient`` when a gradient was already there (micro-batches,
or a parameter read by two graphs): the average of that sum is the accumulated average, on
every rank alike, whether the earlier gradient was reduced already (identical on all ranks)
or accumulated locally under ``no_sync``.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import threading
import time
import weakref
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from megacompile.core.errors import DataParallelError
from megacompile.runtime.gradient_sink import DeviceWork, GradientSink
from megacompile.runtime.shared_parameters import HostLayout, others_updated


@dataclasses.dataclass
class DataParallelStats:
    """What the last backward reduced (``last_report().data_parallel``)."""

    world_size: int
    rank: int
    synced: bool = True  # False: under no_sync(), gradients stayed local
    buckets: int = 0
    reduced_bytes: int = 0
    exposed_seconds: float = 0.0  # the backward's wait for reductions still running at its end
    sharded_optimizer: bool = False
    shared_parameters: bool = False  # one copy per host, in shared memory (runtime/shared_parameters.py)
    hosts: int = 1  # hosts the ranks run on
    # Where this backward averaged gradients ("host" or "device") and why; the host path's
    # buckets and bytes are above, the device path's all-reduces (one per gradient) here.
    reduced_on: str = "host"
    reduced_on_why: str = ""
    device_reductions: int = 0
    device_reduced_bytes: int = 0


class DataParallelGroup:
    """The ranks that hold one model's replicas: the process groups gradients and updated
    parameters travel on, and (with a sharded optimizer) which rank updates which parameter."""

    def __init__(self, reduce_group, broadcast_group, timeout: datetime.timedelta | None,
                 owners: dict[int, int] | None, shared_parameters: bool = False, *, device_group=None,
                 device_backend: str | None = None, reduce_on: str = "host", nodes: int = 1,
                 hosts: HostLayout | None = None) -> None:
        self.reduce_group = reduce_group  # gradient all-reduces (host tensors: gloo)
        # Gradient all-reduces on the compute device (None: not created), issued only from the
        # program's thread; ``device_backend``: what reduces CUDA tensors on it ("nccl" or "gloo").
        self.device_group = device_group
        self.device_backend = device_backend
        self.reduce_on = reduce_on  # "auto", "host" or "device" (megacompile.data_parallel)
        self.nodes = nodes
        # Shared parameters: the hosts' ranks and the groups that carry updates between hosts.
        self.hosts = hosts
        # A backward under no_sync() left each rank its own gradients in param.grad: the next
        # synced backward must average those too, which only the host path (it reduces
        # param.grad + gradient) does.
        self.local_accumulation = False
        self.broadcast_group = broadcast_group  # updated parameters from their owner
        self.world_size = dist.get_world_size(reduce_group)
        self.rank = dist.get_rank(reduce_group)
        self.timeout = timeout
        # id(param) -> the group rank that holds its optimizer state and updates it
        # (None: every rank updates every parameter).
        self.owners = owners
        # The ranks' parameters are one shared buffer: an owner's update is every rank's.
        self.shared_parameters = shared_parameters
        self.sync = True  # False inside no_sync()

    @property
    def shards_optimizer(self) -> bool:
        return self.owners is not None

    def owns(self, param: torch.Tensor) -> bool:
        return self.owners is None or self.owners.get(id(param), self.rank) == self.rank

    def owner_of(self, param: torch.Tensor) -> int:
        return self.rank if self.owners is None else self.owners[id(param)]

    def agree(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` holds on every rank (one tiny all-reduce, on the thread that issues
        the gradients' all-reduces, so it pairs up with the same collective everywhere)."""
        def launch():
            value = torch.tensor([1 if flag else 0], dtype=torch.int32)
            work = dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.reduce_group, async_op=True)
            self.wait(work, what)
            return bool(value.item())

        try:
            return collective_thread("allreduce").submit(launch).result()
        except DataParallelError:
            raise
        except Exception as e:
            raise collective_failed(what, self, e) from e

    def wait(self, work, what: str, on_stream: bool = False) -> None:
        """``on_stream``: a CUDA collective, waited for by the current stream, not the host
        thread (NCCL blocks the thread when given a timeout; its watchdog enforces the group's)."""
        try:
            if self.timeout is None or on_stream:
                work.wait()
            else:
                work.wait(self.timeout)
        except Exception as e:
            raise collective_failed(what, self, e) from e


def collective_failed(what: str, group: DataParallelGroup, error: BaseException) -> DataParallelError:
    return DataParallelError(
        f"megatrain data parallel: {what} failed on rank {group.rank} of {group.world_size} "
        f"({type(error).__name__}: {str(error).strip()[:300]}). Another rank most likely exited, failed, or "
        f"ran a different step (every rank must run the same steps with the same shapes). This rank "
        f"cannot go on in step with the others: restart the job, from a checkpoint.")


# id(param) -> (weak reference, group): which parameters are data parallel, and over what.
_GROUPS: dict[int, tuple[weakref.ref, DataParallelGroup]] = {}
_GROUPS_LOCK = threading.Lock()


def register(params: Iterable[torch.Tensor], group: DataParallelGroup) -> None:
    with _GROUPS_LOCK:
        for p in params:
            key = id(p)
            _GROUPS[key] = (weakref.ref(p, lambda _, key=key: _GROUPS.pop(key, None)), group)


def group_of(params: Iterable[torch.Tensor]) -> DataParallelGroup | None:
    """The data-parallel group of ``params``, or None where none is; params of two groups, or
    some replicated and some not, are an error that says what to change."""
    plain = 0
    groups = {}
    with _GROUPS_LOCK:
        for p in params:
            entry = _GROUPS.get(id(p))
            if entry is not None and entry[0]() is p:
                groups[id(entry[1])] = entry[1]
            else:
                plain += 1
    if not groups:
        return None
    if len(groups) > 1 or plain:
        raise DataParallelError(
            "megatrain data parallel: one compiled graph reads parameters of "
            + ("two megacompile.data_parallel() models" if len(groups) > 1 else
               f"a data_parallel() model and {plain} parameter(s) that are not")
            + "; pass every module the step trains to one megacompile.data_parallel() call")
    return next(iter(groups.values()))


# --- the reductions ---------------------------------------------------------------------
_POOLS: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def collective_thread(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that issues every collective of one kind (per process group): issued
    from one thread in program order, the ranks' collectives pair up."""
    with _POOLS_LOCK:
        if name not in _POOLS:
            _POOLS[name] = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                 thread_name_prefix=f"megatrain-{name}")
        return _POOLS[name]


@dataclasses.dataclass
class Bucket:
    """One layer's gradients on their way through an all-reduce."""

    layer: str | None
    params: list[torch.Tensor]
    launched: concurrent.futures.Future  # -> (work, flat) once issued


class GradientReducer:
    """One backward's all-reduces: ``submit`` a layer's landed gradients, ``result`` their
    average (each gradient plus what ``param.grad`` held, averaged over the ranks)."""

    def __init__(self, group: DataParallelGroup, on_device: bool = False, why: str = "") -> None:
        self.group = group
        # This backward's gradients are averaged on the device as they are offloaded.
        self.on_device = on_device and group.device_group is not None
        self.stats = DataParallelStats(group.world_size, group.rank, sharded_optimizer=group.shards_optimizer,
                                       shared_parameters=group.shared_parameters, hosts=group.nodes,
                                       reduced_on="device" if self.on_device else "host", reduced_on_why=why)
        self._lock = threading.Lock()

    def reduce_on_device(self, value: torch.Tensor, layer: str | None, owner: int | None = None) -> DeviceWork | None:
        """Starts the average of a gradient still on the device, in place, over the device
        group (called on the program's thread, in program order): to every rank, or only to
        the group rank ``owner`` (a sharded optimizer's owner: the other ranks then copy
        nothing). Returns the work: its ``after`` is what the copy to the host calls first (in
        the copy's stream context: on CUDA the copy stream waits for the collective, the host
        thread does not). None where ``value``'s memory is not one dense block (its copy then
        lands as it is and the host path averages it)."""
        flat = _dense_flat(value)
        if flat is None:
            return None
        # NCCL averages inside the collective; gloo has no AVG: the sum is divided after it.
        average = value.is_cuda and self.group.device_backend == "nccl"
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        mine = owner is None or owner == self.group.rank
        what = f"the gradient {'all-' if owner is None else ''}reduce of layer {layer or '(glue)'} on the device"
        try:
            if owner is None:
                work = dist.all_reduce(flat, op=op, group=self.group.device_group, async_op=True)
            else:
                work = dist.reduce(flat, dst=dist.get_global_rank(self.group.device_group, owner), op=op,
                                   group=self.group.device_group, async_op=True)
        except Exception as e:
            raise collective_failed(what, self.group, e) from e
        with self._lock:
            self.stats.device_reductions += 1
            self.stats.device_reduced_bytes += value.numel() * value.element_size()

        def after() -> None:
            if not mine and value.is_cuda:
                # Nothing here reads the result: waiting would only hold this thread's stream
                # back (NCCL's watchdog reports a failed collective).
                return
            self.group.wait(work, what, on_stream=value.is_cuda)
            if mine and not average:
                flat.div_(self.group.world_size)

        return DeviceWork(after, copy=mine)

    def submit(self, layer: str | None, items: list[tuple[torch.Tensor, torch.Tensor, Callable | None]]) -> Bucket:
        """``items``: (parameter, landed gradient, ``ready`` or None). The parameter's current
        ``param.grad`` is read now, on the caller's thread."""
        params = [p for p, _, _ in items]
        priors = [p.grad for p in params]
        grads = [g for _, g, _ in items]
        readies = [r for _, _, r in items]

        def launch():
            for ready in readies:
                if ready is not None:
                    ready()  # CUDA: the gradient's copy to the host has finished
            parts = []
            for p, g, prior in zip(params, grads, priors):
                g = g.to(p.dtype)  # a bf16 copy that landed before its host cast: widened here
                parts.append((g if prior is None else prior + g).reshape(-1))
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
            try:
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group.reduce_group, async_op=True)
            except Exception as e:
                raise collective_failed(f"the gradient all-reduce of layer {layer or '(glue)'}", self.group, e) from e
            return work, flat

        with self._lock:
            self.stats.buckets += 1
            self.stats.reduced_bytes += sum(p.numel() * p.element_size() for p in params)
        return Bucket(layer, params, collective_thread("allreduce").submit(launch))

    def result(self, bucket: Bucket) -> list[torch.Tensor]:
        """The bucket's averaged gradients, shaped like its parameters (views of one buffer)."""
        work, flat = bucket.launched.result()
        self.group.wait(work, f"the gradient all-reduce of layer {bucket.layer or '(glue)'}")
        flat.div_(self.group.world_size)
        out, offset = [], 0
        for p in bucket.params:
            out.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return out


def _dense_flat(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view over exactly ``t``'s elements where they fill one block of memory in some
    order (a transposed weight gradient does), else None. An all-reduce is elementwise, so
    reducing the block reduces ``t``."""
    if t.is_contiguous():
        return t.view(-1)
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


class ReducingSink(GradientSink):
    """A backward's gradient sink where the optimizer does not overlap it: takes every
    data-parallel parameter's gradient as it lands, all-reduces it layer by layer, and leaves
    the average in ``param.grad`` before the backward returns (where autograd would have put
    the gradient), so clipping, schedulers and ``opt.step()`` see the global gradient."""

    def __init__(self, params: dict[int, torch.Tensor], group: DataParallelGroup,
                 reducer: GradientReducer | None = None) -> None:
        self.params = params  # output position -> parameter
        self.group = group
        self.reducer = reducer or GradientReducer(group)
        self.stats = self.reducer.stats
        self._batch: list[tuple] = []
        self._batch_layer: str | None = None
        self._buckets: list[Bucket] = []
        self._on_device: set[int] = set()  # positions whose gradient the device averaged
        self._averaged: list[tuple] = []  # (param, landed average, ready, prior grad)

    def owns(self, position: int) -> bool:
        return position in self.params

    def before_offload(self, position: int, value: torch.Tensor, layer: str | None):
        if not self.reducer.on_device:
            return None
        # To every rank: clipping, accumulation and step() read every param.grad here.
        work = self.reducer.reduce_on_device(value, layer)
        if work is not None:
            self._on_device.add(position)
        return work

    def take(self, position: int, host_grad: torch.Tensor, layer: str | None, ready=None) -> None:
        if position in self._on_device:
            p = self.params[position]
            self._averaged.append((p, host_grad, ready, p.grad))
            return
        if self._batch and layer != self._batch_layer:
            self._flush()
        self._batch.append((self.params[position], host_grad, ready))
        self._batch_layer = layer

    def _flush(self) -> None:
        self._buckets.append(self.reducer.submit(self._batch_layer, self._batch))
        self._batch, self._batch_layer = [], None

    def finish(self, failed: bool = False) -> None:
        if failed:
            # The step's own error is the one to report; the peers' matching collectives
            # fail when this process stops (or at the group's timeout).
            self._batch, self._buckets, self._averaged = [], [], []
            return
        if self._batch:
            self._flush()
        start = time.perf_counter()
        try:
            for p, g, ready, prior in self._averaged:
                if ready is not None:
                    ready()  # CUDA: the average's copy to the host has landed
                g = g.to(p.dtype)  # a bf16 average: widened here
                # A prior gradient from a synced backward is the same on every rank: the
                # average of (prior + gradient) is prior + the average.
                p.grad = g if prior is None else prior + g
            for bucket in self._buckets:
                for p, g in zip(bucket.params, self.reducer.result(bucket)):
                    p.grad = g
            self.group.local_accumulation = False  # every rank's param.grad is the average now
        finally:
            self.stats.exposed_seconds = time.perf_counter() - start
            self._buckets, self._averaged = [], []


def _barrier(group: DataParallelGroup, over, what: str) -> None:
    done = torch.zeros(1)
    try:
        work = dist.all_reduce(done, group=over, async_op=True)
    except Exception as e:
        raise collective_failed(what, group, e) from e
    group.wait(work, what)


def _carry_between_hosts(group: DataParallelGroup, params: list[torch.Tensor],
                         before_write: Callable[[], None] | None) -> None:
    """On a host's leader, once its host's owners have written: every host's updated
    parameters, broadcast by its leader to the other leaders, written into this host's copy."""
    hosts = group.hosts
    _broadcast_from_sources(
        group, params, source_of=lambda p: hosts.host_of[group.owner_of(p)], mine=hosts.host_of[group.rank],
        over=hosts.leaders_group,
        global_rank=lambda host: dist.get_global_rank(group.reduce_group, hosts.leader_of[host]),
        what=lambda host: f"the broadcast of host {host}'s updated parameters", before_write=before_write)


def _broadcast_from_sources(group: DataParallelGroup, params: list[torch.Tensor], *, source_of: Callable, mine: int,
                            over, global_rank: Callable[[int], int], what: Callable[[int], str],
                            before_write: Callable[[], None] | None) -> None:
    """``params`` grouped by their source (``source_of(p)``: an owner rank, or a host) and
    dtype, each group broadcast as one buffer over ``over`` from its source, in one order on
    every rank; where this rank's source (``mine``) is not the group's, the received values
    are written into the parameters (after ``before_write()``: no load may still read them).
    Each write bumps the parameter's version: its bf16 copy is recast."""
    by_source: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        by_source.setdefault((source_of(p), p.dtype), []).append(p)
    for (source, dtype), ps in sorted(by_source.items(), key=lambda item: (item[0][0], str(item[0][1]))):
        if source == mine:
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
        else:
            flat = torch.empty(sum(p.numel() for p in ps), dtype=dtype)
        try:
            work = dist.broadcast(flat, src=global_rank(source), group=over, async_op=True)
        except Exception as e:
            raise collective_failed(what(source), group, e) from e
        group.wait(work, what(source))
        if source == mine:
            continue
        if before_write is not None:
            before_write()
        offset = 0
        with torch.no_grad():
            for p in ps:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


def share_updated(group: DataParallelGroup, params: list[torch.Tensor],
                  before_write: Callable[[], None] | None = None) -> None:
    """With a sharded optimizer, after the owners updated ``params`` (the same list, in the
    same order, on every rank): each owner's updated parameters, broadcast to the other ranks
    as one buffer. ``before_write``: called before a received value overwrites a parameter
    (no load may still read it). Parameters in shared memory need no copy within a host: a
    barrier says its owners have written them; between hosts each host's leader carries its
    host's updates to the other hosts' copies, and a second barrier says they have arrived."""
    if group.shared_parameters:
        hosts = group.hosts
        one_host = hosts is None or hosts.leaders_group is None
        _barrier(group, group.broadcast_group if one_host else hosts.node_group,
                 "the barrier after the owners' parameter updates")
        if not one_host:
            if group.rank == hosts.leader_of[hosts.host_of[group.rank]]:
                _carry_between_hosts(group, params, before_write)
            _barrier(group, hosts.node_group, "the barrier after the other hosts' parameter updates")
        others_updated([p for p in params if not group.owns(p)])
        return
    _broadcast_from_sources(
        group, params, source_of=group.owner_of, mine=group.rank, over=group.broadcast_group,
        global_rank=lambda owner: dist.get_global_rank(group.broadcast_group, owner),
        what=lambda owner: f"the broadcast of rank {owner}'s updated parameters", before_write=before_write)
