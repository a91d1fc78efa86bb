"""Layers marked with ``torch.compiler.nested_compile_region`` (issue 3, deliverable 6, part).

Dynamo traces a marked layer once and calls the one body (``invoke_subgraph``) for every
later layer; megatrain inlines each call back into the flat graph with the call site's
module paths (``megacompile/capture/inline_regions.py``) so parameters stream per layer and the plan
and report attribute every op to its own layer. Compared with eager: losses 1e-5 relative,
parameters 1e-5 absolute, over AdamW steps under a budget that forces streaming.
"""
from __future__ import annotations

import collections
import copy
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import COMPILED
from reference_models import make_training_step, training_state_bytes

import megacompile
from megacompile.capture import inline_regions
from megacompile.core import ops
from megacompile.core import torch_compat as compat
from megacompile.core.node_info import has_info, info


def _once_per_body(partitions: list) -> bool:
    """One partition per body Dynamo traced, never one per layer: torch 2.13 inlines a
    region's first call and traces one body; 2.11 may trace the first call as its own."""
    return 1 <= len(partitions) <= 2


class MarkedBlock(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MarkedNet(nn.Module):
    def __init__(self, depth: int = 5, dim: int = 32, block: type = MarkedBlock) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _marked_net_under_a_quarter_budget(net: type = MarkedNet, mark: bool = False):
    """A ``net`` compiled by megatrain under 25% of its training state (streaming forced), its
    layers marked by mark_repeated_layers if ``mark``, with an eager twin from the same
    weights: (model, twin, compiled step, eager step, budget)."""
    torch.manual_seed(0)
    model = net()
    reference = copy.deepcopy(model)
    if mark:
        assert megacompile.mark_repeated_layers(model) == [f"blocks.{i}" for i in range(len(model.blocks))]
    step, _ = make_training_step(model, F.mse_loss, lr=1e-2)
    eager_step, _ = make_training_step(reference, F.mse_loss, lr=1e-2)
    budget = training_state_bytes(model) // 4
    compiled = torch.compile(step, backend="megatrain",
                             options={"device": "cpu", "lowering": "eager", "memory_budget": budget})
    return model, reference, compiled, eager_step, budget


def _two_steps_equal_eager(net: type = MarkedNet, mark: bool = False):
    """Two AdamW steps of the marked net under a quarter budget, asserted equal to eager
    (losses and parameters): (model, budget)."""
    model, reference, compiled, eager_step, budget = _marked_net_under_a_quarter_budget(net, mark)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen)
        torch.testing.assert_close(compiled(x, y), eager_step(x, y), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-5)
    return model, budget


def test_marked_layers_stream_per_layer_and_equal_eager(monkeypatch):
    inlined, body_partitions = [], []
    original = inline_regions.inline_partitioned_regions
    original_partition = compat.save_everything_partition

    def counting(gm):
        n = original(gm)
        inlined.append(n)
        return n

    def counting_partition(joint, num_fwd_outputs):
        body_partitions.append(joint)
        return original_partition(joint, num_fwd_outputs)

    monkeypatch.setattr(inline_regions, "inline_partitioned_regions", counting)
    monkeypatch.setattr(compat, "save_everything_partition", counting_partition)
    model, reference, compiled, eager_step, budget = _marked_net_under_a_quarter_budget()
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen)
            torch.testing.assert_close(compiled(x, y), eager_step(x, y), rtol=1e-5, atol=0)
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-5)
    assert not [w for w in caught if "megatrain" in str(w.message)]  # no fallback
    # Dynamo traced the block once and AOTAutograd traced and partitioned its forward and
    # backward once: the step's joint graph called the two bodies per block it got as a call
    # (at least 4 of the 5 blocks: a forward and a backward call each). torch 2.13 inlines
    # the first call and traces one body; 2.11 traces the first call as a body of its own.
    assert _once_per_body(body_partitions)
    assert len(inlined) == 1 and inlined[0] >= 8 and inlined[0] % 2 == 0
    report = megacompile.last_report()
    assert report.measured_peak_device_bytes <= budget
    rows = {r.layer: r for r in report.layers}
    block_rows = [rows[f"blocks.{i}"] for i in range(5)]
    # Every block is its own layer: its own parameters streamed in, its own gradients out.
    per_block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert all(r.param_bytes == per_block for r in block_rows)
    assert all(r.h2d_bytes >= per_block and r.d2h_bytes == per_block for r in block_rows)


def test_inlining_renames_module_paths_to_the_call_site():
    torch.manual_seed(0)
    model = MarkedNet(depth=3)
    graphs = []

    def capture(gm, example_inputs):
        before = sum(1 for n in gm.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target))
        inline_regions.inline_nested_regions(gm)
        paths = set()
        for n in gm.graph.nodes:
            for path, _ in (n.meta.get("nn_module_stack") or {}).values():
                paths.add(path)
        graphs.append((before, gm, paths))
        return gm.forward

    x = torch.randn(2, 32)
    out = torch.compile(model, backend=capture)(x)
    torch.testing.assert_close(out, model(x))  # the inlined graph computes the same
    before, gm, paths = graphs[0]
    # Dynamo turns the calls into calls of traced bodies (2.13 inlines the first one).
    assert before >= 2
    assert not any("invoke_subgraph" in str(n.target) for n in gm.graph.nodes)
    for i in range(3):
        assert any(p.endswith(f"blocks.{i}.up") for p in paths), (i, sorted(paths))


def _count_body_partitions(monkeypatch) -> list:
    """The joint graphs AOTAutograd partitions as region bodies, from now on in this test."""
    body_partitions = []
    original_partition = compat.save_everything_partition

    def counting_partition(joint, num_fwd_outputs):
        body_partitions.append(joint)
        return original_partition(joint, num_fwd_outputs)

    monkeypatch.setattr(compat, "save_everything_partition", counting_partition)
    return body_partitions


def _llama_trains_like_eager(model, reference, budget: int = 700_000):
    """Two AdamW steps of a tiny HF Llama under megatrain (streaming budget) and of its eager
    twin, asserted equal (losses 1e-5 relative, parameters 1e-5), with measured = planned peak
    <= budget: the step's report."""
    from reference_models import labels_training_step

    compiled = torch.compile(labels_training_step(model), backend="megatrain",
                             options={"device": "cpu", "lowering": "eager", "memory_budget": budget})
    eager = labels_training_step(reference)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 96, (2, 16), generator=gen)
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-5)
    report = megacompile.last_report()
    assert report.measured_peak_device_bytes == report.planned_peak_device_bytes <= budget
    return report


def test_marked_hugging_face_llama_layers_are_traced_and_partitioned_once(monkeypatch):
    """A stock transformers Llama whose decoder layer class is marked: AOTAutograd partitions
    the layer's joint graph once for all three layers, the plan streams and recomputes per
    layer, and training equals eager."""
    from reference_models import tiny_llama

    body_partitions = _count_body_partitions(monkeypatch)
    torch.manual_seed(0)
    model = tiny_llama(3)
    reference = copy.deepcopy(model)
    layer_class = type(model.model.layers[0])
    monkeypatch.setattr(layer_class, "forward", torch.compiler.nested_compile_region(layer_class.forward))

    report = _llama_trains_like_eager(model, reference)
    assert _once_per_body(body_partitions)
    rows = {r.layer: r for r in report.layers}
    per_layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    record = next(r for r in COMPILED if r.backward is not None)
    decoder = [f"model.layers.{i}" for i in range(3)]
    # Every layer the plan replays replays the same ops (compute ops: a streamed layer's reload
    # of its output for the next layer's replay is counted with it, and the last layer's output
    # is not reloaded); a layer it keeps replays fewer. (The plan may keep a layer where the
    # budget has room: at this one it keeps the last.)
    replayed = collections.Counter(info(n).layer for n in record.backward.graph.nodes
                                   if has_info(n) and info(n).phase == "recompute" and not ops.is_memory_op(n))
    replaying = [layer for layer in decoder if record.plan.layer_policy[layer] != "keep"]
    assert len(replaying) >= 2, record.plan.policy
    assert replayed[replaying[0]] > 0 and {replayed[layer] for layer in replaying} == {replayed[replaying[0]]}
    assert all(replayed[layer] < replayed[replaying[0]] for layer in decoder if layer not in replaying)
    for layer in decoder:
        assert rows[layer].param_bytes == per_layer and rows[layer].h2d_bytes >= per_layer


def test_marked_layers_under_bf16_stay_regions_and_train_like_eager_autocast(monkeypatch):
    """Under ``precision="bf16"`` marked layers stay regions through AOTAutograd, traced inside the
    step's autocast: the layer's joint graph is partitioned once for all layers (they were inlined
    and traced one by one before, for the causal mask's elision, which now reaches into the
    body), the mask is elided there, and training equals eager autocast (the stock bf16 bound)."""
    from reference_models import labels_training_step, tiny_llama, train_side_by_side

    body_partitions = _count_body_partitions(monkeypatch)
    torch.manual_seed(0)
    model = tiny_llama(3)
    model.set_attn_implementation("sdpa")  # the attention whose mask is elided
    assert len(megacompile.mark_repeated_layers(model)) == 3
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 96, (2, 16), generator=gen),) for _ in range(2)]
    budget = training_state_bytes(model) // 4
    pairs, _ = train_side_by_side(model, labels_training_step, batches, {"memory_budget": budget, "precision": "bf16"},
                                  autocast=True)
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=2.0**-12, atol=0)
    assert _once_per_body(body_partitions)
    report = megacompile.last_report()
    assert report.measured_peak_device_bytes == report.planned_peak_device_bytes <= budget
    record = next(r for r in COMPILED if r.backward is not None)
    notes = [info(n).attention_mask for n in record.forward.graph.nodes if has_info(n) and info(n).attention_mask]
    assert len(notes) == 3 and all(note.startswith("causal:") and "inside the layer region" in note for note in notes)


def test_backward_calls_pair_with_their_forward_calls_without_call_ids(monkeypatch):
    # torch 2.11 records no meta["custom"]["call_id"] on invoke_subgraph calls (found on the
    # GPU machine): a backward call is then paired with the forward call whose saved values it
    # reads. Strip the ids here and every block must still be its own layer.
    original = inline_regions.inline_partitioned_regions
    stripped = []

    def without_call_ids(gm):
        for n in gm.graph.nodes:
            if n.op == "call_function" and compat.is_invoke_subgraph(n.target):
                custom = dict(n.meta.get("custom") or {})
                stripped.append(custom.pop("call_id", None))
                n.meta["custom"] = custom
        return original(gm)

    monkeypatch.setattr(inline_regions, "inline_partitioned_regions", without_call_ids)
    model, budget = _two_steps_equal_eager()
    assert len(stripped) >= 8  # the forward and backward calls of at least four blocks
    rows = {r.layer: r for r in megacompile.last_report().layers}
    per_block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    for i in range(5):
        assert rows[f"blocks.{i}"].d2h_bytes == per_block  # each block's gradients, once
        assert rows[f"blocks.{i}"].h2d_bytes >= per_block


def test_a_marked_body_schema_is_derived_once_not_per_call(monkeypatch):
    """AOTAutograd derives a marked body's schema (a full re-trace of the body) for every call
    it traces under autograd; megatrain keeps it per body and operand metadata for one step
    graph (``compat.invoke_subgraph_schema_memo``): the derivations do not grow with the
    number of calls, training still equals eager, and the operator is left as it was."""
    hop = torch.ops.higher_order.invoke_subgraph
    derived = []
    original = type(hop).gen_schema

    def counting(self, subgraph, identifier, *operands):
        derived.append(identifier)
        return original(self, subgraph, identifier, *operands)

    monkeypatch.setattr(type(hop), "gen_schema", counting)
    torch._dynamo.reset()
    _two_steps_equal_eager()
    # Five blocks: at least four calls of one body traced under autograd (torch 2.11 may
    # trace the first call as a body of its own). One derivation per distinct body (the
    # Dynamo body, and the forward and backward bodies AOTAutograd partitions it into), never
    # one per call.
    assert derived and len(derived) == len(set(derived)), derived
    assert "gen_schema" not in vars(hop)  # the memo is gone once the step graph is compiled


def test_repeated_layers_the_user_did_not_mark_are_found_and_traced_once(monkeypatch):
    """megacompile.mark_repeated_layers finds a stock transformers Llama's decoder layers (one
    run of three in model.layers, nothing else) and marks each instance (a subclass swapped
    in), not the class: AOTAutograd partitions the layer once, training equals eager, another
    instance of the class is untouched, and unmarking puts the class back."""
    from reference_models import tiny_llama

    body_partitions = _count_body_partitions(monkeypatch)
    torch.manual_seed(0)
    model = tiny_llama(3)
    reference = copy.deepcopy(model)
    bystander = tiny_llama(2)
    assert megacompile.capture.repeated_layers.find_repeats(model) == [[f"model.layers.{i}" for i in range(3)]]
    assert megacompile.mark_repeated_layers(model) == [f"model.layers.{i}" for i in range(3)]
    assert megacompile.mark_repeated_layers(model) == []  # marked already
    layer_class = type(bystander.model.layers[0])
    assert not compat.is_compile_region(layer_class.forward)
    assert all(type(layer) is not layer_class and isinstance(layer, layer_class) for layer in model.model.layers)
    assert all(type(layer) is layer_class for layer in bystander.model.layers)

    # The layer's call (hidden states, keywords, a (cos, sin) tuple) flattens into leaves, so
    # Dynamo fingerprints each call on its fast path (repeats._flatten_call).
    calls = []
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(megacompile.capture.repeated_layers._flatten_call(args, kwargs)),
        with_kwargs=True)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    handle.remove()
    assert calls[0] is not None and "position_embeddings:tuple:2" in calls[0][0], calls

    _llama_trains_like_eager(model, reference)
    assert _once_per_body(body_partitions)
    assert megacompile.unmark_repeated_layers(model) == [f"model.layers.{i}" for i in range(3)]
    assert all(type(layer) is layer_class for layer in model.model.layers)


def test_find_repeats_needs_the_same_class_and_shapes():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 8), nn.Linear(8, 8),
                        nn.Linear(8, 8), nn.Linear(8, 8))
    # ReLU (no parameters) is no layer; Linear(4, 8) differs in shape from its neighbours.
    assert megacompile.capture.repeated_layers.find_repeats(net) == [["0", "1"], ["4", "5", "6"]]
    holder = nn.ModuleDict({"blocks": nn.ModuleList(MarkedBlock(8) for _ in range(2))})
    # MarkedBlock's class forward is a region already: found, but not marked again.
    assert megacompile.capture.repeated_layers.find_repeats(holder) == [["blocks.0", "blocks.1"]]
    assert megacompile.mark_repeated_layers(holder) == []


def test_a_marked_call_is_flattened_into_leaves_and_rebuilt():
    """The marking forward hands the region a layout string and flat leaves (Dynamo's fast
    fingerprint path, no pytree flatten traced per call); the region rebuilds the same call."""
    from megacompile.capture.repeated_layers import _flatten_call, _unflatten_call

    h, cos, sin, ids = torch.randn(2, 3), torch.randn(3), torch.randn(3), torch.arange(3)
    kwargs = {"attention_mask": None, "position_embeddings": (cos, sin), "position_ids": ids,
              "use_cache": False, "extra": [ids, 2]}
    layout, leaves = _flatten_call((h, 7), kwargs)
    assert layout == "0|1|attention_mask|position_embeddings:tuple:2|position_ids|use_cache|extra:list:2"
    assert [type(v) for v in leaves] == [torch.Tensor, int, type(None), torch.Tensor, torch.Tensor, torch.Tensor,
                                         bool, torch.Tensor, int]
    args, rebuilt = _unflatten_call(layout, tuple(leaves))
    assert args[0] is h and args[1] == 7
    assert list(rebuilt) == list(kwargs)
    assert type(rebuilt["position_embeddings"]) is tuple and rebuilt["position_embeddings"][1] is sin
    assert type(rebuilt["extra"]) is list and rebuilt["extra"] == [ids, 2]
    assert rebuilt["use_cache"] is False and rebuilt["attention_mask"] is None
    # A nested or non-leaf argument is not flattened (the region gets the call as it is).
    assert _flatten_call((h,), {"cache": {"k": h}}) is None
    assert _flatten_call((h,), {"pairs": ((cos, sin),)}) is None
    assert _flatten_call((h,), {"a|b": h}) is None


class DictArgBlock(nn.Module):
    """A layer called with a dict: its marked call takes the region's ordinary path."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, scales: dict) -> torch.Tensor:
        return x + scales["a"] * F.gelu(self.up(x))


class DictArgNet(MarkedNet):
    def __init__(self) -> None:
        super().__init__(depth=4, block=DictArgBlock)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, {"a": 0.5})
        return self.head(x)


def test_a_marked_layer_with_a_non_leaf_argument_trains_like_eager():
    _two_steps_equal_eager(DictArgNet, mark=True)
    # The calls reached the backend as regions (one invoke_subgraph per layer, inlined).
    record = next(r for r in COMPILED if r.backward is not None)
    assert any(inline_regions.BODY_NODE in n.meta for n in record.forward.graph.nodes)
