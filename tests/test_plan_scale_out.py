"""``megacompile plan --gpus N --nodes M``: the one-GPU plan carried to data parallel.

``scale_out`` is arithmetic over a one-GPU ``DepthPlan``; these tests give it a plan by hand
(no tracing) and check what each term must do: one GPU is the one-GPU plan, the shared host
memory and the network slow a node down, a sharded optimizer keeps a node's state at 1/nodes.
"""
from __future__ import annotations

import types

import pytest

from megacompile import cli
from megacompile.cli.plan_command.full_depth import DepthPlan
from megacompile.cli.plan_command.scale_out import format_scale_out, scale_out
from megacompile.plan.gradient_reduction import LOOPBACK_BANDWIDTH, NVLINK_BUS_BANDWIDTH, choose_reduction
from megacompile.plan.hardware import GB, get_profile

PARAMS = 1_000_000_000
LAYERS = 32


def one_gpu_plan(device_s: float = 2.0, backward_s: float = 1.3, optimizer_exposed_s: float = 0.05) -> DepthPlan:
    return DepthPlan(counts={"keep": LAYERS}, peak_bytes=1, device_s=device_s, lanes_s={}, flops=1, model_flops=1,
                     h2d_bytes=8 * PARAMS, d2h_bytes=4 * PARAMS, offloaded_activation_bytes=0, peak_region="layers",
                     optimizer_exposed_s=optimizer_exposed_s, backward_s=backward_s)


def traced(seconds: float = 0.5, overlapped: bool = True):
    return types.SimpleNamespace(host_optimizer={"seconds": seconds, "overlapped": overlapped,
                                                 "first_landing_s": 0.1, "tail_seconds": 0.05, "bytes": 1,
                                                 "params": PARAMS})


def run(gpus: int, nodes: int, **kw) -> dict:
    return scale_out(one_gpu_plan(), traced(), get_profile("h100-sxm"), gpus=gpus, nodes=nodes, num_params=PARAMS,
                     num_layers=LAYERS, tokens_per_gpu=4096, **kw)


def test_one_gpu_is_the_one_gpu_plan():
    s = run(1, 1)
    assert s["step_s"] == pytest.approx(one_gpu_plan().step_s)
    assert s["speedup"] == pytest.approx(1.0) and s["parts_s"]["allreduce"] == 0


def test_ranks_reduce_gradients_and_share_host_memory_bandwidth():
    two, eight = run(2, 1, reduce_gradients_on="host"), run(8, 1, reduce_gradients_on="host")
    # Each rank sends 2 (R-1)/R of the fp32 gradients over loopback TCP.
    assert two["allreduce_bytes_per_rank"] == pytest.approx(4 * PARAMS)
    assert eight["parts_s"]["allreduce"] == pytest.approx(2 * 7 / 8 * 4 * PARAMS / LOOPBACK_BANDWIDTH)
    assert eight["gradients_reduced_on"] == "host"
    # More GPUs per node: more tokens per step, never more per GPU than one GPU alone.
    assert two["tokens_per_s"] < eight["tokens_per_s"]
    for s in (two, eight):
        assert 0 < s["scaling_efficiency"] <= 1
    assert eight["parts_s"]["host_memory"] > two["parts_s"]["host_memory"]


def test_gradients_are_averaged_where_the_ring_is_faster():
    host, auto = run(8, 1, reduce_gradients_on="host"), run(8, 1)
    # NCCL over NVLink beats gloo over loopback TCP: auto reduces on the GPUs, before the
    # copies, so the host memory carries no all-reduce traffic and the step is no slower.
    assert auto["gradients_reduced_on"] == "device"
    assert auto["parts_s"]["allreduce"] == pytest.approx(2 * 7 / 8 * 4 * PARAMS / NVLINK_BUS_BANDWIDTH)
    assert auto["parts_s"]["host_memory"] < host["parts_s"]["host_memory"]
    assert auto["step_s"] <= host["step_s"]
    assert "NCCL ring on the GPUs" in auto["assumptions"]["allreduce"]
    # Sharded and overlapped: each gradient reduced to its owner, who alone copies it to the
    # host: a node's host memory carries 1/8 of the GPUs' gradient copies.
    replicated = run(8, 1, shard_optimizer=False)
    assert auto["host_memory_traffic_bytes_per_node"] == pytest.approx(
        replicated["host_memory_traffic_bytes_per_node"] - 8 * 4 * PARAMS * 7 / 8)
    assert "reduced to the rank that updates it" in auto["assumptions"]["allreduce"]
    assert "reduced to the rank" not in replicated["assumptions"]["allreduce"]
    # bf16 gradients on the device: half the bytes in the ring.
    bf16 = run(8, 1, device_grad_bytes_per_param=2)
    assert bf16["allreduce_bytes_per_rank"] == pytest.approx(auto["allreduce_bytes_per_rank"] / 2)


def test_the_reduction_choice_follows_the_bandwidths():
    # No collective backend for the device (the CPU stand-in): the host.
    assert choose_reduction(4 * PARAMS, 4 * PARAMS, 2, 1, device_collectives=None).on == "host"
    # One rank: nothing to reduce; a tie goes to the host, which holds nothing on the device.
    assert choose_reduction(4 * PARAMS, 4 * PARAMS, 1, 1, device_collectives="nccl").on == "host"
    # Between nodes both rings cross the same NIC, but gloo's TCP is capped at loopback's rate
    # and the device ring carries bf16: the device; with equal bytes and NIC, a tie: the host.
    assert choose_reduction(4 * PARAMS, 2 * PARAMS, 16, 2, device_collectives="nccl").on == "device"
    tie = choose_reduction(4 * PARAMS, 4 * PARAMS, 16, 2, device_collectives="nccl", nic_bandwidth=5 * GB)
    assert tie.on == "host" and tie.host_seconds == pytest.approx(tie.device_seconds)
    assert tie.host_memory_bytes > 0


def test_sharded_optimizer_keeps_a_node_at_one_copy():
    sharded, replicated = run(8, 1), run(8, 1, shard_optimizer=False)
    assert sharded["host_memory_per_node_bytes"]["optimizer_states"] == 8 * PARAMS
    assert sharded["host_memory_per_node_bytes"]["weights"] == 4 * PARAMS  # one shared copy
    assert replicated["host_memory_per_node_bytes"]["optimizer_states"] == 8 * 8 * PARAMS
    assert replicated["parts_s"]["optimizer_exposed"] > sharded["parts_s"]["optimizer_exposed"]
    # Across nodes a node holds 1/nodes of the state, and the parameters travel over the NIC.
    four_nodes = run(8, 4)
    assert four_nodes["host_memory_per_node_bytes"]["optimizer_states"] == 2 * PARAMS
    assert four_nodes["host_memory_per_node_bytes"]["weights"] == 4 * PARAMS  # one copy per node still
    # Each node receives the other nodes' 3/4 of the weights once, not once per GPU.
    assert four_nodes["parts_s"]["parameter_broadcast"] == pytest.approx(3 / 4 * 4 * PARAMS / (25 * GB))


def test_a_faster_nic_is_never_slower():
    slow, fast = run(8, 4, nic_bandwidth=5 * GB), run(8, 4, nic_bandwidth=50 * GB)
    assert fast["step_s"] <= slow["step_s"]
    assert slow["parts_s"]["allreduce"] > fast["parts_s"]["allreduce"]


def test_the_table_states_its_assumptions():
    text = "\n".join(format_scale_out(run(8, 4)))
    assert "8 GPU(s) x 4 node(s) = 32 ranks" in text and "NIC 25 GB/s" in text and "tokens/s" in text


def test_data_parallel_arguments_need_gpus(capsys):
    assert cli.main(["plan", "llama-3-8b", "--hardware", "h100-sxm", "--seq-len", "128", "--batch", "1",
                     "--nic-bandwidth", "10GB"]) == 2
    assert "add --gpus" in capsys.readouterr().err
    assert cli.main(["plan", "llama-3-8b", "--hardware", "h100-sxm", "--seq-len", "128", "--batch", "1",
                     "--gpus", "0"]) == 2


def test_plan_model_reports_the_data_parallel_step():
    # A 4-layer toy model traced for real: the wiring from the arguments to the report.
    from test_plan_cmd import H200, small_config

    from megacompile.cli.plan_command import planning

    r = planning.plan_model(small_config(layers=4), H200, batch=2, seq_len=64, model_name="small",
                            data_parallel={"gpus": 4, "nodes": 2})
    s = r.to_dict()["scale_out"]
    assert s["ranks"] == 8 and s["tokens_per_step"] == 8 * 2 * 64
    assert s["step_s"] >= r.depth_plan.step_s and s["parts_s"]["device"] == r.depth_plan.device_s
    assert "data parallel      4 GPU(s) x 2 node(s) = 8 ranks" in r.to_text()
