"""Data parallel on the CPU stand-in: two gloo processes against eager on the global batch.

``megacompile.data_parallel(model)`` averages gradients across ranks inside the megatrain
backward. Two ranks (subprocesses, as torchrun starts them, with timeouts so a hang fails)
train and compare with plain eager PyTorch on the concatenated global batch: parameters within
fp32 rounding, identical on both ranks; the sharded optimizer holds about half the AdamW state
per rank; four ranks on two hosts keep one shared copy of the parameters per host, the
hosts exchanging updates through one rank each; gradients averaged on the device (before
their copies) train the same; a DCP
checkpoint resumes on the same ranks and on one; a rank that exits makes the other's step
fail with ``DataParallelError``. The example script runs under torchrun.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import megacompile

ROOT = Path(__file__).resolve().parent.parent
# fp32: the two ranks' averaged gradient and the global batch's differ in rounding only.
PARAM_ATOL = 2e-5
GRAD_ATOL = 1e-6
LAUNCH_TIMEOUT = 150  # seconds: a hang fails the test instead of the suite

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world: int, port: int) -> dict:
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1"}


def _run_job(outdir, world: int, mode: list[str], host_of=None):
    """tests/data_parallel_worker.py on ``world`` ranks (as torchrun starts them, ``host_of(r)``:
    the rank's ``MEGACOMPILE_HOST_ID``): each rank's result, exit codes and output."""
    port = _free_port()
    worker = str(ROOT / "tests" / "data_parallel_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(outdir), *mode],
                              env={**_env(r, world, port), **({"MEGACOMPILE_HOST_ID": host_of(r)} if host_of else {})},
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=LAUNCH_TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the {world}-rank job hung past its timeout")
    results = []
    for rank in range(world):
        path = outdir / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result:\n{logs[rank][-4000:]}"
        results.append(json.loads(path.read_text()))
    return results, [p.returncode for p in procs], logs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both ranks' results of tests/data_parallel_worker.py (one job for every scenario: a
    process start and a compile are most of the time)."""
    return _run_job(tmp_path_factory.mktemp("dp"), 2, [])


def test_accumulation_clipping_and_no_sync_match_the_global_batch(two_ranks):
    results, _, logs = two_ranks
    for rank, result in enumerate(results):
        r = result["accumulate_and_clip"]
        assert r["grad_diff"] <= GRAD_ATOL, (rank, r["grad_diff"], logs[rank][-2000:])
        assert r["max_diff"] <= PARAM_ATOL, (rank, r["max_diff"])
        assert r["same_on_every_rank"]
        assert r["report"]["synced"] and r["report"]["world_size"] == 2 and r["report"]["rank"] == rank
        # One all-reduce per layer (4 layers), nothing more.
        assert r["report"]["buckets"] == 4 and r["report"]["sharded_optimizer"]
        assert not r["optimizer"]["overlapped"]


def test_gradients_averaged_on_the_device_match_the_global_batch(two_ranks):
    results, _, logs = two_ranks
    for rank, result in enumerate(results):
        r = result["averaged_on_the_device"]
        assert r["grad_diff"] <= GRAD_ATOL, (rank, r["grad_diff"], logs[rank][-2000:])
        assert r["max_diff"] <= PARAM_ATOL and r["same_on_every_rank"], (rank, r["max_diff"])
        reports = r["reports"]
        # Two synced micro-batches a step: every gradient (4 weights, 4 biases) averaged on
        # the device before its copy, no host bucket (the second adds its average to the first's).
        for report in reports[:4]:
            assert report["reduced_on"] == "device" and report["device_reductions"] == 8, report
            assert report["buckets"] == 0 and report["device_reduced_bytes"] == 4 * (16 * 16 + 16) * 4
        # Under no_sync nothing is reduced; the backward after it averages the local gradients
        # along with its own, which the host path does (one bucket per layer).
        assert not reports[4]["synced"]
        assert reports[5]["reduced_on"] == "host" and reports[5]["buckets"] == 4, reports[5]
        assert reports[5]["device_reductions"] == 0 and "no_sync" in reports[5]["reduced_on_why"]
        # The overlapped, sharded optimizer updates from averages the device made, each
        # reduced to the rank that updates it: a rank copies only its own half of the
        # gradients to the host (plus the 4-byte loss).
        o = r["overlapped"]
        assert o["overlapped"] == [True, True, True, True], rank
        assert o["max_diff"] <= PARAM_ATOL and o["same_on_every_rank"], (rank, o["max_diff"])
        assert o["report"]["reduced_on"] == "device" and o["report"]["device_reductions"] == 8
        assert o["report"]["buckets"] == 0
        assert o["owned_bytes"] == o["gradient_bytes"] // 2
        assert o["owned_bytes"] <= o["d2h_bytes"] <= o["owned_bytes"] + 4, (o["d2h_bytes"], o["owned_bytes"])


def test_auto_averages_on_the_host_without_device_collectives(two_ranks):
    results, _, _ = two_ranks
    for result in results:
        # The CPU stand-in: no NCCL for its tensors, so "auto" keeps the host path.
        report = result["overlapped_and_resumed"]["report"]
        assert report["reduced_on"] == "host" and report["device_reductions"] == 0
        assert "NCCL" in report["reduced_on_why"], report


def test_sharded_optimizer_holds_half_the_state(two_ranks):
    results, _, _ = two_ranks
    for scenario in ("accumulate_and_clip", "overlapped_and_resumed"):
        mine = [r[scenario]["state_bytes"] for r in results]
        total = results[0][scenario]["reference_state_bytes"]
        # Four equal layers: two each; together exactly the unsharded optimizer's state.
        assert mine == [total // 2, total // 2], (scenario, mine, total)


def test_one_host_keeps_one_copy_of_the_parameters(two_ranks):
    results, _, _ = two_ranks
    for result in results:
        # Sharded on one host: a write by rank 0 is what rank 1 reads (shared memory) ...
        assert result["accumulate_and_clip"]["parameters_shared"]
        assert result["accumulate_and_clip"]["report"]["shared_parameters"]
        # ... and with shared_memory=False each rank has its own copy, kept equal by broadcasts.
        assert not result["overlapped_and_resumed"]["parameters_shared"]
        assert not result["overlapped_and_resumed"]["report"]["shared_parameters"]


def test_overlapped_updates_wait_for_the_reduction(two_ranks):
    results, _, _ = two_ranks
    for rank, result in enumerate(results):
        r = result["overlapped_and_resumed"]
        # Every step overlaps on both ranks, the first too (its state is made before it).
        assert r["overlapped"] == [True, True, True, True, True], rank
        assert r["max_diff"] <= PARAM_ATOL and r["same_on_every_rank"], (rank, r["max_diff"])


def test_dcp_checkpoint_resumes_on_two_ranks_and_on_one(two_ranks):
    results, _, _ = two_ranks
    for r in results:
        # The same steps from the same state: the same arithmetic.
        assert r["overlapped_and_resumed"]["resumed_max_diff"] == 0.0
    one = results[0]["overlapped_and_resumed"]
    # One rank owns every parameter: it read both ranks' shards (the scheduler's lr was saved too).
    assert one["one_rank_state_bytes"] == one["reference_state_bytes"]
    assert one["one_rank_lr"] == pytest.approx(1e-2 * 0.7 ** 2)


def test_a_rank_that_dies_fails_the_other_with_a_clear_error(two_ranks):
    results, codes, logs = two_ranks
    assert codes[1] == 17
    died = results[0]["rank_dies"]
    assert died["error_type"] == "DataParallelError", (died, logs[0][-3000:])
    # Which collective, where, and what to do.
    assert "the gradient all-reduce of layer layers." in died["error"] and "rank 0 of 2" in died["error"]
    assert "Another rank most likely exited" in died["error"] and "restart" in died["error"]
    assert died["seconds"] < 25  # failed, not waited out a long timeout


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """Four ranks of tests/data_parallel_worker.py (mode two_hosts), two per host
    (``MEGACOMPILE_HOST_ID``; the test machine's shared memory stands in for each host's)."""
    results, _, _ = _run_job(tmp_path_factory.mktemp("dp_hosts"), 4, ["two_hosts"], host_of=lambda r: f"host{r // 2}")
    return [r["two_hosts"] for r in results]


def test_each_host_keeps_one_copy_and_updates_cross_hosts_once(two_hosts):
    for rank, r in enumerate(two_hosts):
        # Rank 0's write is what its host's other rank reads; the other host has its own copy.
        assert r["seen_rank0_write"] == [1, 1, 0, 0], rank
        assert r["report"]["shared_parameters"] and r["report"]["hosts"] == 2
        # Trained like eager on the global batch, the same on all four ranks: the hosts'
        # leaders carried each host's owners' updates to the other host.
        assert r["eager_loop"]["max_diff"] <= PARAM_ATOL and r["eager_loop"]["same_on_every_rank"], rank
        assert r["overlapped"] == [True, True, True]
        assert r["max_diff"] <= PARAM_ATOL and r["same_on_every_rank"], (rank, r["max_diff"])
        assert r["state_bytes"] == r["reference_state_bytes"] // 4


def test_example_script_checks_parity_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), "examples/train_data_parallel.py", "--device", "cpu", "--check", "--steps", "2"]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "parity with eager on the global batch" in done.stdout


def test_data_parallel_needs_a_process_group():
    import torch

    with pytest.raises(megacompile.DataParallelError, match="init_process_group"):
        megacompile.data_parallel(torch.nn.Linear(2, 2))


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo job in this process (destroyed afterwards)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_bad_setups_say_what_to_change(one_rank):
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with pytest.raises(megacompile.DataParallelError, match="not data parallel"):
        with megacompile.no_sync(model):
            pass
    megacompile.data_parallel(model, shard_optimizer=True)
    with pytest.raises(megacompile.DataParallelError, match="data parallel already"):
        megacompile.data_parallel(model)
    # A sharded optimizer is the fused host Adam / AdamW: SGD would update every parameter everywhere.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="megatrain", options={"device": "cpu", "lowering": "eager"})
    with pytest.raises(megacompile.DataParallelError, match="not SGD"):
        F.mse_loss(compiled(torch.randn(4, 8)), torch.randn(4, 2)).backward()
    del opt
    # One graph over a replicated model and a parameter that is not.
    extra = torch.nn.Parameter(torch.ones(2))
    mixed = torch.compile(lambda x: model(x) * extra, backend="megatrain",
                          options={"device": "cpu", "lowering": "eager"})
    with pytest.raises(megacompile.DataParallelError, match="1 parameter"):
        mixed(torch.randn(4, 8)).sum().backward()
