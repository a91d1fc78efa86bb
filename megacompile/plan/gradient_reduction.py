"""Where a data-parallel step averages its gradients: on the device or on the host.

Every rank's gradients are summed across the ranks and divided by their number, layer by
layer while the backward runs. Two places can do it:

- **host**: the gradient is copied to the host first (as without data parallel), then a gloo
  ring all-reduce runs over host memory and TCP: loopback between the processes of one node,
  the node's NIC between nodes (gloo uses neither NVLink nor RDMA). It also costs host memory
  traffic: the flatten, and each byte sent is read, received, reduced and written.
- **device**: the all-reduce runs on the GPU before the copy (NCCL: NVLink or PCIe between the
  GPUs of a node, RDMA over the NIC between nodes); what is copied to the host is the average.
  The host link carries the same bytes either way. It holds each gradient on the device until
  its reduction is done (the copy waits), and under ``precision="bf16"`` sums bf16 gradients
  (what FSDP2 does with ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``), where the host sums
  them in fp32.

``choose_reduction`` prices both rings with the bandwidths below (assumptions, stated in the
plan's output; replace them with measurements where it matters) and takes the faster; a tie
goes to the host, the path that holds nothing on the device. Used by
``megacompile.data_parallel(reduce_gradients_on="auto")`` at each backward and by
``megacompile plan --gpus``.
"""
from __future__ import annotations

import dataclasses

from megacompile.plan.hardware import GB

# gloo over loopback TCP between two processes of one host, per rank (a few GB/s per
# connection on a modern server).
LOOPBACK_BANDWIDTH = 10 * GB
# One 200 Gb/s Ethernet NIC per node as TCP achieves it.
DEFAULT_NIC_BANDWIDTH = 25 * GB
# The NCCL ring's bus bandwidth between the GPUs of one node: an NVLink node (H100 SXM) is
# assumed to reach 150 GB/s on layer-sized buckets, a PCIe-only node 20 GB/s.
NVLINK_BUS_BANDWIDTH = 150 * GB
PCIE_PEER_BANDWIDTH = 20 * GB
# Host memory traffic per byte a rank sends in a host all-reduce: read to send, written on
# receipt, both read again by the reduction's add and its result written.
ALLREDUCE_TRAFFIC_PER_BYTE = 4


@dataclasses.dataclass(frozen=True)
class ReductionChoice:
    on: str  # "host" or "device"
    why: str
    host_seconds: float  # the host ring's time for one step's gradients
    device_seconds: float | None  # the device ring's (None: no collective backend for the device)
    host_memory_bytes: int  # host memory traffic per rank the chosen path adds


def ring_bytes(nbytes: int, ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes``."""
    return 2 * (ranks - 1) / ranks * nbytes if ranks > 1 else 0.0


def choose_reduction(host_grad_bytes: int, device_grad_bytes: int, ranks: int, nodes: int, *,
                     device_collectives: str | None, nvlink: bool = True,
                     nic_bandwidth: float = DEFAULT_NIC_BANDWIDTH) -> ReductionChoice:
    """``host_grad_bytes``: one step's gradients as the host reduces them (fp32);
    ``device_grad_bytes``: as the device holds them (bf16 under ``precision="bf16"``);
    ``device_collectives``: the backend that reduces device tensors ("nccl"), None if none."""
    host_link = min(nic_bandwidth, LOOPBACK_BANDWIDTH) if nodes > 1 else LOOPBACK_BANDWIDTH
    host_s = ring_bytes(host_grad_bytes, ranks) / host_link
    host_traffic = int(2 * host_grad_bytes + ALLREDUCE_TRAFFIC_PER_BYTE * ring_bytes(host_grad_bytes, ranks)) \
        if ranks > 1 else 0
    if device_collectives is None:
        return ReductionChoice("host", "no collective backend reduces tensors on this device (NCCL needs CUDA)",
                               host_s, None, host_traffic)
    device_link = nic_bandwidth if nodes > 1 else (NVLINK_BUS_BANDWIDTH if nvlink else PCIE_PEER_BANDWIDTH)
    device_s = ring_bytes(device_grad_bytes, ranks) / device_link
    if device_s < host_s:
        return ReductionChoice("device", f"{device_collectives} on the device: {device_s * 1e3:.1f} ms a step "
                                         f"against {host_s * 1e3:.1f} ms for gloo on the host", host_s, device_s, 0)
    return ReductionChoice("host", f"gloo on the host: {host_s * 1e3:.1f} ms a step, no slower than "
                                   f"{device_collectives} on the device ({device_s * 1e3:.1f} ms)",
                           host_s, device_s, host_traffic)
