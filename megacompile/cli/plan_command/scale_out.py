"""``megacompile plan --gpus N --nodes M``: one GPU's plan carried to data parallel on paper.

Every rank runs the one-GPU plan on its own batch (``megacompile.data_parallel``); what
changes is what the ranks share. The model is first-order, each term stated in the output:

- the host<->device link: each GPU has its own (the profile's bandwidth per direction);
- host memory bandwidth, shared by a node's GPUs: every GPU's loads and gradient copies
  cross it, and so do the gradient all-reduce's buffers (gloo on the host: the flatten, and
  each byte a rank sends is read, received, reduced and written: 4 bytes of traffic);
- the host optimizer: sharded, a node updates 1/M of the model whatever its GPU count (the
  ranks' shards at the node's memory bandwidth: the one-GPU time / M); unsharded, every rank
  updates all of it (N x the one-GPU time on the shared bandwidth);
- the gradient all-reduce: a ring over the ranks, 2 (R-1)/R of the gradient bytes per rank,
  over loopback TCP within a node and the node's NIC between nodes (gloo uses TCP, one
  interface per node); it runs layer by layer during the backward, so only what outlasts the
  backward (at least the last layer's share) is exposed;
- across nodes the parameters are not shared: owners broadcast their updates over the NIC.
"""
from __future__ import annotations

from megacompile.cli.plan_command.full_depth import DepthPlan, optimizer_exposed_seconds
from megacompile.core.units import format_bytes
from megacompile.plan.hardware import GB, HardwareProfile

# gloo over loopback TCP between two processes of one host, per rank (a few GB/s per
# connection on a modern server; replace with a measurement where it matters).
LOOPBACK_BANDWIDTH = 10 * GB
# One 200 Gb/s Ethernet NIC per node as TCP achieves it (gloo does not use RDMA).
DEFAULT_NIC_BANDWIDTH = 25 * GB
# Host memory traffic per byte a rank sends in the all-reduce: read to send, written on receipt,
# both read again by the reduction's add and its result written.
ALLREDUCE_TRAFFIC_PER_BYTE = 4


def scale_out(plan: DepthPlan, trace, profile: HardwareProfile, *, gpus: int, nodes: int, num_params: int,
              num_layers: int, tokens_per_gpu: int, shard_optimizer: bool = True,
              nic_bandwidth: float = DEFAULT_NIC_BANDWIDTH) -> dict:
    """The ``scale_out`` object of the ``--json`` result (see the module docstring)."""
    ranks = gpus * nodes
    grad_bytes = 4 * num_params  # fp32 gradients reduced on the host, in either precision
    weight_bytes = 4 * num_params
    ring = 2 * (ranks - 1) / ranks * grad_bytes  # bytes each rank sends (and receives)
    comm_bandwidth = min(nic_bandwidth, LOOPBACK_BANDWIDTH) if nodes > 1 else LOOPBACK_BANDWIDTH
    allreduce_s = ring / comm_bandwidth if ranks > 1 else 0.0
    # Sharded across nodes: each node receives the other nodes' updated parameters, once per rank.
    broadcast_bytes = gpus * (nodes - 1) / nodes * weight_bytes if shard_optimizer and nodes > 1 else 0
    broadcast_s = broadcast_bytes / nic_bandwidth if broadcast_bytes else 0.0

    host_traffic = gpus * (plan.h2d_bytes + plan.d2h_bytes)
    if ranks > 1:
        host_traffic += gpus * (2 * grad_bytes + ALLREDUCE_TRAFFIC_PER_BYTE * ring)
    host_memory_s = host_traffic / profile.host_memory_bandwidth
    device_s = max(plan.device_s, host_memory_s)

    one = trace.host_optimizer
    factor = 1 / nodes if shard_optimizer else gpus
    optimizer = {**one, "seconds": one["seconds"] * factor, "tail_seconds": one.get("tail_seconds", 0.0) * factor}
    optimizer_s = optimizer_exposed_seconds(optimizer, plan.backward_s) if one.get("overlapped") \
        else optimizer["seconds"]
    overlapped = bool(one.get("overlapped"))
    # Reductions overlap the backward layer by layer; with the overlapped optimizer the owners'
    # broadcasts do too (per layer), otherwise they follow the update.
    hidden_comm = allreduce_s + (broadcast_s if overlapped else 0.0)
    comm_exposed = max(hidden_comm - plan.backward_s, hidden_comm / num_layers) if hidden_comm else 0.0
    comm_exposed += 0.0 if overlapped else broadcast_s
    step_s = device_s + optimizer_s + comm_exposed
    tokens = ranks * tokens_per_gpu
    one_gpu_tokens_per_s = tokens_per_gpu / plan.step_s if plan.step_s > 0 else None
    tokens_per_s = tokens / step_s if step_s > 0 else None

    shared_weights = shard_optimizer and nodes == 1
    node_memory = {
        "weights": weight_bytes * (1 if shared_weights else gpus),
        "gradients": 0 if overlapped else grad_bytes * gpus,
        "optimizer_states": 8 * num_params * (gpus / ranks if shard_optimizer else gpus),
    }
    return {
        "gpus_per_node": gpus, "nodes": nodes, "ranks": ranks, "shard_optimizer": shard_optimizer,
        "tokens_per_step": tokens, "step_s": step_s, "tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s / one_gpu_tokens_per_s if tokens_per_s and one_gpu_tokens_per_s else None,
        "scaling_efficiency": (tokens_per_s / one_gpu_tokens_per_s / ranks
                               if tokens_per_s and one_gpu_tokens_per_s else None),
        "parts_s": {"device": plan.device_s, "host_memory": host_memory_s, "optimizer_exposed": optimizer_s,
                    "allreduce": allreduce_s, "parameter_broadcast": broadcast_s,
                    "communication_exposed": comm_exposed},
        "host_memory_traffic_bytes_per_node": host_traffic,
        "allreduce_bytes_per_rank": ring,
        "host_memory_per_node_bytes": {**node_memory, "total": sum(node_memory.values())},
        "assumptions": {
            "link": f"each GPU has its own host link ({profile.h2d_bandwidth / GB:.0f} GB/s per direction)",
            "host_memory_bandwidth": f"{profile.host_memory_bandwidth / GB:.0f} GB/s per node, shared by its GPUs' "
                                     f"copies, the all-reduce buffers and the optimizer",
            "allreduce": f"gloo ring on the host: loopback TCP {LOOPBACK_BANDWIDTH / GB:.0f} GB/s per rank"
                         + (f", NIC {nic_bandwidth / GB:.0f} GB/s per node between nodes" if nodes > 1 else ""),
            "optimizer": ("sharded: each node updates 1/nodes of the model" if shard_optimizer
                          else "not sharded: every rank updates the whole model"),
            "parameters": ("one shared copy per node" if shared_weights else "a copy per rank"),
        },
    }


def format_scale_out(s: dict) -> list[str]:
    """The table rows of ``scale_out`` for ``text_report``."""
    def t(x: float) -> str:
        return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.1f} ms"

    parts = s["parts_s"]
    mem = s["host_memory_per_node_bytes"]
    lines = [
        "",
        f"data parallel      {s['gpus_per_node']} GPU(s) x {s['nodes']} node(s) = {s['ranks']} ranks, "
        f"{s['tokens_per_step']:,} tokens/step, optimizer {'sharded' if s['shard_optimizer'] else 'replicated'}",
        f"  step             {t(s['step_s'])}: device {t(parts['device'])} (host memory traffic "
        f"{t(parts['host_memory'])}), optimizer {t(parts['optimizer_exposed'])}, communication exposed "
        f"{t(parts['communication_exposed'])} (all-reduce {t(parts['allreduce'])}, parameter broadcast "
        f"{t(parts['parameter_broadcast'])})",
        f"  throughput       {s['tokens_per_s']:,.0f} tokens/s ({s['speedup']:.2f}x one GPU, "
        f"{s['scaling_efficiency']:.0%} scaling efficiency)",
        f"  host per node    {format_bytes(mem['total'])} (weights {format_bytes(mem['weights'])}, gradients "
        f"{format_bytes(mem['gradients'])}, optimizer states {format_bytes(mem['optimizer_states'])})",
    ]
    lines += [f"  assumes          {k.replace('_', ' ')}: {v}" for k, v in s["assumptions"].items()]
    return lines
