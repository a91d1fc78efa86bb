"""Option ``host_activation_budget``: the most bytes of activations a plan may put on the host.

The planner takes the fastest plan within ``memory_budget`` whose offloaded activations (its
offloaded values, streamed layers' inputs) fit the cap; plans over it are off the ladder, so a
plan they dominated can be chosen. Where no plan within the device budget meets the cap, the
error says how much the least of them puts on the host, before anything runs.
"""
import copy
import re

import pytest
import torch
from reference_models import _xent, make_training_step, train_side_by_side
from test_streamed_mixes import _batches, _model  # the same small GPT and batches

from megacompile.capture import records
from megacompile.core.errors import BudgetError, HostMemoryError, OptionsError
from megacompile.options import parse_options
from megacompile.plan import flat_planner

OPTIONS = {"plan_repeats": "flat", "disable_passes": ["chunk_tokens"]}


@pytest.fixture(scope="module")
def built():
    """Every plan the planner builds for the step (a budget nothing meets)."""
    attempts, make = [], flat_planner.PlanMaker.make

    def spy(self, spec, snapshots=False):
        attempt = make(self, spec, snapshots)
        attempts.append(attempt)
        return attempt

    flat_planner.PlanMaker.make = spy
    try:
        step, _ = make_training_step(_model(), _xent)
        compiled = torch.compile(step, backend="megatrain",
                                 options={"device": "cpu", "lowering": "eager", "memory_budget": 1024, **OPTIONS})
        with pytest.raises(BudgetError):
            compiled(*_batches(1)[0])
    finally:
        flat_planner.PlanMaker.make = make
        torch._dynamo.reset()
    return attempts


def _train(budget: int, **options):
    model = _model()
    with records.recording() as compiled:
        pairs, reference = train_side_by_side(model, lambda m: make_training_step(m, _xent)[0], _batches(),
                                              {"memory_budget": budget, **OPTIONS, **options})
    torch._dynamo.reset()
    (record,) = [r for r in compiled if r.backward is not None]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    return record


def _host_bytes(record) -> int:
    return flat_planner.Attempt(record.plan, record.forward, record.backward, []).host_activation_bytes


def _offloading_budget(built) -> tuple[int, "flat_planner.Attempt"]:
    """A budget where every plan faster than recompute-all offloads something, and recompute-all."""
    recompute_all = next(a for a in built if a.plan.policy == "recompute (all layers)")
    assert recompute_all.host_activation_bytes == 0
    on_device_above = min(a.peak for a in built if a.host_activation_bytes == 0 and a.peak > recompute_all.peak)
    return max(a.peak for a in built if a.host_activation_bytes > 0 and a.peak < on_device_above), recompute_all


def test_a_zero_cap_takes_the_fastest_plan_that_keeps_activations_on_the_device(built):
    budget, recompute_all = _offloading_budget(built)

    default = _train(budget)
    assert _host_bytes(default) > 0, default.plan.policy
    capped = _train(budget, host_activation_budget=0)
    assert _host_bytes(capped) == 0, capped.plan.policy
    # Not recompute-all with the rest of the budget unused: layers are kept where it has room.
    assert recompute_all.peak < capped.plan.peak_bytes <= budget, capped.plan.policy
    assert capped.plan.predicted_seconds < recompute_all.plan.predicted_seconds
    assert capped.plan.predicted_seconds > default.plan.predicted_seconds  # what the cap costs, predicted
    assert "host_activation_budget" in capped.plan.reason, capped.plan.reason


def test_below_recompute_all_a_cap_streams_only_the_layers_whose_inputs_the_host_holds(built):
    recompute_all = next(a for a in built if a.plan.policy == "recompute (all layers)")
    budget = recompute_all.peak - 1  # only plans with layer inputs on the host fit the device
    # Under every plan built without a cap that fits: the mixes stream as many layers as their
    # memory targets want, and each puts more on the host than this.
    cap = min(a.host_activation_bytes for a in built if a.peak <= budget) - 1
    assert cap > 0
    capped = _train(budget, host_activation_budget=cap)  # trains like eager
    assert 0 < _host_bytes(capped) <= cap, capped.plan.policy
    assert capped.plan.peak_bytes <= budget and "streamed" in capped.plan.policy, capped.plan.policy


class _DeepMLP(torch.nn.Module):
    """12 small layers and a head, whose saved values are little more than their inputs: offloading every
    saved value needs less device memory than recompute-all keeping every layer's input (the
    shape of a deep model at long context)."""

    def __init__(self, layers: int = 12, dim: int = 64) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU())
                                          for _ in range(layers))
        self.head = torch.nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_capped_streamed_mixes_are_not_hidden_by_a_smaller_plan_over_the_cap():
    """Below recompute-all's peak the capped mixes (only the layers whose inputs the host holds
    streamed) are drawn in under the smallest plan that fits the host, not under offload-all,
    which is smaller here but puts every saved value on the host."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(512, 64, generator=gen), torch.randn(512, 8, generator=gen)) for _ in range(2)]
    built, make = [], flat_planner.PlanMaker.make

    def spy(self, spec, snapshots=False):
        attempt = make(self, spec, snapshots)
        built.append(attempt)
        return attempt

    def model():
        torch.manual_seed(0)
        return _DeepMLP()

    def mse_step(m):
        return make_training_step(m, lambda out, y: torch.nn.functional.mse_loss(out, y))[0]

    flat_planner.PlanMaker.make = spy
    try:
        compiled = torch.compile(mse_step(model()), backend="megatrain",
                                 options={"device": "cpu", "lowering": "eager", "memory_budget": 1024, **OPTIONS})
        with pytest.raises(BudgetError):
            compiled(*batches[0])
    finally:
        flat_planner.PlanMaker.make = make
        torch._dynamo.reset()
    plans = {a.plan.policy: a for a in built}
    recompute_all, offload_all = plans["recompute (all layers)"], plans["offload (all layers)"]
    assert offload_all.peak < recompute_all.peak  # the shape this test is about
    # Room on the host for two layers' inputs, and a budget under every plan without streamed
    # layers that keeps within that room: only a mix streaming a layer or two fits both.
    cap = 2 * min(a.host_activation_bytes for a in built if a.host_activation_bytes > 0)
    budget = min(a.peak for a in built if a.host_activation_bytes <= cap and "streamed" not in a.plan.policy) - 1
    assert not any(a.peak <= budget and a.host_activation_bytes <= cap for a in built)  # none built without the cap
    with records.recording() as compiled_records:
        pairs, reference = train_side_by_side(model(), mse_step, batches,
                                              {"memory_budget": budget, "host_activation_budget": cap, **OPTIONS})
    torch._dynamo.reset()
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    (record,) = [r for r in compiled_records if r.backward is not None]
    assert offload_all.peak < record.plan.peak_bytes <= budget, record.plan.policy
    assert 0 < _host_bytes(record) <= cap and "streamed" in record.plan.policy, record.plan.policy


def test_no_plan_within_both_budgets_is_a_clear_error_before_anything_runs(built):
    recompute_all = next(a for a in built if a.plan.policy == "recompute (all layers)")
    budget = recompute_all.peak - 1  # only plans with layer inputs on the host fit the device
    model = _model()
    before = copy.deepcopy(model.state_dict())
    step, _ = make_training_step(model, _xent)
    compiled = torch.compile(step, backend="megatrain", options={
        "device": "cpu", "lowering": "eager", "memory_budget": budget, "host_activation_budget": 0, **OPTIONS})
    with pytest.raises(BudgetError, match="host_activation_budget") as raised:
        compiled(*_batches(1)[0])
    torch._dynamo.reset()
    # The cap that would do: no more than what the least of the plans built without a cap needs.
    least = int(re.search(r"Raise host_activation_budget to (\d+) \(that plan fits it\)", str(raised.value)).group(1))
    assert 0 < least <= min(a.host_activation_bytes for a in built if a.peak <= budget)
    assert raised.value.least_host_activation_bytes == least
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_the_error_names_the_cap_token_chunked_plans_need_where_it_is_lower():
    """Where no plan fits both budgets with the layers whole nor token-chunked, the error says
    what cap the chunked plans need when theirs is the lower one ("auto" chunks then)."""
    from megacompile.backend import _neither_fits

    def capped(least: int) -> BudgetError:
        return BudgetError(f"no plan within both budgets; raise host_activation_budget to {least}",
                           minimum_budget=None, limiting_layer="layers.0", least_host_activation_bytes=least)

    error = _neither_fits(capped(68 << 30), capped(33 << 30))
    assert error.least_host_activation_bytes == 33 << 30
    assert f"raise host_activation_budget to {33 << 30} for it" in str(error)
    error = _neither_fits(capped(30 << 30), capped(33 << 30))  # whole needs less: its own message says so
    assert error.least_host_activation_bytes == 30 << 30 and "token_chunks" not in str(error)
    device = BudgetError("memory_budget is too small", minimum_budget=70 << 30, limiting_layer="layers.0")
    error = _neither_fits(device, capped(33 << 30))  # whole fits no budget, chunked only the device's
    assert error.least_host_activation_bytes == 33 << 30 and str(33 << 30) in str(error)


def test_option_parsing():
    assert parse_options({"device": "cpu", "host_activation_budget": "2GiB"}).host_activation_budget == 2 << 30
    assert parse_options({"device": "cpu", "host_activation_budget": 0}).host_activation_budget == 0
    assert parse_options({"device": "cpu"}).host_activation_budget is None
    for bad in (-1, True, "lots"):
        with pytest.raises(OptionsError, match="host_activation_budget"):
            parse_options({"device": "cpu", "host_activation_budget": bad})


def test_a_host_that_cannot_hold_the_offloaded_activations_is_told_to_cap_them(built, monkeypatch):
    """The plan's host buffer for offloaded activations is checked against the host's available
    memory before it is allocated: the error names the option that fixes it, nothing has run,
    and the step planned with that option trains."""
    from megacompile.core import host_memory

    budget, _ = _offloading_budget(built)
    model = _model()
    step, _ = make_training_step(model, _xent)
    before = copy.deepcopy(model.state_dict())
    compiled = torch.compile(step, backend="megatrain",
                             options={"device": "cpu", "lowering": "eager", "memory_budget": budget, **OPTIONS})
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1024)
    with pytest.raises(HostMemoryError, match="host_activation_budget") as info:
        compiled(*_batches(1)[0])
    assert info.value.available_bytes == 1024 and info.value.needed_bytes > 1024
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    monkeypatch.undo()
    torch._dynamo.reset()
    record = _train(budget, host_activation_budget=0)
    assert _host_bytes(record) == 0, record.plan.policy
