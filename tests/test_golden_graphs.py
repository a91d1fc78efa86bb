"""Golden graphs: the rewritten forward and backward programs of the reference models.

Each file under tests/golden/ is the exact program the runtime executes after every pass
(one line per op, with shapes, placement, layer, the pass that inserted it and the plan's
decision). Any change to a pass shows up as a reviewable diff. Regenerate with

    MEGACOMPILE_ACCEPT_GOLDEN=1 python -m pytest tests/test_golden_graphs.py

The pass manager checks the graph invariants after every pass while these compile (a
violation fails the test); the losses are compared with eager in the same test.
"""
import copy
import os
import pathlib

import pytest
import torch
from conftest import COMPILED
from reference_models import GPT, MLP, REFERENCE_MODELS, LlamaLogits, make_training_step

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"
ACCEPT = os.environ.get("MEGACOMPILE_ACCEPT_GOLDEN") == "1"

# Small variants keep the golden files reviewable; recompute is forced where it matters so
# both plan policies are pinned.
CASES = {
    # Room for everything: parameters read by both passes are resident for the step.
    "mlp": (lambda: MLP(depth=3), {"recompute": "never"}),
    # A budget between the minimum and keep-everything: the planner mixes per-layer choices.
    "mlp_tight": (lambda: MLP(depth=3), {"memory_budget": 60_000}),
    # The LM head and loss fused (fuse_lm_head), in chunks of 8 of the 32 tokens.
    "gpt": (lambda: GPT(layers=2), {"recompute": "always", "head_chunk_tokens": 8}),
    "llama": (lambda: LlamaLogits(layers=2), {"recompute": "always"}),
    # bf16: parameters cast on the host before their loads, gradients cast to fp32 on the host
    # after their offloads; a budget that makes the planner offload or recompute.
    "mlp_bf16": (lambda: MLP(depth=3), {"precision": "bf16", "memory_budget": 30_000}),
}


def _compile_and_run(name: str):
    ctor, options = CASES[name]
    _, make_batch, loss_fn = REFERENCE_MODELS[name.split("_")[0]]
    torch.manual_seed(0)
    model = ctor()
    reference = copy.deepcopy(model)
    step, _ = make_training_step(model, loss_fn)
    eager_step, _ = make_training_step(reference, loss_fn)
    options = {"device": "cpu", "lowering": "eager", "snapshots": True, **options}
    step = torch.compile(step, backend="megatrain", options=options)
    x, y = make_batch(torch.Generator().manual_seed(1))
    # bf16 is compared with eager under autocast (tests/test_bf16.py says why 1e-5 holds).
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=options.get("precision") == "bf16"):
        want = eager_step(x, y)
    torch.testing.assert_close(step(x, y), want, rtol=1e-5, atol=0)
    records = [r for r in COMPILED if r.backward is not None]
    assert len(records) == 1, f"expected one training graph, got {[r.label for r in COMPILED]}"
    return records[0]


def _check_golden(path: pathlib.Path, text: str) -> None:
    if ACCEPT or not path.exists():
        if not ACCEPT:
            pytest.fail(f"{path} is missing; run with MEGACOMPILE_ACCEPT_GOLDEN=1 to create it")
        path.write_text(text)
        return
    expected = path.read_text()
    if expected != text:
        import difflib

        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            str(path), "now", n=2))
        pytest.fail(f"{path.name} changed (MEGACOMPILE_ACCEPT_GOLDEN=1 to accept):\n{diff[:6000]}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_rewritten_graphs(name):
    record = _compile_and_run(name)
    stages = {(s.graph, s.stage): s for s in record.snapshots}
    # Every pass ran on the graphs it declares, in the declared order.
    for graph, passes in (("forward", ["annotate", "host_casts", "stream_parameters", "offload_gradients"]),
                          ("backward", ["annotate", "host_casts", "recompute", "stream_parameters",
                                        "offload_gradients"])):
        ran = [s.stage for s in record.snapshots if s.graph == graph]
        assert ran == ["captured"] + passes
    for graph in ("forward", "backward"):
        final = stages[(graph, "offload_gradients")].text
        _check_golden(GOLDEN_DIR / f"{name}.{graph}.txt", final)


def test_golden_files_show_streaming():
    """The committed goldens themselves say what the passes promise (guards a bad accept)."""
    for name in CASES:
        fwd = (GOLDEN_DIR / f"{name}.forward.txt").read_text()
        bwd = (GOLDEN_DIR / f"{name}.backward.txt").read_text()
        loads = [line for line in fwd.splitlines() if "megatrain.load(" in line]
        resident = [line for line in loads if "resident:" in line]
        assert len(loads) == fwd.count("megatrain.evict(load__") + len(resident)
        assert "megatrain.offload(" in bwd and "grad." in bwd
        assert "load__grad_output_0" in bwd
        # The backward loads the streamed weights again; resident ones arrive as saved inputs.
        bwd_loads = [line for line in bwd.splitlines() if "megatrain.load(" in line]
        if not resident:
            assert any("weight" in line for line in bwd_loads)
        for line in resident:
            source = line.split("megatrain.load(")[1].split("'")[1]
            assert not any(f"'{source}'" in bl for bl in bwd_loads), f"resident {source} reloaded in backward"
    # bf16: every streamed parameter arrives through a host cast, every gradient leaves in
    # bf16 and becomes fp32 on the host.
    fwd = (GOLDEN_DIR / "mlp_bf16.forward.txt").read_text()
    bwd = (GOLDEN_DIR / "mlp_bf16.backward.txt").read_text()
    weight_loads = [line for line in fwd.splitlines() if "megatrain.load(" in line and "weight" in line]
    assert weight_loads and all("bf16[" in line for line in weight_loads)
    grads = [line for line in bwd.splitlines() if "megatrain.offload(" in line and "grad." in line]
    assert grads and all("bf16[" in line for line in grads)
    returned = bwd.splitlines()[-1]
    host_casts = [line for line in bwd.splitlines() if "host_cast:" in line and "f32[" in line]
    assert len(host_casts) == len(grads) and all(line.split(" = ")[0].strip() in returned for line in host_casts)
    # GPT's LM head is fused (chunks of 8 tokens): one op in the forward, which makes the head's
    # gradients too; the backward scales them and loads neither the head's weight nor the labels.
    fwd, bwd = ((GOLDEN_DIR / f"gpt.{part}.txt").read_text() for part in ("forward", "backward"))
    assert fwd.count("megatrain.lm_head_loss_and_grads(") == 1 and "megatrain.lm_head_loss" not in bwd
    assert "'head.weight')" not in "".join(line for line in bwd.splitlines() if "megatrain.load(" in line)
    assert "_log_softmax" not in fwd + bwd and "lm head fused: cross-entropy" in fwd
    # The Llama's is not (head_chunk_tokens="auto": its logits fit in one chunk), and says why.
    fwd = (GOLDEN_DIR / "llama.forward.txt").read_text()
    assert "megatrain.lm_head_loss" not in fwd and "lm head not fused: its 32 tokens' logits" in fwd
    tight = (GOLDEN_DIR / "mlp_tight.forward.txt").read_text()
    assert "offload" in tight or "recompute" in (GOLDEN_DIR / "mlp_tight.backward.txt").read_text()
