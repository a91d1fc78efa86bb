"""``megacompile plan MODEL --hardware NAME``: will a training step fit, and how fast will it run.

The numbers come from the real megatrain pipeline, not from a formula of the model's shape:

1. **Trace a few layers on the meta device.** The Hugging Face model is built from the
   preset's config with ``num_hidden_layers`` cut to ``k`` (2 by default) under
   ``torch.device("meta")`` (nothing is allocated), and an ordinary training step (forward,
   cross-entropy, backward, AdamW step, zero_grad) is compiled with
   ``torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager"})``
   and called once on meta ``input_ids`` of shape (batch, seq). Dynamo, AOTAutograd and the
   megatrain partitioner run as for a real step; inside the planner, the one joint graph is
   built under each uniform policy the planner's candidates are made of (the same ``build``
   the planner uses: passes, split, rewrite, liveness estimate): *keep*, *keep with the
   parameters resident*, and, unless keeping everything fits at full depth, *offload*,
   *recompute* and four two-policy "pair" plans; compilation stops there: planning needs no
   execution (``test_plan_cmd`` also runs a whole step on meta tensors to show the runtime
   itself works on them).
2. **Check the repeat.** The ``k`` decoder layers must have identical per-layer numbers
   (parameter bytes, saved activation bytes under each policy, FLOPs forward and backward,
   bytes loaded and offloaded, compute time); otherwise the extrapolation is refused.
3. **Extrapolate to the full depth N** (repeated layers are compiled and planned once):
   per-layer quantities x N plus the embedding, final norm and head once (``evaluate``); the
   device peak as explained in ``full_depth_peak``; time with the cost model
   (``cost_model.step_time`` of the traced program plus N-k steady-state layers).
4. **Choose the plan the planner would choose** for N identical layers (``choose_plan``): its
   first rung (parameters resident) or keep everything if that fits, otherwise the fastest
   count of keep / offload / recompute layers whose extrapolated peak fits the budget and
   whose offloaded activations fit the host, the smallest peak among equally fast ones.
   The embedding, final norm, head and loss follow the policy of the layers next to them;
   megatrain's planner can also choose for them alone, so under a tight budget it may find
   a somewhat smaller peak than the smallest plan reported here.

What runs on the meta device differs from a host trace in two places, both bridged here so
that the traced program is exactly the one megatrain compiles for host-resident parameters
(``test_plan_cmd::test_meta_trace_matches_host_trace`` compares them op for op and byte for
byte):
- PyTorch picks the math (O(seq^2) memory) attention kernel for meta tensors, where the
  host trace has ``_scaled_dot_product_flash_attention_for_cpu``; the attention function
  registered here (``ATTN_IMPLEMENTATION``) calls that op directly on meta tensors and is
  Hugging Face's ``sdpa`` otherwise.
- ``F.cross_entropy`` on meta fake tensors loses its autograd (PyTorch's Python meta kernel
  for ``aten::nll_loss`` shadows its CompositeImplicitAutograd kernel), which would leave
  the backward empty; the loss is written as the host trace decomposes it
  (``log_softmax`` + ``nll_loss_forward``).
And megatrain's placement check rejects parameters that are not on the CPU, meta ones
included; while tracing, meta parameters are exempted from it (see ``_meta_placement``).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import inspect
import json
import logging
import math
import re
import sys
import time
import types
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

from megacompile import backend
from megacompile.cli.presets import (
    build_transformers_config,
    count_parameters,
    known_presets,
    load_model_config,
)
from megacompile.core import ops
from megacompile.core import torch_compat as compat
from megacompile.core.errors import OptionsError, PlacementError
from megacompile.core.node_info import has_info, info, layer_of_module_path
from megacompile.core.units import format_bytes, parse_bytes
from megacompile.passes import facts_after
from megacompile.plan import cost_model
from megacompile.plan import flat_planner as planner
from megacompile.plan import memory_estimate as plan_mod
from megacompile.plan.cost_model import COST_KEY, device_flops, roofline_floor
from megacompile.plan.hardware import HardwareProfile, get_profile, known_profiles
from megacompile.plan.memory_estimate import storage_root
from megacompile.plan.training_plan import PlanSpec, TrainingPlan

POLICIES = ("keep", "offload", "recompute")
# The planner's first rung, all or nothing: keep every activation, and keep the parameters both
# passes read on the device for the whole step (loaded once instead of twice). Extrapolated
# like a policy whose saved bytes per layer include the layer's resident parameters.
RESIDENT = "resident"
# Adjacent (earlier, later) layer policies a full-depth plan can have: the planner's solvers
# upgrade the earliest layers first, so keep layers come last.
PAIRS = (("offload", "keep"), ("recompute", "keep"), ("offload", "recompute"), ("recompute", "offload"))
PRECISIONS = ("fp32", "bf16")
DEFAULT_TRACED_LAYERS = 2
ATTN_IMPLEMENTATION = "megatrain_host_sdpa"

# Host bytes per parameter, (pinned, pageable), and what they are.
# fp32: fp32 weights (pinned: streamed to the device) + fp32 gradients (pinned: they land
#   there from the device) | AdamW exp_avg + exp_avg_sq (pageable: only the host optimizer
#   touches them) = 4 + 4 | 8 = 16 B/param.
# bf16: the same fp32 state as the runtime keeps it (passes/host_casts.py): fp32 master weights
#   (cast to bf16 on the host right before each load, into a transient pinned staging copy) +
#   fp32 gradients (widened on the host from the bf16 copy that crosses) + exp_avg + exp_avg_sq,
#   none of them read by a copy engine (pageable) = 4 + 4 + 8 = 16 B/param; the staging copies
#   live a layer or two (``last_report().host_staging_peak_bytes`` measures them).
# Either precision: 12 B/param when the optimizer step overlaps the backward (each gradient
#   consumed as it lands, no gradient buffer kept; ``overlap_optimizer``).
HOST_BYTES_PER_PARAM = {
    "fp32": {"weights": (4, "pinned"), "gradients": (4, "pinned"), "optimizer_states": (8, "pageable")},
    "bf16": {"weights": (4, "pageable"), "gradients": (4, "pageable"), "optimizer_states": (8, "pageable")},
}
OVERLAPPED_HOST_BYTES_PER_PARAM = 12
_DEVICE_PARAM_BYTES = {"fp32": 4, "bf16": 2}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

_DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


class PlanError(ValueError):
    """The model cannot be planned this way (e.g. its decoder layers are not identical)."""


# --- tracing k layers on the meta device ------------------------------------------------------

def _host_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Hugging Face's ``sdpa`` attention, except on meta tensors: there, the op the host trace has.

    On meta tensors ``F.scaled_dot_product_attention`` takes the math path (bmm + softmax:
    the attention matrix is saved for the backward, O(seq^2) bytes). Traced with parameters
    on the host, as megatrain traces a real step, it is
    ``_scaled_dot_product_flash_attention_for_cpu`` (O(seq) saved bytes: the output and the
    log-sum-exp), which is also what the cost model counts. This mirrors what the sdpa
    front end does on the CPU for a training step (no cache, no dropout): grouped KV heads
    repeated (Hugging Face's ``repeat_kv``), a boolean mask made additive, flash kernel.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward  # lazy: optional dependency

    if query.device.type != "meta":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal
    mask = attention_mask
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=mask.device))
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout, is_causal, attn_mask=mask, scale=scaling)[0]
    out = out.reshape(out.shape[0], -1, q_length, value.shape[-1]).transpose(1, 2).contiguous()
    return out, None


def _register_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface  # lazy: optional dependency
    from transformers.masking_utils import sdpa_mask  # lazy: optional dependency

    AttentionInterface.register(ATTN_IMPLEMENTATION, _host_sdpa)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def host_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), labels)`` (mean, ignore_index -100) in the ops the host
    trace decomposes it into; unlike ``F.cross_entropy`` it keeps its gradient on meta tensors."""

    flat = logits.reshape(-1, logits.size(-1)).float()
    return torch.ops.aten.nll_loss_forward(F.log_softmax(flat, -1), labels.reshape(-1), None, 1, -100)[0]


def build_model(config: dict, num_layers: int, precision: str = "fp32", device: str = "meta"):
    """The Hugging Face causal LM of ``config`` with ``num_layers`` decoder layers (on meta: no memory)."""
    from transformers import AutoModelForCausalLM  # lazy: optional dependency

    _register_attention()
    cfg = dict(config)
    cfg["num_hidden_layers"] = int(num_layers)
    cfg["use_cache"] = False
    cfg.pop("layer_types", None)  # sized by the full depth in some config.json files
    hf = build_transformers_config(cfg)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf, attn_implementation=ATTN_IMPLEMENTATION,
                                                 dtype=_DTYPES[precision])
    model.train()
    return model


def make_step(model) -> Callable:
    """An ordinary training step: forward, cross-entropy, backward, AdamW step, zero_grad."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step(input_ids, labels):
        logits = model(input_ids=input_ids).logits
        loss = host_cross_entropy(logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


@contextlib.contextmanager
def _meta_placement():
    """Let meta parameters through megatrain's placement check while tracing.

    ``backend.check_placement`` requires parameters on the CPU (so that ``model.cuda()`` is
    caught) and rejects meta ones too. The core fix is one condition there
    (``value.device.type not in ("cpu", "meta")``); until it lands, meta tensors are filtered
    out before the original check runs. Nothing is patched if the check already accepts them.
    """

    original = backend.check_placement
    probe = torch.nn.Parameter(torch.empty(1, device="meta"))
    try:
        original([probe], ["probe"], ["param"])
        needs_patch = False
    except PlacementError:
        needs_patch = True
    if not needs_patch:
        yield
        return

    def check_placement(example_inputs, names, roles):
        rest = [(v, n, r) for v, n, r in zip(example_inputs, names, roles)
                if not (isinstance(v, torch.Tensor) and v.device.type == "meta")]
        return original([v for v, _, _ in rest], [n for _, n, _ in rest], [r for _, _, r in rest])

    backend.check_placement = check_placement
    try:
        yield
    finally:
        backend.check_placement = original


def _reset_dynamo() -> None:

    reset = getattr(compat, "reset_dynamo", None)
    if reset is not None:
        reset()
    else:
        torch._dynamo.reset()


class _Traced(Exception):
    """Raised from inside the planner once the policies are built: nothing needs to run."""


@contextlib.contextmanager
def _capture_policies(out: dict, extra_plans: dict | None = None, pairs: bool = True,
                      keep_suffices: Callable | None = None):
    """Replace the planner for one compile: build every uniform policy from the one joint graph.

    ``capture.TrainingCompiler.partition`` hands the planner a ``build(plan)`` that runs the
    passes on the joint graph under a plan and estimates the memory of the result. Here it is
    called once per policy the planner's candidates are made of (keep, keep with the
    parameters resident, offload, recompute) and for the ``PAIRS`` plans; the attempts are
    kept in ``out`` and the compile is stopped (``_Traced``): nothing runs. ``extra_plans``:
    name -> per-layer policy dict ({"model.layers.0": "offload", ...}), built too (tests of
    mixed plans).
    ``keep_suffices(attempts, layers)``: when it says True, only keep (and resident) are built:
    the other policies matter only when keeping every activation does not fit.
    """

    original = planner.plan_training

    def plan_all(build, layers, *args, **kwargs):  # (build, layers, options, profile, ...)
        t0 = time.perf_counter()
        try:
            bound = inspect.signature(original).bind(build, layers, *args, **kwargs).arguments
        except TypeError:
            bound = {}
        options = bound.get("options")
        resident = list(bound.get("resident_candidates") or [])
        disabled = set(getattr(options, "disable_passes", ()) or ())
        attempts = {"keep": build(TrainingPlan(PlanSpec(name="keep")))}
        if resident and "resident_loads" in facts_after("joint", disabled) \
                and "parameters_streamed" in facts_after("forward", disabled):
            # The planner's first rung: when everything fits, parameters read by both passes
            # stay on the device for the step (one load per step instead of two).
            attempts[RESIDENT] = build(TrainingPlan(PlanSpec(name="keep (parameters resident)", resident=resident)))
        only_keep = keep_suffices is not None and keep_suffices(attempts, layers)
        for policy in POLICIES[1:] if not only_keep else ():
            attempts[policy] = build(TrainingPlan(PlanSpec(name=policy, default_policy=policy)))
        decoder = [layer for layer in layers if _DECODER_LAYER.search(layer)]
        if pairs and not only_keep and len(decoder) >= 2:
            # The working set of a layer whose predecessor has another policy (its backward
            # prefetches the predecessor's reloads): the first layer under one, the rest under another.
            for prev, cur in PAIRS:
                policy = {decoder[0]: prev, **{layer: cur for layer in decoder[1:]}}
                attempts[f"pair:{prev}>{cur}"] = build(TrainingPlan(PlanSpec(
                    name=f"pair {prev}>{cur}", default_policy=cur, layer_policy=policy)))
        for name, layer_policy in (extra_plans or {}).items():
            attempts[name] = build(TrainingPlan(PlanSpec(name=name, layer_policy=layer_policy)))
        out.update(attempts=attempts, layers=list(layers), build_s=time.perf_counter() - t0)
        raise _Traced()

    planner.plan_training = plan_all
    try:
        yield
    finally:
        planner.plan_training = original


def trace_policies(config: dict, *, num_layers: int, batch: int, seq_len: int, precision: str = "fp32",
                   extra_plans: dict | None = None, keep_suffices: Callable | None = None) -> dict:
    """Compile a training step of ``num_layers`` layers on meta tensors with megatrain, up to the plans.

    Returns ``{"attempts": {policy: planner.Attempt}, "layers": [...], "model": model,
    "trace_s": seconds, "build_s": seconds}``.
    """
    t0 = time.perf_counter()
    model = build_model(config, num_layers, precision)
    step = make_step(model)
    # One compile per probe: the step's code object is the same each time, so without a reset
    # Dynamo would count the probes as recompiles of one frame.
    _reset_dynamo()
    compiled = torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager"})
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    out: dict = {}
    with _meta_placement(), _capture_policies(out, extra_plans=extra_plans, keep_suffices=keep_suffices):
        try:
            compiled(ids, ids)
        except Exception:  # noqa: BLE001  (Dynamo wraps _Traced in BackendCompilerFailed)
            if "attempts" not in out:
                raise
    _reset_dynamo()
    out["model"] = model
    out["trace_s"] = time.perf_counter() - t0
    return out


# --- what one traced program says per layer ------------------------------------------------------

@dataclasses.dataclass
class PolicyNumbers:
    """One uniform policy's traced k-layer program, and what one more layer adds to it."""

    policy: str
    # Memory (bytes). peak: the plan's peak for k layers; early/late: its peak before / after
    # the point where the extra N-k layers are inserted (see full_depth_peak); saved_device:
    # activations one layer keeps on the device from its forward to its backward;
    # saved_host: activations one layer offloads to the host for that time.
    peak: int
    early_peak: int
    late_peak: int
    saved_device: int
    saved_host: int
    # The parts of the peak model (full_depth_peak): a layer's working set when every earlier
    # layer's saved bytes are excluded, and the head's / loss's, both on top of the glue.
    layer_base: int
    head_base: int
    # The same for one policy over all layers, by phase (see _uniform_peak): front_loaded
    # (bytes per layer live from the start of the forward: resident parameters), early_fw,
    # early_bw, layer_fw, layer_bw.
    phases: dict
    # Where each part's peak is: part (early | layers | head) -> (forward | backward, layer, node).
    where: dict
    # The k-layer program: device seconds (forward + backward), busy seconds per lane,
    # FLOPs (executed, and without recompute), bytes each way.
    total: dict
    # What one more layer adds: the same keys. Time is the compute lane's span over a
    # steady-state layer's region of the program (its ops, the untagged ops among them such
    # as gradient accumulation, and its waits), or its copy lane's busy time where that is
    # longer (the link is then the bottleneck).
    per_layer: dict


@dataclasses.dataclass
class Trace:
    """One meta-device trace of k layers at one (batch, seq_len), digested."""

    k: int
    batch: int
    seq_len: int
    precision: str
    policies: dict  # policy -> PolicyNumbers
    pair_base: dict  # (earlier policy, later policy) -> working set of the later layer (see PolicyNumbers)
    param_bytes_by_layer: dict
    layer_checks: dict  # quantity -> per-layer values (identical when the repeat holds)
    host_optimizer: dict  # seconds and bytes of the host AdamW over all N layers' parameters
    trace_s: float
    prediction: Any = None  # cost_model.StepTimePrediction of the traced keep program

    @property
    def complete(self) -> bool:
        """Whether every policy was built (else only keep: it fits, nothing else is needed)."""
        return all(p in self.policies for p in POLICIES)


def _layer_of(node) -> str | None:

    return info(node).layer if has_info(node) else None


def _is_compute(node) -> bool:

    return node.op == "call_function" and has_info(node) and info(node).role == "compute"


def _regions(gm, decoder: list[str]) -> dict[str, tuple[int, int]]:
    """Node index range of each decoder layer's stretch of a program, by position.

    A layer's region runs from its first compute op to the first compute op of the next
    layer (or of the next tagged non-decoder module: the final norm in the forward, the
    embedding in the backward). Ops in between that carry no layer (gradient accumulation of
    the residual stream, for one) belong to the region they sit in.
    """
    nodes = list(gm.graph.nodes)
    firsts: dict[str, int] = {}
    for i, node in enumerate(nodes):
        layer = _layer_of(node)
        if layer in decoder and layer not in firsts and _is_compute(node):
            firsts[layer] = i
    order = sorted(firsts, key=firsts.get)
    if len(order) != len(decoder):
        raise PlanError(f"decoder layers without compute ops in the traced graph: {set(decoder) - set(order)}")
    out = {}
    for j, layer in enumerate(order):
        if j + 1 < len(order):
            stop = firsts[order[j + 1]]
        else:
            stop = next((i for i in range(firsts[layer], len(nodes))
                         if _is_compute(nodes[i]) and _layer_of(nodes[i]) not in (None, *decoder)), len(nodes))
        out[layer] = (firsts[layer], stop)
    return out


def _span(gm, timeline, start: int, stop: int) -> float:
    """Compute-lane seconds from node ``start`` to node ``stop`` of a simulated program."""
    index = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    starts = sorted((index[e.name], e.start_s) for e in timeline.events
                    if e.lane in ("compute", "stall") and e.name in index)
    end = max((e.end_s for e in timeline.events), default=0.0)

    def clock(i: int) -> float:
        return next((t for j, t in starts if j >= i), end)

    return clock(stop) - clock(start)


def _compute_busy(gm, start: int, stop: int) -> float:

    nodes = list(gm.graph.nodes)[start:stop]
    return sum(n.meta[COST_KEY].time_s for n in nodes
               if COST_KEY in n.meta and n.meta[COST_KEY].lane == "compute")


def _curves(attempt) -> tuple[list, list]:
    """(node name, live device bytes) at each node of the forward and the backward, as the plan counts them."""

    fw: list = []
    bw: list = []
    plan_mod.estimate_memory(attempt.forward, keep_outputs_alive=True, curve=fw)
    kwargs = {}
    if "input_storage" in inspect.signature(plan_mod.estimate_memory).parameters:
        kwargs["input_storage"] = plan_mod.storage_roots(attempt.forward)
    plan_mod.estimate_memory(attempt.backward, keep_outputs_alive=False, curve=bw, **kwargs)
    return fw, bw


def _storage_root(node, memo: dict):
    """The node whose storage ``node`` views, as plan.estimate_memory sees it."""

    return storage_root(node, memo)


def _saved_device_bytes_by_layer(attempt) -> dict:
    """Device bytes each layer keeps alive from its forward to its backward.

    Counted by storage: a saved view (``view``, ``_unsafe_view``, ``unsqueeze`` of a matmul
    output) has no bytes of its own but keeps its base alive, so the base's bytes count, once,
    for the layer that produced the base. Values the plan offloads are on the host.
    """

    memo: dict = {}
    roots: dict = {}
    saved = set(attempt.plan.saved_values)
    for node in attempt.forward.graph.nodes:
        if node.name not in saved or not has_info(node) or info(node).decision == "offload":
            continue
        root = _storage_root(node, memo)
        if root.op == "call_function" and has_info(root) and info(root).placement == "device":
            roots[root] = info(root)
    out: dict = {}
    for ni in roots.values():
        key = ni.layer or "(glue)"
        out[key] = out.get(key, 0) + ni.nbytes_hint
    return out


def _resident_bytes_by_layer(attempt) -> dict:
    """Bytes of the parameters each layer keeps resident on the device for the whole step."""

    out: dict = {}
    for node in attempt.forward.graph.nodes:
        if node.op == "call_function" and node.target is ops.load and has_info(node) \
                and info(node).decision == "resident":
            key = info(node).layer or "(glue)"
            out[key] = out.get(key, 0) + info(node).nbytes_hint
    return out


def _sum_by_layer(gm, attr: str, where: Callable | None = None) -> dict:

    out: dict = {}
    for node in gm.graph.nodes:
        c = node.meta.get(COST_KEY)
        if c is None or (where is not None and not where(node, c)):
            continue
        key = _layer_of(node) or "(glue)"
        out[key] = out.get(key, 0) + getattr(c, attr)
    return out


def _peak_parts(fw_curve: list, bw_curve: list, fw_regions: dict, bw_regions: dict, decoder: list) -> dict:
    """The traced program's peak in each part: "early" (embedding and the first layer, forward
    and backward), "layers" (one per later decoder layer: its forward and backward regions),
    "head" (final norm, head and loss, forward and backward). Each a (phase, node, bytes)."""
    fw = [("forward", name, live) for name, live in fw_curve]
    bw = [("backward", name, live) for name, live in bw_curve]
    top = lambda pts: max(pts, key=lambda t: t[2]) if pts else ("forward", "", 0)  # noqa: E731
    f1, b0 = fw_regions[decoder[1]][0], bw_regions[decoder[0]][0]
    f_end, b_start = fw_regions[decoder[-1]][1], bw_regions[decoder[-1]][0]
    layers = [top(fw[slice(*fw_regions[d])] + bw[slice(*bw_regions[d])]) for d in decoder[1:]]
    return {"early": top(fw[:f1] + bw[b0:]), "layers": layers, "head": top(fw[f_end:] + bw[:b_start]),
            "early_fw": top(fw[:f1])[2], "early_bw": top(bw[b0:])[2],
            "layers_fw": [top(fw[slice(*fw_regions[d])])[2] for d in decoder[1:]],
            "layers_bw": [top(bw[slice(*bw_regions[d])])[2] for d in decoder[1:]]}


def _optimizer_landing_seconds(attempt, pred, profile: HardwareProfile, synchronous: bool) -> dict:
    """What the overlapped host optimizer needs to be extrapolated (see
    optimizer_exposed_seconds), from the traced program's backward: whether the runtime
    overlaps it on this hardware (on a GPU, by default); how long after the backward starts the
    first gradient lands; and the tail, how long the worker runs past the backward's end when
    it updates this program's own gradients as they land (the last landings: the embedding,
    the last tensors of the first layer)."""

    if synchronous or pred.backward is None:
        return {"overlapped": False, "first_landing_s": 0.0, "tail_seconds": 0.0}
    rate = profile.estimated_host_adamw_params_per_s()
    backward_start = pred.forward.total_s
    device_end = backward_start + pred.backward.total_s
    landings = cost_model.optimizer_landings(attempt.backward, pred.backward, device_end)
    worker = 0.0
    for landed, numel, _ in landings:
        worker = max(worker, landed) + numel / rate
    return {
        "overlapped": True,
        "first_landing_s": (landings[0][0] - backward_start) if landings else pred.backward.total_s,
        "tail_seconds": max(0.0, worker - device_end),
    }


def _digest(raw: dict, profile: HardwareProfile, *, k: int, batch: int, seq_len: int, precision: str,
            num_params_full: int) -> Trace:

    attempts = raw["attempts"]
    decoder = [layer for layer in raw["layers"] if _DECODER_LAYER.search(layer)]
    if len(decoder) != k:
        raise PlanError(f"expected {k} decoder layers in the traced graph, found {decoder}")
    first, second = decoder[0], decoder[1]
    synchronous = cost_model.is_cpu_standin(profile)
    opt_bytes = num_params_full * _DEVICE_PARAM_BYTES[precision]

    param_bytes_by_layer: dict = {}
    for name, p in raw["model"].named_parameters():
        layer = layer_of_module_path(name.rsplit(".", 1)[0]) if "." in name else None
        key = layer or "(glue)"
        param_bytes_by_layer[key] = param_bytes_by_layer.get(key, 0) + p.numel() * p.element_size()

    checks: dict = {"param_bytes": [param_bytes_by_layer.get(layer, 0) for layer in decoder]}
    policies: dict = {}
    keep_pred = None
    host_optimizer: dict = {}
    for policy in [p for p in (*POLICIES, RESIDENT) if p in attempts]:
        a = attempts[policy]
        pred = cost_model.step_time(a.forward, a.backward, profile, optimizer_param_bytes=opt_bytes,
                                    precision=precision)
        fw_curve, bw_curve = _curves(a)
        fw_regions, bw_regions = _regions(a.forward, decoder), _regions(a.backward, decoder)
        layer_by_name = {n.name: _layer_of(n) for g in (a.forward, a.backward) for n in g.graph.nodes}
        parts = _peak_parts(fw_curve, bw_curve, fw_regions, bw_regions, decoder)
        early_at, late_at = parts["early"], max(parts["layers"] + [parts["head"]], key=lambda t: t[2])
        early, late = early_at[2], late_at[2]
        layers_at = max(parts["layers"], key=lambda t: t[2])
        where = {part: (at[0], layer_by_name.get(at[1]), at[1])
                 for part, at in (("early", early_at), ("layers", layers_at), ("head", parts["head"]))}
        saved_dev = _saved_device_bytes_by_layer(a)
        s_dev = saved_dev.get(first, 0)
        layer_base = max(pt[2] - j * s_dev for j, pt in enumerate(parts["layers"], start=1))
        head_base = parts["head"][2] - k * s_dev
        # Resident parameters are loaded at the start of the forward: every forward point holds
        # all N layers' (f per layer); in the backward they leave with their layer, like saved bytes.
        front = _resident_bytes_by_layer(a).get(first, 0)
        s_act = s_dev - front
        phases = {
            "front_loaded": front,
            "early_fw": parts["early_fw"] - k * front,
            "early_bw": parts["early_bw"],
            "layer_fw": max(v - j * s_act for j, v in enumerate(parts["layers_fw"], start=1)) - k * front,
            "layer_bw": max(v - j * s_dev for j, v in enumerate(parts["layers_bw"], start=1)),
        }
        is_recompute = lambda n, c: has_info(n) and info(n).phase == "recompute"  # noqa: E731
        lane_is = lambda lane: (lambda n, c: c.lane == lane)  # noqa: E731
        by_layer = {
            "saved_device_bytes": saved_dev,
            "saved_host_bytes": _sum_by_layer(a.forward, "bytes_touched", lane_is("d2h")),
            "forward_flops": _sum_by_layer(a.forward, "flops"),
            "backward_flops": _sum_by_layer(a.backward, "flops"),
            "recompute_flops": _sum_by_layer(a.backward, "flops", is_recompute),
            "forward_h2d_bytes": _sum_by_layer(a.forward, "bytes_touched", lane_is("h2d")),
            "backward_h2d_bytes": _sum_by_layer(a.backward, "bytes_touched", lane_is("h2d")),
            "forward_d2h_bytes": _sum_by_layer(a.forward, "bytes_touched", lane_is("d2h")),
            "backward_d2h_bytes": _sum_by_layer(a.backward, "bytes_touched", lane_is("d2h")),
        }
        for name, values in by_layer.items():
            checks[f"{policy}.{name}"] = [values.get(layer, 0) for layer in decoder]
        # Compute time of each layer's own ops (region busy times include the neighbours'
        # untagged ops at the ends only for the first and last traced layer).
        for gname, g in (("forward", a.forward), ("backward", a.backward)):
            busy = _sum_by_layer(g, "time_s", lambda n, c: c.lane == "compute" and _layer_of(n) in decoder)
            checks[f"{policy}.{gname}_compute_seconds"] = [round(busy.get(layer, 0.0), 15) for layer in decoder]

        one = {key: values.get(first, 0) for key, values in by_layer.items()}
        f_busy = _compute_busy(a.forward, *fw_regions[second])
        b_busy = _compute_busy(a.backward, *bw_regions[first])
        h2d_s = (one["forward_h2d_bytes"] + one["backward_h2d_bytes"]) / profile.h2d_bandwidth
        d2h_s = (one["forward_d2h_bytes"] + one["backward_d2h_bytes"]) / profile.d2h_bandwidth
        f_span = _span(a.forward, pred.forward, *fw_regions[second])
        b_span = _span(a.backward, pred.backward, *bw_regions[first])
        if synchronous:
            # Copies run on the compute lane, one after another; a region holds the copies it
            # issues (the next layer's parameters), so count the layer's own copies instead.
            device_s = f_busy + b_busy + h2d_s + d2h_s
            backward_s = b_busy + (one["backward_h2d_bytes"] / profile.h2d_bandwidth
                                   + one["backward_d2h_bytes"] / profile.d2h_bandwidth)
        else:
            f_link = max(one["forward_h2d_bytes"] / profile.h2d_bandwidth,
                         one["forward_d2h_bytes"] / profile.d2h_bandwidth)
            b_link = max(one["backward_h2d_bytes"] / profile.h2d_bandwidth,
                         one["backward_d2h_bytes"] / profile.d2h_bandwidth)
            device_s = max(f_span, f_link) + max(b_span, b_link)
            backward_s = max(b_span, b_link)
        flops = one["forward_flops"] + one["backward_flops"]
        per_layer = {
            "device_s": device_s, "backward_s": backward_s,
            "lanes_s": {"compute": f_busy + b_busy, "h2d": h2d_s, "d2h": d2h_s},
            "flops": flops, "model_flops": flops - one["recompute_flops"],
            "h2d_bytes": one["forward_h2d_bytes"] + one["backward_h2d_bytes"],
            "d2h_bytes": one["forward_d2h_bytes"] + one["backward_d2h_bytes"],
            **{key: one[key] for key in ("forward_h2d_bytes", "backward_h2d_bytes", "forward_d2h_bytes",
                                         "backward_d2h_bytes")},
        }
        total = {
            "device_s": pred.total_s - pred.host_optimizer_s,
            "backward_s": pred.backward.total_s if pred.backward is not None else 0.0,
            "lanes_s": {"compute": pred.compute_s, "h2d": pred.h2d_s, "d2h": pred.d2h_s},
            "flops": pred.flops, "model_flops": pred.model_flops,
            "h2d_bytes": pred.h2d_bytes, "d2h_bytes": pred.d2h_bytes,
            "forward_h2d_bytes": pred.forward.h2d_bytes, "backward_h2d_bytes": pred.backward.h2d_bytes,
            "forward_d2h_bytes": pred.forward.d2h_bytes, "backward_d2h_bytes": pred.backward.d2h_bytes,
        }
        policies[policy] = PolicyNumbers(
            policy=policy, peak=a.plan.peak_bytes, early_peak=early, late_peak=late,
            layer_base=layer_base, head_base=head_base, phases=phases,
            where=where,
            saved_device=saved_dev.get(first, 0), saved_host=one["saved_host_bytes"] if policy == "offload" else 0,
            total=total, per_layer=per_layer,
        )
        if policy == "keep":
            keep_pred = pred
            host_optimizer = {"seconds": pred.host_optimizer_s, "bytes": pred.host_optimizer_bytes,
                              "params": pred.optimizer_params,
                              **_optimizer_landing_seconds(a, pred, profile, synchronous)}
    # Working set of a layer after one with another policy (its backward prefetches the
    # predecessor's reloads): the second traced layer of a "pair" plan, less the first's saved bytes.
    pair_base: dict = {}
    for prev, cur in PAIRS:
        a = attempts.get(f"pair:{prev}>{cur}")
        if a is None:
            continue
        fw_curve, bw_curve = _curves(a)
        parts = _peak_parts(fw_curve, bw_curve, _regions(a.forward, decoder), _regions(a.backward, decoder), decoder)
        pair_base[(prev, cur)] = parts["layers"][0][2] - policies[prev].saved_device
    return Trace(k=k, batch=batch, seq_len=seq_len, precision=precision, policies=policies, pair_base=pair_base,
                 param_bytes_by_layer=param_bytes_by_layer, layer_checks=checks, host_optimizer=host_optimizer,
                 trace_s=raw["trace_s"], prediction=keep_pred)


def check_repeat(trace: Trace, rel_tol: float = 1e-9) -> list[str]:
    """The quantities in which the traced decoder layers differ (empty: they repeat)."""
    differ = []
    for name, values in trace.layer_checks.items():
        lo, hi = min(values), max(values)
        if hi - lo > rel_tol * max(abs(hi), 1):
            differ.append(f"{name} {values}")
    return differ


def _uniform_peak_at_depth(attempt, layers: list, num_layers: int) -> int:
    """full_depth_peak of one uniform plan, straight from its attempt (no cost model)."""
    decoder = [layer for layer in layers if _DECODER_LAYER.search(layer)]
    fw_curve, bw_curve = _curves(attempt)
    parts = _peak_parts(fw_curve, bw_curve, _regions(attempt.forward, decoder), _regions(attempt.backward, decoder),
                        decoder)
    s = _saved_device_bytes_by_layer(attempt).get(decoder[0], 0)
    layer_base = max(pt[2] - j * s for j, pt in enumerate(parts["layers"], start=1))
    return max(parts["early"][2], layer_base + (num_layers - 1) * s,
               parts["head"][2] - len(decoder) * s + num_layers * s)


_TRACE_CACHE: "collections.OrderedDict[tuple, Trace]" = collections.OrderedDict()
_TRACE_CACHE_SIZE = 16


def trace_model(config: dict, profile: HardwareProfile, *, batch: int, seq_len: int, precision: str = "fp32",
                k: int = DEFAULT_TRACED_LAYERS, skip_if_keep_fits: int | None = None) -> Trace:
    """Trace k layers on the meta device and digest the policies' programs.

    ``skip_if_keep_fits``: a device budget; if keeping every activation of all the model's
    layers fits it, only the keep plan is built (``Trace.complete`` is then False).
    The last few traces are cached in the process (a search's probes, planned again).
    """
    key = (json.dumps(config, sort_keys=True, default=str), profile, batch, seq_len, precision, k)
    cached = _TRACE_CACHE.get(key)
    if cached is not None:
        # A keep-only trace serves only budgets that keep fits.
        usable = cached.complete or skip_if_keep_fits is not None and evaluate(
            cached, {"keep": int(config["num_hidden_layers"])}).peak_bytes <= skip_if_keep_fits
        if usable:
            _TRACE_CACHE.move_to_end(key)
            return cached
    trace = _trace_model(config, profile, batch=batch, seq_len=seq_len, precision=precision, k=k,
                         skip_if_keep_fits=skip_if_keep_fits)
    _TRACE_CACHE[key] = trace
    while len(_TRACE_CACHE) > _TRACE_CACHE_SIZE:
        _TRACE_CACHE.popitem(last=False)
    return trace


def _trace_model(config: dict, profile: HardwareProfile, *, batch: int, seq_len: int, precision: str,
                 k: int, skip_if_keep_fits: int | None) -> Trace:
    if k < 2:
        raise ValueError("at least 2 traced layers are needed to check that the layers repeat")
    num_layers = int(config["num_hidden_layers"])
    keep_suffices = None
    if skip_if_keep_fits is not None:
        keep_suffices = lambda attempts, layers: (  # noqa: E731
            _uniform_peak_at_depth(attempts["keep"], layers, num_layers) <= skip_if_keep_fits)
    raw = trace_policies(config, num_layers=k, batch=batch, seq_len=seq_len, precision=precision,
                         keep_suffices=keep_suffices)
    trace = _digest(raw, profile, k=k, batch=batch, seq_len=seq_len, precision=precision,
                    num_params_full=count_parameters(config))
    differ = check_repeat(trace)
    if differ:
        raise PlanError("the traced decoder layers are not identical, so their numbers cannot be "
                        "extrapolated to the full depth: " + "; ".join(differ))
    return trace


# --- full depth --------------------------------------------------------------------------------

@dataclasses.dataclass
class DepthPlan:
    """A keep / offload / recompute count over N identical layers, evaluated at full depth."""

    counts: dict
    peak_bytes: int
    device_s: float
    lanes_s: dict
    flops: int
    model_flops: int
    h2d_bytes: int
    d2h_bytes: int
    offloaded_activation_bytes: int
    peak_region: str  # "early" (embedding, first layer), "layers" (a later layer) or "head" (head and loss)
    bytes_by_direction: dict = dataclasses.field(default_factory=dict)  # forward/backward h2d/d2h
    base_policy: str = "keep"  # the traced program the additive quantities extend
    # The host optimizer's time the step waits for after the device work: all of it when it
    # runs after the backward, the part the backward does not hide when it overlaps.
    optimizer_exposed_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.device_s + self.optimizer_exposed_s

    @property
    def summary(self) -> str:
        used = [f"{p} {n}" for p, n in self.counts.items() if n]
        if self.counts.get(RESIDENT):
            return f"keep all {self.counts[RESIDENT]} layers, parameters resident (loaded once per step)"
        if len(used) == 1:
            return f"{used[0].split()[0]} all {sum(self.counts.values())} layers"
        return "per-layer (" + ", ".join(used) + ")"


def _uniform_peak(numbers, k: int, n: int) -> tuple[float, str]:
    """Peak of n layers under one policy, phase by phase (see full_depth_peak)."""
    ph = numbers.phases
    f, s = ph["front_loaded"], numbers.saved_device
    candidates = [
        (ph["early_fw"] + n * f, "early"), (ph["early_bw"], "early"),
        (numbers.head_base + n * s, "head"),
    ]
    if n >= 2:
        candidates += [(ph["layer_fw"] + n * f + (n - 1) * (s - f), "layers"), (ph["layer_bw"] + (n - 1) * s, "layers")]
    return max(candidates, key=lambda c: c[0])


def _ordered_peak(trace, runs: list) -> tuple[float, str]:
    """Peak of N layers in forward order ``runs`` = [(policy, count), ...] (see full_depth_peak)."""
    pol = trace.policies
    if len(runs) == 1 and getattr(pol[runs[0][0]], "phases", None):
        return _uniform_peak(pol[runs[0][0]], trace.k, runs[0][1])
    peak, region = pol[runs[0][0]].early_peak, "early"
    saved = 0  # saved device bytes of the layers before the current one
    prev = None
    for p, n in runs:
        s = pol[p].saved_device
        candidates = []
        if prev is None:
            if n >= 2:
                candidates.append(pol[p].layer_base + (n - 1) * s)
        else:
            candidates.append(trace.pair_base.get((prev, p), pol[p].layer_base) + saved)
            if n >= 2:
                candidates.append(pol[p].layer_base + saved + (n - 1) * s)
        saved += n * s
        for c in candidates:
            if c > peak:
                peak, region = c, "layers"
        prev = p
    head = pol[runs[-1][0]].head_base + saved
    if head > peak:
        peak, region = head, "head"
    return peak, region


def full_depth_peak(trace: Trace, counts: dict) -> tuple[int, str]:
    """The device peak of N = sum(counts) layers, from the traced k-layer plans.

    A layer's saved activations stay on the device from its forward to its backward (keep:
    all it saves; recompute: its input only; offload: none), so while layer j runs, forward
    or backward, the device holds the saved bytes of every earlier layer besides its own
    working set; at the head and the loss it holds every layer's. With s_p the saved bytes of
    a layer under policy p, W_p a layer's working set and H_p the head's (both on top of the
    embedding, mask and other glue, and both measured on the traced plan: W_p = peak while
    traced layer j runs - j * s_p, H_p = peak at the head - k * s_p), N layers in order
    p_1 .. p_N peak at

        max( early_{p_1},  max_j (W_{p_j} + sum_{i<j} s_{p_i}),  H_{p_N} + sum_i s_{p_i} )

    where early is the traced plan's peak over the embedding and the first layer. For one
    policy p this is the planner's peak for k layers plus (N-k) x s_p:
    max(early_k, late_k + (N - k) * s_p). Mixed plans put the upgraded layers first (the
    planner's solvers upgrade the earliest layers first) and keep layers last; a layer after
    one of another policy has the working set measured on a two-policy "pair" plan (its
    backward prefetches its predecessor's reloads), and both orders of offload and
    recompute are tried, the larger peak taken. ``test_plan_cmd`` checks k=2 extrapolations
    against real k=4 plans, uniform and mixed. A uniform plan is evaluated phase by phase,
    which also covers resident parameters: they are all loaded at the start of the forward
    (every forward point holds N layers' worth) and leave in the backward with their layer.
    Returns (bytes, where: early | layers | head).
    """
    used = [p for p in ("offload", "recompute") if counts.get(p)]
    orders = [used, used[::-1]] if len(used) == 2 else [used]
    best = None
    for order in orders:
        runs = [(p, counts[p]) for p in (*order, "keep", RESIDENT) if counts.get(p)]
        found = _ordered_peak(trace, runs)
        if best is None or found[0] > best[0]:
            best = found
    return int(best[0]), best[1]


def evaluate(trace: Trace, counts: dict) -> DepthPlan:
    """Peak, time, FLOPs and bytes of N = sum(counts) layers (policy -> number of layers).

    Every additive quantity X (device seconds, lane seconds, FLOPs, bytes) is a traced k-layer
    program's X plus what each other layer adds: X(N) = X_k(base) + sum_p (n_p - k [p == base]) * x_p.
    The base is the uniform policy's own program for a uniform plan, else the keep program:
    the one-off costs around the layers (exposed copies next to the embedding and the head)
    are those of keep layers there, for the layers next to the head are kept (checked against
    real mixed k=4 programs: exact, where another base is off by up to 1.4%).
    """
    peak, region = full_depth_peak(trace, counts)
    pol = trace.policies
    used = [p for p, n in counts.items() if n]
    base = used[0] if len(used) == 1 else "keep"
    extra = {p: n - (trace.k if p == base else 0) for p, n in counts.items() if n or p == base}

    def total(key: str) -> float:
        return pol[base].total[key] + sum(n * pol[p].per_layer[key] for p, n in extra.items())

    lanes = {lane: max(0.0, pol[base].total["lanes_s"][lane]
                       + sum(n * pol[p].per_layer["lanes_s"][lane] for p, n in extra.items()))
             for lane in ("compute", "h2d", "d2h")}
    lanes["host_optimizer"] = trace.host_optimizer["seconds"]
    return DepthPlan(
        optimizer_exposed_s=optimizer_exposed_seconds(trace.host_optimizer, total("backward_s")),
        counts=dict(counts), peak_bytes=peak, device_s=max(0.0, total("device_s")), lanes_s=lanes,
        flops=int(total("flops")), model_flops=int(total("model_flops")),
        h2d_bytes=int(total("h2d_bytes")), d2h_bytes=int(total("d2h_bytes")),
        offloaded_activation_bytes=sum(n * pol[p].saved_host for p, n in counts.items() if n),
        peak_region=region,
        bytes_by_direction={key: int(total(key)) for key in ("forward_h2d_bytes", "backward_h2d_bytes",
                                                              "forward_d2h_bytes", "backward_d2h_bytes")},
        base_policy=base,
    )


def optimizer_exposed_seconds(host_optimizer: dict, backward_s: float) -> float:
    """The host optimizer's time not hidden by the device work, at full depth.

    After the backward (synchronous): all of it. Overlapped (megacompile/optimizer/overlap.py): one worker
    updates each gradient once it lands. Where it keeps up with the landings, what is left at
    the backward's end is the traced program's tail (the last landings), whatever the depth;
    where it falls behind, it is busy from the first landing on and the backward hides only
    what follows that landing. The overlapped ``cost_model.step_time`` of a real program checks
    both (tests/test_plan_cmd.py)."""
    total = host_optimizer["seconds"]
    if not host_optimizer.get("overlapped"):
        return total
    hidden_by = max(0.0, backward_s - host_optimizer["first_landing_s"])
    return min(total, max(host_optimizer["tail_seconds"], total - hidden_by))


def _all_counts(num_layers: int, policies=POLICIES):
    if set(policies) >= set(POLICIES):
        for off in range(num_layers + 1):
            for rec in range(num_layers + 1 - off):
                yield {"keep": num_layers - off - rec, "offload": off, "recompute": rec}
    else:
        yield {"keep": num_layers, "offload": 0, "recompute": 0}


def host_bytes(num_params: int, precision: str, offloaded_activation_bytes: int = 0) -> dict:
    """Host memory of the training state, split into what the runtime pins and what it does not.

    Pinned: the weights the device streams in and the gradient buffers it streams back into
    (and the host copies of offloaded activations). Pageable: what no copy engine reads
    (AdamW's two moments; in bf16 the fp32 weights and gradients too, since the bf16 copies
    that cross are transient staging). See
    ``HOST_BYTES_PER_PARAM`` for the bytes per parameter.
    """
    parts = {name: (num_params * nbytes, kind) for name, (nbytes, kind) in HOST_BYTES_PER_PARAM[precision].items()}
    if offloaded_activation_bytes:
        parts["offloaded_activations"] = (int(offloaded_activation_bytes), "pinned")
    pinned = sum(n for n, kind in parts.values() if kind == "pinned")
    pageable = sum(n for n, kind in parts.values() if kind == "pageable")
    return {
        "parts": {name: n for name, (n, _) in parts.items()},
        "pinned_bytes": pinned, "pageable_bytes": pageable, "total_bytes": pinned + pageable,
        "bytes_per_param": sum(nbytes for nbytes, _ in HOST_BYTES_PER_PARAM[precision].values()),
        "overlapped_bytes_per_param": OVERLAPPED_HOST_BYTES_PER_PARAM,
    }


def choose_plan(trace, num_layers: int, *, budget: int, host_free: int | None) -> tuple:
    """The plan megatrain's planner would pick for N identical layers, and the smallest plan.

    The planner's order: keep every activation with the parameters resident, if that fits;
    else keep every activation (parameters streamed); otherwise the fastest (predicted step
    time) count of keep / offload / recompute layers whose extrapolated peak fits ``budget``
    and whose offloaded activations fit ``host_free`` host bytes, with the largest peak (the
    least offload / recompute) among equally fast ones, as the planner's ladder breaks ties.
    Returns (chosen or None, the plan with the smallest peak among those the host can hold
    or None when not every policy was planned, the keep plan).
    """
    def host_ok(plan: DepthPlan) -> bool:
        return host_free is None or plan.offloaded_activation_bytes <= host_free

    keep = evaluate(trace, {"keep": num_layers, "offload": 0, "recompute": 0})
    smallest = None
    fitting = []
    for counts in _all_counts(num_layers, trace.policies) if trace.complete else ():
        plan = evaluate(trace, counts)
        if not host_ok(plan):
            continue
        if smallest is None or plan.peak_bytes < smallest.peak_bytes:
            smallest = plan
        if plan.peak_bytes <= budget:
            fitting.append(plan)
    if RESIDENT in trace.policies:
        resident = evaluate(trace, {RESIDENT: num_layers})
        if resident.peak_bytes <= budget:
            return resident, smallest, keep
    if keep.peak_bytes <= budget:
        return keep, smallest, keep
    if not fitting:
        return None, smallest, keep
    # The fastest; among plans as fast (within 0.1%: keep and offload layers often cost the same
    # when the link hides the copies), the least aggressive one (largest peak, fewest
    # recomputed layers), as the planner's ladder breaks ties: no offload that buys nothing.
    fastest = min(p.step_s for p in fitting)
    best = min((p for p in fitting if p.step_s <= fastest * 1.001),
               key=lambda p: (-p.peak_bytes, p.counts["recompute"], p.step_s))
    return best, smallest, keep


def _min_peak(trace, num_layers: int, host_free: int | None) -> int:
    """The smallest extrapolated peak of any keep / offload / recompute count (memory only)."""
    best = None
    pol = trace.policies
    for counts in _all_counts(num_layers, trace.policies):
        if host_free is not None and sum(n * pol[p].saved_host for p, n in counts.items() if n) > host_free:
            continue
        peak, _ = full_depth_peak(trace, counts)
        best = peak if best is None else min(best, peak)
    return best if best is not None else math.inf


def _interpolated(traces: dict, x: float):
    """Per-policy memory numbers at ``x``, interpolated (Lagrange) through the probes in ``traces``.

    Activation sizes are polynomials of degree <= 2 in the sequence length (the attention mask
    is seq x seq) and of degree 1 in the batch, and so are the peaks as long as they stay at
    the same op; three probes pin a quadratic down.
    """

    xs = sorted(traces)

    def lagrange(values: list[float]) -> float:
        total = 0.0
        for i, xi in enumerate(xs):
            term = values[i]
            for j, xj in enumerate(xs):
                if j != i:
                    term *= (x - xj) / (xi - xj)
            total += term
        return total

    any_trace = traces[xs[0]]
    policies = {}
    for p in POLICIES:
        fields = {}
        for name in ("early_peak", "layer_base", "head_base", "saved_device", "saved_host"):
            fields[name] = lagrange([float(getattr(traces[xi].policies[p], name)) for xi in xs])
        policies[p] = types.SimpleNamespace(**fields)
    pair_base = {pair: lagrange([float(traces[xi].pair_base[pair]) for xi in xs])
                 for pair in any_trace.pair_base if all(pair in traces[xi].pair_base for xi in xs)}
    return types.SimpleNamespace(k=any_trace.k, policies=policies, pair_base=pair_base)


@dataclasses.dataclass
class SearchResult:
    axis: str  # seq_len | batch
    value: int | None  # the largest value that fits (None: not even the smallest)
    how: str  # "bracketed by probes" | "probe fits; next step predicted not to" | ...
    probes: dict  # value -> fits (each a real k-layer plan on the meta device)
    step: int


def search_largest(axis: str, fits_at: Callable[[int], bool], traces: dict, *, start: int, step: int,
                   lo_limit: int, hi_limit: int, predict_fits: Callable[[Any], bool],
                   max_probes: int = 5) -> SearchResult:
    """The largest value of ``axis`` (on a grid of ``step``) at which the plan fits.

    ``fits_at(x)`` plans k layers at x on the meta device (a probe, cached in ``traces``);
    ``predict_fits(model)`` judges an interpolated memory model. Probes: the start, two more
    a factor 2 and 4 away (down if the start does not fit, up if it does), then the value the
    quadratic through the three nearest probes predicts, checked with one probe; if that
    probe disagrees, it joins the probes and the search repeats (bisection of the bracket
    when the prediction falls outside it), at most ``max_probes`` times.
    """
    def grid(x: float) -> int:
        return int(max(lo_limit, min(hi_limit, (int(x) // step) * step)))

    known: dict[int, bool] = {start: fits_at(start)}
    first = [grid(start * 2), grid(start * 4)] if known[start] else [grid(start // 2), grid(start // 4)]
    for x in first:
        if x not in known:
            known[x] = fits_at(x)

    def bracket():
        lo = max((x for x, ok in known.items() if ok), default=None)
        hi = min((x for x, ok in known.items() if not ok), default=None)
        return lo, hi

    def model_at(x: int):
        near = sorted(traces, key=lambda xi: (abs(xi - x), xi))[:3]
        return _interpolated({xi: traces[xi] for xi in near}, x)

    def predicted_largest(a: int, b: int) -> int | None:
        """The largest grid value in (a, b) the model says fits (None if none), by bisection."""
        if b - a <= step or not predict_fits(model_at(a + step)):
            return None
        good, bad = a + step, b
        while bad - good > step:
            mid = good + ((bad - good) // (2 * step)) * step
            mid = mid if mid > good else good + step
            if predict_fits(model_at(mid)):
                good = mid
            else:
                bad = mid
        return good

    for _ in range(max_probes):
        lo, hi = bracket()
        if lo is not None and ((hi is not None and hi - lo <= step) or lo >= hi_limit):
            return SearchResult(axis, lo, "bracketed by probes", known, step)
        if lo is None and lo_limit in known:
            return SearchResult(axis, None, f"does not fit even at {axis} {lo_limit}", known, step)
        a = lo if lo is not None else lo_limit - step
        b = hi if hi is not None else hi_limit + step
        guess = predicted_largest(a, b)
        if guess is None:
            if lo is None:
                guess = lo_limit
            else:  # the model agrees that the largest fitting probe is the answer
                return SearchResult(axis, lo, f"a probe at {lo} fits; {lo + step} is predicted not to", known, step)
        if guess in known:
            guess = a + max(1, (b - a) // (2 * step)) * step  # bisect the bracket instead
        known[guess] = fits_at(guess)
        if known[guess] and guess + step not in known and (
                guess >= hi_limit or not predict_fits(model_at(grid(guess + step)))):
            return SearchResult(axis, guess, f"a probe at {guess} fits; {guess + step} is predicted not to",
                                known, step)
    lo, hi = bracket()
    how = "bracketed by probes" if lo is not None and hi is not None and hi - lo <= step \
        else "probe budget used up: the largest probe that fits"
    return SearchResult(axis, lo, how, known, step)


# --- the whole plan ------------------------------------------------------------------------------

@dataclasses.dataclass
class PlanResult:
    """Everything ``megacompile plan`` reports; ``to_dict()`` is the ``--json`` object."""

    model: dict
    hardware: dict
    step: dict
    fits: bool
    device: dict
    host: dict
    transfers: dict
    time: dict
    problems: list
    suggestions: list
    max_seq_len: dict | None
    method: dict
    depth_plan: DepthPlan | None = dataclasses.field(default=None, repr=False)
    trace: Trace | None = dataclasses.field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("depth_plan", "trace")}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default)

    def to_text(self) -> str:
        return format_text(self.to_dict())


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _where(at: tuple) -> str:
    phase, layer, node = at
    return f"{phase} of {layer or 'the loss'} (node {node})"


def plan_model(config: dict, profile: HardwareProfile, *, batch: int, seq_len: int, precision: str = "fp32",
               budget: int | None = None, host_memory: int | None = None, k: int = DEFAULT_TRACED_LAYERS,
               max_seq_len: bool = False, search: bool = True, seq_multiple: int = 128, max_probes: int = 5,
               model_name: str | None = None) -> PlanResult:
    """Plan one training step of the model ``config`` on ``profile`` (see the module docstring).

    ``budget``: device bytes (default: the profile's HBM); ``host_memory``: host bytes
    (default: the profile's host memory; None there means unknown, not checked).
    ``max_seq_len``: also find the largest sequence length that fits. ``search``: when the
    step does not fit the device, find the largest batch / sequence length that does.
    ``seq_multiple``: the grid of sequence lengths searched.
    """
    t_start = time.perf_counter()
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be >= 1, got batch={batch}, seq_len={seq_len}")
    num_layers = int(config.get("num_hidden_layers") or 0)
    if num_layers < 2:
        raise PlanError(f"the model has {num_layers} decoder layer(s); plan needs at least 2")
    k = min(k, num_layers)
    budget = int(budget if budget is not None else profile.hbm_bytes)
    host_memory = host_memory if host_memory is not None else profile.host_memory_bytes
    num_params = count_parameters(config)
    static_host = host_bytes(num_params, precision)
    host_free = None if host_memory is None else max(0, host_memory - static_host["total_bytes"])

    traces: dict = {}  # (batch, seq_len) -> Trace

    def trace_at(b: int, s: int, complete: bool = True) -> Trace:
        if (b, s) not in traces or (complete and not traces[(b, s)].complete):
            traces[(b, s)] = trace_model(config, profile, batch=b, seq_len=s, precision=precision, k=k,
                                         skip_if_keep_fits=None if complete else budget)
        return traces[(b, s)]

    # When keeping every activation fits, the other policies are not built (unless a search
    # of the sequence length needs them).
    trace = trace_at(batch, seq_len, complete=max_seq_len)
    traced_params = sum(trace.param_bytes_by_layer.values()) // _DEVICE_PARAM_BYTES[precision]
    expected = count_parameters({**config, "num_hidden_layers": k})
    if traced_params != expected:
        raise PlanError(f"the traced {k}-layer model has {traced_params} parameters, but counting from the "
                        f"config gives {expected}: the config and the built model disagree")

    chosen, smallest, keep = choose_plan(trace, num_layers, budget=budget, host_free=host_free)
    shown = chosen or smallest or keep
    device_fits = chosen is not None
    host = host_bytes(num_params, precision, shown.offloaded_activation_bytes)
    host_fits = host_memory is None or host["total_bytes"] <= host_memory
    pol = trace.policies

    def fits_memory(model) -> bool:
        return _min_peak(model, num_layers, host_free) <= budget

    searches: dict = {}

    def search_axis(axis: str) -> SearchResult:
        if axis == "seq_len":
            probe_traces = {s: t for (b, s), t in traces.items() if b == batch}

            def fits_at(s: int) -> bool:
                probe_traces[s] = trace_at(batch, s)
                return fits_memory(probe_traces[s])

            step = max(1, min(seq_multiple, seq_len))
            return search_largest("seq_len", fits_at, probe_traces, start=seq_len, step=step, lo_limit=step,
                                  hi_limit=max(seq_len, 1 << 21), predict_fits=fits_memory, max_probes=max_probes)
        probe_traces = {b: t for (b, s), t in traces.items() if s == seq_len}

        def fits_at(b: int) -> bool:
            probe_traces[b] = trace_at(b, seq_len)
            return fits_memory(probe_traces[b])

        return search_largest("batch", fits_at, probe_traces, start=batch, step=1, lo_limit=1,
                              hi_limit=max(batch, 1 << 16), predict_fits=fits_memory, max_probes=max_probes)

    problems: list = []
    suggestions: list = []
    if not device_fits:
        need = smallest.peak_bytes if smallest is not None else None
        problems.append({
            "resource": "device memory", "needed_bytes": need, "available_bytes": budget,
            "short_by_bytes": None if need is None else need - budget,
            "message": (f"device memory runs out: the smallest plan ({smallest.summary}) needs "
                        f"{format_bytes(need)}, the budget is {format_bytes(budget)} "
                        f"(short by {format_bytes(need - budget)})") if smallest is not None else
                       "device memory runs out: no plan fits while its offloaded activations fit the host",
        })
        if need is not None:
            over_hbm = need > profile.hbm_bytes
            suggestions.append({
                "change": "budget", "value": need,
                "message": f"a device budget of at least {format_bytes(need)} ({need} bytes)"
                           + (f", more than the {profile.name}'s {format_bytes(profile.hbm_bytes)}"
                              if over_hbm else ""),
            })
        if search:
            if batch > 1:
                searches["batch"] = search_axis("batch")
                r = searches["batch"]
                suggestions.append({"change": "batch", "value": r.value,
                                    "message": (f"batch {r.value} (at seq_len {seq_len})" if r.value
                                                else f"no batch fits at seq_len {seq_len}")})
            searches["seq_len"] = search_axis("seq_len")
            r = searches["seq_len"]
            suggestions.append({"change": "seq_len", "value": r.value,
                                "message": (f"seq_len {r.value} (at batch {batch})" if r.value
                                            else f"no sequence length fits at batch {batch}")})
    if not host_fits:
        problems.append({
            "resource": "host memory", "needed_bytes": host["total_bytes"], "available_bytes": host_memory,
            "short_by_bytes": host["total_bytes"] - host_memory,
            "message": (f"host memory runs out: parameters, gradients and optimizer state "
                        f"({host['bytes_per_param']} B/param x {num_params:,})"
                        + (" and offloaded activations" if shown.offloaded_activation_bytes else "")
                        + f" need {format_bytes(host['total_bytes'])}, the host has {format_bytes(host_memory)} "
                        f"(short by {format_bytes(host['total_bytes'] - host_memory)})"),
        })
        suggestions.append({"change": "host_memory", "value": host["total_bytes"],
                            "message": f"a host with at least {format_bytes(host['total_bytes'])} of memory "
                                       f"(--host-memory {host['total_bytes']})"})
    max_seq = None
    if max_seq_len:
        r = searches.get("seq_len") or search_axis("seq_len")
        searches["seq_len"] = r
        max_seq = {"value": r.value, "batch": batch, "grid": r.step, "how": r.how,
                   "probes": {str(x): ok for x, ok in sorted(r.probes.items())}}
        if r.value is not None and r.value > int(config.get("max_position_embeddings") or r.value):
            max_seq["note"] = (f"above the model's max_position_embeddings "
                               f"({config['max_position_embeddings']})")

    # Time, bytes and FLOPs of the plan shown.

    plan = shown
    step_s = plan.step_s
    lanes = dict(plan.lanes_s)
    bottleneck = max(lanes, key=lambda lane: lanes[lane])
    tokens = batch * seq_len
    directions = plan.bytes_by_direction
    activations_in = activations_out = 0
    if plan.counts.get("offload"):
        activations_in = plan.counts["offload"] * max(
            0, pol["offload"].per_layer["backward_h2d_bytes"] - pol["keep"].per_layer["backward_h2d_bytes"])
        activations_out = plan.counts["offload"] * pol["offload"].per_layer["forward_d2h_bytes"]
    order = [p for p in ("offload", "recompute", "keep", RESIDENT) if plan.counts.get(p)]
    part_policy = {"early": order[0], "head": order[-1],
                   "layers": "keep" if plan.counts.get("keep", 0) > 1 else order[-1]}
    at = pol[part_policy[plan.peak_region]].where[plan.peak_region]
    base = pol[plan.base_policy]
    timings = {"total_s": time.perf_counter() - t_start,
               "trace_s": [round(t.trace_s, 3) for t in traces.values()]}
    return PlanResult(
        model={"name": model_name, "model_type": config.get("model_type"), "parameters": num_params,
               "layers": num_layers, "hidden_size": config.get("hidden_size"),
               "intermediate_size": config.get("intermediate_size"), "vocab_size": config.get("vocab_size")},
        hardware={"name": profile.name, "description": profile.description, "hbm_bytes": profile.hbm_bytes,
                  "host_memory_bytes": profile.host_memory_bytes},
        step={"batch": batch, "seq_len": seq_len, "tokens": tokens, "precision": precision},
        fits=device_fits and host_fits,
        device={
            "fits": device_fits, "budget_bytes": budget, "peak_bytes": plan.peak_bytes,
            "plan": plan.summary, "layer_policy_counts": plan.counts,
            "peak_at": {"early": "embedding / first layer: ", "layers": "a decoder layer (the last of its policy): ",
                        "head": "head and loss: "}[plan.peak_region] + _where(at),
            "keep_all_peak_bytes": keep.peak_bytes,
            "smallest_peak_bytes": smallest.peak_bytes if smallest is not None and trace.complete else None,
            "extrapolation": {
                "traced_layers": trace.k, "traced_plan": plan.base_policy,
                "traced_peak_bytes": base.peak,
                "saved_device_bytes_per_layer": {p: n.saved_device for p, n in pol.items()},
                "formula": "one policy: peak(N) = max(early_k, late_k + (N - k) * saved_device_per_layer);"
                           " mixed plans (upgraded layers first, kept layers last): the largest of each layer's"
                           " working set plus the saved device bytes of the layers before it, and the head's"
                           " plus all layers' (plan_cmd.full_depth_peak)",
            },
        },
        host={
            "fits": host_fits, "capacity_bytes": host_memory, "total_bytes": host["total_bytes"],
            "pinned_bytes": host["pinned_bytes"], "pageable_bytes": host["pageable_bytes"],
            "parts_bytes": host["parts"], "bytes_per_param": host["bytes_per_param"],
            "overlapped_bytes_per_param": host["overlapped_bytes_per_param"],
            "layout": {
                "fp32": "pinned: fp32 weights (4 B) + fp32 gradients (4 B); pageable: AdamW exp_avg + exp_avg_sq (8 B)",
                "bf16": "pageable: fp32 master weights (4 B) + fp32 gradients (4 B) + AdamW exp_avg + exp_avg_sq "
                        "(8 B); the bf16 copies that cross the link are transient pinned staging",
            }[precision] + ("; plus offloaded activations (pinned)" if plan.offloaded_activation_bytes else "")
              + f"; {OVERLAPPED_HOST_BYTES_PER_PARAM} B/param when the optimizer step overlaps the backward "
                "(gradients consumed as they land)",
        },
        transfers={
            "h2d_bytes": plan.h2d_bytes, "d2h_bytes": plan.d2h_bytes,
            "h2d": {"parameters_forward": directions["forward_h2d_bytes"],
                    "parameters_backward": directions["backward_h2d_bytes"] - activations_in,
                    "activations": activations_in},
            "d2h": {"gradients": directions["backward_d2h_bytes"], "activations": activations_out,
                    "outputs": directions["forward_d2h_bytes"] - activations_out},
        },
        time={
            "step_s": step_s, "lanes_s": lanes, "bottleneck": bottleneck,
            "tokens_per_s": tokens / step_s if step_s > 0 else None,
            "achieved_tflops": plan.flops / step_s / 1e12 if step_s > 0 else None,
            "mfu": plan.model_flops / step_s / device_flops(profile, precision) if step_s > 0 else None,
            "flops": plan.flops, "model_flops": plan.model_flops,
            "roofline_s": roofline_floor(lanes["compute"], plan.h2d_bytes, plan.d2h_bytes,
                                         trace.host_optimizer["bytes"], profile),
            "host_optimizer_params": trace.host_optimizer["params"],
            "host_optimizer_overlapped": bool(trace.host_optimizer.get("overlapped")),
            "host_optimizer_exposed_s": plan.optimizer_exposed_s,
        },
        problems=problems,
        suggestions=suggestions,
        max_seq_len=max_seq,
        method={
            "traced_layers": trace.k, "device": "meta", "policies_built": list(trace.policies),
            "repeat_check": {"identical": True, "quantities": sorted(trace.layer_checks)},
            "probes": [{"batch": b, "seq_len": s} for (b, s) in traces],
            "seconds": timings,
        },
        depth_plan=plan, trace=trace,
    )


# --- text ----------------------------------------------------------------------------------------

def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def format_text(r: dict) -> str:
    m, hw, st, dev, host, tr, tm = (r[key] for key in
                                    ("model", "hardware", "step", "device", "host", "transfers", "time"))
    gib = format_bytes
    ok = lambda flag: "fits" if flag else "DOES NOT FIT"  # noqa: E731
    ext = dev["extrapolation"]
    lines = [
        f"megacompile plan: {m['name'] or m['model_type']} on {hw['name']}, batch {st['batch']} x seq {st['seq_len']} "
        f"= {st['tokens']:,} tokens/step, {st['precision']}",
        f"  model            {m['model_type']}, {m['parameters'] / 1e9:.2f} B parameters, {m['layers']} decoder layers "
        f"(hidden {m['hidden_size']}, MLP {m['intermediate_size']}, vocab {m['vocab_size']})",
        f"  method           traced {ext['traced_layers']} layers on the meta device with the megatrain backend "
        f"({len(r['method']['probes'])} plan(s), {r['method']['seconds']['total_s']:.1f} s); layers identical, "
        f"extrapolated to {m['layers']}",
        "",
        f"device memory      {ok(dev['fits'])}",
        f"  plan             {dev['plan']}",
        f"  peak             {gib(dev['peak_bytes'])} of {gib(dev['budget_bytes'])} budget "
        f"({dev['peak_bytes'] / dev['budget_bytes']:.0%})",
        f"  peak at          {dev['peak_at']}",
        f"  extrapolation    {ext['traced_layers']}-layer {ext['traced_plan']} plan {gib(ext['traced_peak_bytes'])}; "
        f"saved on the device per layer: "
        + ", ".join(f"{p} {gib(n)}" for p, n in ext["saved_device_bytes_per_layer"].items()),
        f"  keep-all peak    {gib(dev['keep_all_peak_bytes'])}; smallest plan "
        + (gib(dev['smallest_peak_bytes']) if dev['smallest_peak_bytes'] is not None
           else "not planned (keeping everything fits)"),
        "",
        f"host memory        {ok(host['fits'])}",
        f"  total            {gib(host['total_bytes'])} of "
        f"{gib(host['capacity_bytes']) if host['capacity_bytes'] else 'unknown (not checked)'}"
        f" ({host['bytes_per_param']} B/param; {host['overlapped_bytes_per_param']} B/param when the optimizer step "
        f"overlaps the backward)",
        f"  pinned           {gib(host['pinned_bytes'])}",
        f"  pageable         {gib(host['pageable_bytes'])}",
        "  parts            " + ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in host["parts_bytes"].items()),
        f"  layout           {host['layout']}",
        "",
        "transfers per step",
        f"  host -> device   {gib(tr['h2d_bytes'])}: parameters forward {gib(tr['h2d']['parameters_forward'])}, "
        f"backward {gib(tr['h2d']['parameters_backward'])}, activations {gib(tr['h2d']['activations'])}",
        f"  device -> host   {gib(tr['d2h_bytes'])}: gradients {gib(tr['d2h']['gradients'])}, "
        f"activations {gib(tr['d2h']['activations'])}",
        "",
        "time per step (cost model)",
        f"  step             {_seconds(tm['step_s'])} (roofline floor {_seconds(tm['roofline_s'])})",
        "  lanes            " + " | ".join(f"{k.replace('_', ' ')} {_seconds(v)}" for k, v in tm["lanes_s"].items())
        + f"  -> bottleneck: {tm['bottleneck'].replace('_', ' ')}",
        f"  host optimizer   {_seconds(tm['host_optimizer_exposed_s'])} after the device work ("
        + ("overlapped with the backward: each gradient's update starts when it lands)"
           if tm["host_optimizer_overlapped"] else "runs after the backward)"),
        f"  throughput       {tm['tokens_per_s']:,.0f} tokens/s, {tm['achieved_tflops']:.1f} TFLOPS, "
        f"MFU {tm['mfu']:.1%}",
    ]
    if r.get("max_seq_len"):
        ms = r["max_seq_len"]
        value = f"{ms['value']:,}" if ms["value"] else "none"
        lines += ["", f"max seq len        {value} at batch {ms['batch']} (grid {ms['grid']}; {ms['how']}; "
                      f"{len(ms['probes'])} probes)" + (f"; {ms['note']}" if ms.get("note") else "")]
    lines.append("")
    if r["fits"]:
        lines.append("verdict            fits")
    else:
        lines.append("verdict            DOES NOT FIT")
        for p in r["problems"]:
            lines.append(f"  - {p['message']}")
        if r["suggestions"]:
            lines.append("  smallest changes that fit:")
            for s in r["suggestions"]:
                lines.append(f"  - {s['message']}")
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megacompile plan`."""
    parser.add_argument("model", metavar="MODEL",
                        help=f"a preset ({', '.join(known_presets())}) or a path to a Hugging Face config.json")
    parser.add_argument("--hardware", required=True, metavar="NAME",
                        help=f"a hardware profile ({', '.join(known_profiles())}) or a JSON written by calibrate")
    parser.add_argument("--seq-len", type=int, required=True, metavar="N", help="tokens per sequence")
    parser.add_argument("--batch", type=int, required=True, metavar="N", help="sequences per step")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help="fp32 (default) or bf16")
    parser.add_argument("--host-memory", default=None, metavar="SIZE",
                        help="host RAM, e.g. 1.5TB or 512GiB (default: the profile's)")
    parser.add_argument("--budget", default=None, metavar="SIZE",
                        help="device memory budget, e.g. 60GiB (default: the profile's HBM)")
    parser.add_argument("--max-seq-len", action="store_true",
                        help="also find the largest sequence length that fits (a few more plans)")
    parser.add_argument("--seq-multiple", type=int, default=128, metavar="N",
                        help="sequence lengths searched are multiples of N (default: 128)")
    parser.add_argument("--traced-layers", type=int, default=DEFAULT_TRACED_LAYERS, metavar="K",
                        help="decoder layers traced and planned before extrapolating "
                             f"(default: {DEFAULT_TRACED_LAYERS})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _quiet():
    """Keep tracing noise (PyTorch warnings and log lines) off the terminal."""

    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    for name in ("torch._dynamo", "torch._inductor", "torch._functorch", "torch.fx", "torch._logging",
                 "torch.utils._sympy", "transformers"):
        logger = logging.getLogger(name)
        old = logger.level
        logger.setLevel(logging.ERROR)
        stack.callback(logger.setLevel, old)
    return stack


def run(args: argparse.Namespace) -> int:
    def usage_error(message: str) -> int:
        print(f"megacompile plan: error: {message}", file=sys.stderr)
        return 2

    try:
        config = load_model_config(args.model)
    except ValueError as e:
        return usage_error(str(e))
    try:
        profile = get_profile(args.hardware)
    except ValueError as e:
        return usage_error(str(e))
    try:
        budget = parse_bytes(args.budget, "--budget") if args.budget is not None else None
        host_memory = parse_bytes(args.host_memory, "--host-memory") if args.host_memory is not None else None
    except OptionsError as e:
        return usage_error(str(e))
    if args.batch < 1 or args.seq_len < 1:
        return usage_error("--batch and --seq-len must be >= 1")
    if args.traced_layers < 2 or args.seq_multiple < 1:
        return usage_error("--traced-layers must be >= 2 and --seq-multiple >= 1")
    try:
        count_parameters(config)
    except ValueError as e:
        return usage_error(str(e))
    name = args.model if args.model in known_presets() else config.get("_name_or_path") or args.model
    try:
        with _quiet():
            result = plan_model(config, profile, batch=args.batch, seq_len=args.seq_len, precision=args.precision,
                                budget=budget, host_memory=host_memory, k=args.traced_layers,
                                max_seq_len=args.max_seq_len, seq_multiple=args.seq_multiple, model_name=name)
    except PlanError as e:
        print(f"megacompile plan: error: {e}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else result.to_text())
    return 0 if result.fits else 1


# The row of cli.SUBCOMMANDS: (name, help, add_arguments, run). Exit codes: 0 fits, 1 does not
# fit (the output says which resource and the smallest change), 2 bad input.
SUBCOMMAND = ("plan", "will a model's training step fit on this hardware, and how fast (plans a few layers on the "
              "meta device with the megatrain backend and extrapolates)", add_arguments, run)
