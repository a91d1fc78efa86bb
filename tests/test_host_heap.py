"""runtime/host_heap: the C heap's freed pages go back to the OS after each backward.

- ``release_now`` returns freed heap pages: RSS falls by most of what was freed in the middle of
  the heap (pages glibc's allocator would otherwise keep).
- A compiled step trims after its backward, in the background, and the report says so;
  ``release_host_heap=False`` turns it off; a bad value is refused.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference_models import make_training_step

import megacompile
from megacompile.core.errors import OptionsError
from megacompile.options import parse_options
from megacompile.runtime import host_heap

pytestmark = pytest.mark.skipif(not host_heap.available() or not host_heap.rss_bytes(),
                                reason="needs a C library with malloc_trim and /proc/self/statm (glibc Linux)")


def test_freed_heap_pages_go_back_to_the_os():
    blocks = [bytearray(b"x") * 100_000 for _ in range(1000)]  # 100 MB, each block below the mmap threshold
    keep = blocks[-1]  # the heap's top stays in use: what is freed below it is not given back by free()
    del blocks
    before = host_heap.rss_bytes()
    released = host_heap.release_now()
    assert released > 50_000_000, (released, before)
    assert host_heap.rss_bytes() <= before - 50_000_000
    assert host_heap.stats().last_released_bytes == released
    del keep


def _train(steps: int, **options):
    torch.manual_seed(0)
    step, _ = make_training_step(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)), F.mse_loss)
    compiled = torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager", **options})
    for _ in range(steps):
        compiled(torch.randn(8, 32), torch.randn(8, 4))
    host_heap.wait()
    return megacompile.last_report()


def test_a_step_trims_after_its_backward_and_reports_it():
    host_heap.wait()
    before = host_heap.stats().trims
    report = _train(3)
    after = host_heap.stats().trims
    # One per backward, less any asked for while the last still ran (dropped by design).
    assert before + 1 <= after <= before + 3
    # The report holds the trims done as the last backward ended (its own one runs on after it).
    assert report.host_heap is not None and before <= report.host_heap["trims"] <= after
    assert "host heap released" in str(report)


def test_release_host_heap_false_does_not_trim():
    host_heap.wait()
    before = host_heap.stats().trims
    report = _train(2, release_host_heap=False)
    assert report.host_heap is None and host_heap.stats().trims == before
    with pytest.raises(OptionsError, match="release_host_heap"):
        parse_options({"device": "cpu", "release_host_heap": "yes"})
