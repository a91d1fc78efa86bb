"""The CPU stand-in copies only where a copy is observed.

Its "device" memory is host memory: a load or offload copies so that the eager lowering can
measure the schedule's device peak. The Inductor lowering measures nothing there, so loads
share the host tensor and offloads hand the device tensor over (no bytes move; the
schedule's traffic is still counted). Sharing is off where a parameter could change while a
program that shares it still runs: the overlapped optimizer updates mid-backward.

The Inductor lowering's segments run as FX graphs here (the sharing, not Inductor, is under
test; tests/test_parity.py runs it through Inductor)."""
import copy

import pytest
import torch
from conftest import record_programs
from reference_models import REFERENCE_MODELS, make_training_step, training_state_bytes

import megacompile
from megacompile.core import torch_compat as compat
from megacompile.runtime.device import CpuStandInDevice


@pytest.fixture
def calls(monkeypatch):
    """Counts of the stand-in's copying and sharing memory ops, segments run as FX graphs."""
    counts = {"load": 0, "offload": 0, "share": 0, "hand_over": 0}
    for name in counts:
        original = getattr(CpuStandInDevice, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(CpuStandInDevice, name, counted)
    monkeypatch.setattr(compat, "inductor_compile", lambda gm, inputs: gm)
    return counts


def _train_both(name: str, options: dict, steps: int = 3):
    """Trains a reference model with megatrain and eagerly; asserts parity; returns the report."""
    ctor, batch, loss_fn = REFERENCE_MODELS[name]
    torch.manual_seed(0)
    model = ctor()
    reference = copy.deepcopy(model)
    step, _ = make_training_step(model, loss_fn)
    eager_step, _ = make_training_step(reference, loss_fn)
    compiled = torch.compile(step, backend="megatrain", options=options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = batch(gen)
        torch.testing.assert_close(compiled(x, y), eager_step(x, y), rtol=1e-5, atol=1e-6)
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=lambda m: f"{pname}: {m}")
    return megacompile.last_report()


def _budget(name: str, fraction: float) -> int:
    torch.manual_seed(0)
    return int(training_state_bytes(REFERENCE_MODELS[name][0]()) * fraction)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_inductor_lowering_shares_host_memory_and_counts_the_same_traffic(calls, name):
    """Nothing is copied under the Inductor lowering, training equals eager, and the bytes the
    schedule moves per step are counted exactly as the copying (eager) lowering counts them."""
    torch._dynamo.reset()
    shared = _train_both(name, {"device": "cpu", "lowering": "inductor"})
    assert calls["load"] == 0 and calls["offload"] == 0, calls
    assert calls["share"] > 0 and calls["hand_over"] > 0, calls
    torch._dynamo.reset()
    copied = _train_both(name, {"device": "cpu", "lowering": "eager"})
    assert calls["load"] > 0 and calls["offload"] > 0, calls
    assert (shared.h2d_bytes, shared.d2h_bytes) == (copied.h2d_bytes, copied.d2h_bytes)
    assert shared.h2d_bytes > 0 and shared.d2h_bytes > 0


@pytest.mark.parametrize("fraction, trade", [(0.25, "recompute"), (0.3, "offload")])
def test_shared_traded_activations_train_like_eager(calls, fraction, trade):
    """Under budgets that recompute or offload activations, shared loads and offloads still
    train equal to eager (an activation handed over in the forward is what the backward
    reads again)."""
    from conftest import COMPILED

    torch._dynamo.reset()
    report = _train_both("gpt", {"device": "cpu", "lowering": "inductor",
                                 "memory_budget": _budget("gpt", fraction)})
    plan = next(r for r in reversed(COMPILED) if r.backward is not None).plan
    if trade == "recompute":  # recompute everywhere, or per layer with some layers streamed
        recomputes = plan.policy.startswith("recompute") or "recompute" in plan.layer_policy.values()
        assert recomputes and report.recomputed_ops, plan.policy
    else:
        assert "offload" in plan.value_policy.values(), plan.policy
    assert calls["load"] == 0 and calls["share"] > 0, calls


def test_overlapped_optimizer_keeps_the_copies(calls):
    """With the optimizer updating parameters mid-backward, a backward read after a layer's
    update must see the copy it loaded, not the updated parameter: the stand-in copies, and
    training equals eager."""
    torch._dynamo.reset()
    _train_both("mlp", {"device": "cpu", "lowering": "inductor", "overlap_optimizer": True})
    assert megacompile.last_report().optimizer["overlapped"], megacompile.last_report().optimizer
    assert calls["share"] == 0 and calls["hand_over"] == 0, calls
    assert calls["load"] > 0 and calls["offload"] > 0, calls


def test_shared_memory_ops_leave_one_segment_per_layer(calls, monkeypatch):
    """Loads and offloads that move no bytes do not cut a layer's compute into pieces: with
    sharing, each layer's forward and each layer's backward is one segment (loads are issued
    ahead of it, offloads after it, and waits and evicts are gone). A copying program has the
    same segments once merge_compute_runs gathered each layer's memory ops at its ends, and
    without that pass it is cut at every memory op. All train equal to eager."""
    programs = record_programs(monkeypatch)

    def segment_layers(options: dict) -> dict:
        programs.clear()
        torch._dynamo.reset()
        _train_both("gpt", options, steps=1)
        return {p.label.split()[-1]: [i.layer for i in p.instructions if i.kind == "segment"]
                for p in programs if "(no backward)" not in p.label}  # not the loss's detach

    def direct_ops() -> int:
        return sum(i.kind == "op" for p in programs for i in p.instructions)

    shared = segment_layers({"device": "cpu", "lowering": "inductor"})
    assert all(p.share_host_memory for p in programs)
    assert not {i.kind for p in programs for i in p.instructions} & {"wait", "evict"}
    blocks = [f"blocks.{k}" for k in range(3)]
    for phase in ("forward", "backward"):
        layers = shared[phase]
        assert len(layers) == len(set(layers)), layers  # one segment per layer
        assert [layer for layer in layers if layer in blocks] == (blocks if phase == "forward" else blocks[::-1])
    copying = {"device": "cpu", "lowering": "inductor", "overlap_optimizer": True}
    merged = segment_layers(copying)
    assert not any(p.share_host_memory for p in programs)
    merged_alone = direct_ops()
    for phase in ("forward", "backward"):
        # Memory ops gathered at each layer's ends (merge_compute_runs): one segment per layer.
        assert merged[phase] == shared[phase], (merged[phase], shared[phase])
    cut = segment_layers({**copying, "disable_passes": ["merge_compute_runs"]})
    for phase in ("forward", "backward"):
        assert cut[phase].count("blocks.1") > 1, cut[phase]  # cut at its memory ops
    # Ops run one by one through dispatch: a layer's views and matmuls between a weight's
    # wait and its evict, unless its memory ops are gathered at its ends.
    assert merged_alone < direct_ops() / 4, (merged_alone, direct_ops())
