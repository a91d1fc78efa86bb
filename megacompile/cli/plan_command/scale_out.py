"""``megacompile plan --gpus N --nodes M``: one GPU's plan carried to data parallel on paper.

Every rank runs the one-GPU plan on its own batch (``megacompile.data_parallel``); what
changes is what the ranks share. The model is first-order, each term stated in the output:

- the host<->device link: each GPU has its own (the profile's bandwidth per direction);
- host memory bandwidth, shared by a node's GPUs: every GPU's loads and gradient copies
  cross it, and so do the buffers of a gradient all-reduce on the host (the flatten, and
  each byte a rank sends is read, received, reduced and written: 4 bytes of traffic);
- the host optimizer: sharded, a node updates 1/M of the model whatever its GPU count (the
  ranks' shards at the node's memory bandwidth: the one-GPU time / M); unsharded, every rank
  updates all of it (N x the one-GPU time on the shared bandwidth);
- the gradient all-reduce: a ring over the ranks, 2 (R-1)/R of the gradient bytes per rank,
  on the GPUs before the copies (NCCL: NVLink within a node, RDMA over the NIC between nodes)
  or on the host after them (gloo: loopback TCP within a node, the NIC between nodes),
  whichever ``megacompile.plan.gradient_reduction`` finds faster, as the runtime chooses; it
  runs layer by layer during the backward, so only what outlasts the backward (at least the
  last layer's share) is exposed. On the GPUs, with the optimizer sharded and overlapped,
  each gradient is reduced to its owner only, and only the owner copies it to its host;
- across nodes each node keeps its own shared copy: one rank per node receives the other
  nodes' owners' updates over the NIC, once per node.
"""
from __future__ import annotations

from megacompile.cli.plan_command.full_depth import DepthPlan, optimizer_exposed_seconds
from megacompile.core.units import format_bytes
from megacompile.plan.gradient_reduction import (
    DEFAULT_NIC_BANDWIDTH,
    LOOPBACK_BANDWIDTH,
    NVLINK_BUS_BANDWIDTH,
    PCIE_PEER_BANDWIDTH,
    choose_reduction,
    ring_bytes,
)
from megacompile.plan.hardware import GB, HardwareProfile


def scale_out(plan: DepthPlan, trace, profile: HardwareProfile, *, gpus: int, nodes: int, num_params: int,
              num_layers: int, tokens_per_gpu: int, shard_optimizer: bool = True,
              nic_bandwidth: float = DEFAULT_NIC_BANDWIDTH, device_grad_bytes_per_param: int = 4,
              reduce_gradients_on: str = "auto") -> dict:
    """The ``scale_out`` object of the ``--json`` result (see the module docstring).
    ``device_grad_bytes_per_param``: 2 where the device computes bf16 gradients."""
    ranks = gpus * nodes
    grad_bytes = 4 * num_params  # fp32 gradients as the host reduces them, in either precision
    weight_bytes = 4 * num_params
    nvlink = "pcie" not in profile.name
    choice = choose_reduction(grad_bytes, device_grad_bytes_per_param * num_params, ranks, nodes,
                              device_collectives="nccl", nvlink=nvlink, nic_bandwidth=nic_bandwidth)
    on_device = choice.on == "device" if reduce_gradients_on == "auto" else reduce_gradients_on == "device"
    ring = ring_bytes(device_grad_bytes_per_param * num_params if on_device else grad_bytes, ranks)
    allreduce_s = choice.device_seconds if on_device else choice.host_seconds
    reduction_why = choice.why if reduce_gradients_on == "auto" else f"reduce_gradients_on='{reduce_gradients_on}'"
    # Sharded across nodes: each node receives the other nodes' updated parameters, once (its
    # leader writes them into the node's shared copy).
    broadcast_bytes = (nodes - 1) / nodes * weight_bytes if shard_optimizer and nodes > 1 else 0
    broadcast_s = broadcast_bytes / nic_bandwidth if broadcast_bytes else 0.0

    host_traffic = gpus * (plan.h2d_bytes + plan.d2h_bytes)
    if ranks > 1 and not on_device:
        host_traffic += gpus * choose_reduction(grad_bytes, grad_bytes, ranks, nodes,
                                                device_collectives=None).host_memory_bytes
    # Averaged on the GPUs for a sharded optimizer that overlaps the backward: each gradient
    # is reduced to the rank that updates it, and only that rank copies it to its host.
    to_owner = ranks > 1 and on_device and shard_optimizer and bool(trace.host_optimizer.get("overlapped"))
    if to_owner:
        host_traffic -= gpus * device_grad_bytes_per_param * num_params * (1 - 1 / ranks)
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

    shared_weights = shard_optimizer
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
        "gradients_reduced_on": "device" if on_device else "host",
        "host_memory_per_node_bytes": {**node_memory, "total": sum(node_memory.values())},
        "assumptions": {
            "link": f"each GPU has its own host link ({profile.h2d_bandwidth / GB:.0f} GB/s per direction)",
            "host_memory_bandwidth": f"{profile.host_memory_bandwidth / GB:.0f} GB/s per node, shared by its GPUs' "
                                     f"copies, the all-reduce buffers and the optimizer",
            "allreduce": (f"NCCL ring on the GPUs: {'NVLink' if nvlink else 'PCIe'} "
                          f"{(NVLINK_BUS_BANDWIDTH if nvlink else PCIE_PEER_BANDWIDTH) / GB:.0f} GB/s bus bandwidth"
                          if on_device else
                          f"gloo ring on the host: loopback TCP {LOOPBACK_BANDWIDTH / GB:.0f} GB/s per rank")
                         + (f", NIC {nic_bandwidth / GB:.0f} GB/s per node between nodes" if nodes > 1 else "")
                         + f" ({reduction_why})"
                         + ("; each gradient reduced to the rank that updates it, which alone copies it to its "
                            "host" if to_owner else ""),
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
