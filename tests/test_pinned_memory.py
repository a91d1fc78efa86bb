"""The cap on page-locked host memory (issue 18, item 6: option ``pinned_host_memory``).

The CUDA runtime asks ``PinnedHostBudget`` before every pin (parameters pinned in place,
page-locked bf16 weight copies, landing buffers); past the cap tensors stay pageable. The
budget itself and the option are tested here; tests/test_cuda.py checks a capped step on a GPU.
"""
import threading

import pytest
import torch

import megacompile
from megacompile.core.errors import OptionsError
from megacompile.options import parse_options
from megacompile.runtime.device import get_device
from megacompile.runtime.pinned_memory import PinnedHostBudget


def test_budget_refuses_past_the_cap_and_counts_what_it_refused():
    uncapped = PinnedHostBudget()
    assert uncapped.try_pin(10**12) and uncapped.pinned == 10**12  # nothing refused, still counted
    budget = PinnedHostBudget()
    budget.limit(None)  # no cap asked: still none
    assert budget.cap is None
    budget.limit(100)
    budget.limit(300)  # the smallest cap wins
    assert budget.cap == 100
    assert budget.try_pin(60) and budget.try_pin(40)
    assert not budget.try_pin(1)
    assert (budget.pinned, budget.peak, budget.refused) == (100, 100, 1)
    budget.release(60)
    assert budget.try_pin(50) and budget.pinned == 90


def test_budget_is_exact_under_threads():
    budget = PinnedHostBudget(cap=1000)

    def churn():
        for _ in range(2000):
            if budget.try_pin(7):
                budget.release(7)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert budget.pinned == 0 and budget.peak <= 1000


def test_option_takes_a_size_or_zero_and_rejects_the_rest():
    assert parse_options({"device": "cpu", "pinned_host_memory": "1MiB"}).pinned_host_memory == 2**20
    assert parse_options({"device": "cpu", "pinned_host_memory": 0}).pinned_host_memory == 0
    assert parse_options({"device": "cpu"}).pinned_host_memory is None
    for bad in ("lots", -5, True):
        with pytest.raises(OptionsError, match="pinned_host_memory"):
            parse_options({"device": "cpu", "pinned_host_memory": bad})


def test_cap_reaches_the_device_and_the_report():
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    device = get_device("cpu")
    try:
        torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager",
                                                          "pinned_host_memory": "64MiB"})(torch.randn(4, 16))
        report = megacompile.last_report()
        assert report.pinned_host_cap == 64 * 2**20 and device.pinned.cap == 64 * 2**20
        assert report.pinned_host_bytes == 0  # the stand-in pins nothing
        assert "pinned host" in str(report)
    finally:
        device.pinned.cap = None  # the device is the process's: later tests run uncapped
