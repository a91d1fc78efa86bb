"""``megacompile plan MODEL --hardware NAME``: will a training step fit, and how fast will it run.

The numbers come from the real megatrain pipeline, not from a formula of the model's shape:

1. **Trace a few layers on the meta device.** The Hugging Face model is built from the
   preset's config with ``num_hidden_layers`` cut to ``k`` (2 by default) under
   ``torch.device("meta")`` (nothing is allocated), and an ordinary training step (forward,
   cross-entropy, backward, AdamW step, zero_grad) is compiled with
   ``torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager"})``
   and called once on meta ``input_ids`` of shape (batch, seq). Dynamo, AOTAutograd and the
   megatrain partitioner run as for a real step; inside the planner, the one joint graph is
   built three times, under the uniform policies *keep*, *offload* and *recompute* (the same
   ``build`` the planner uses: passes, split, rewrite, liveness estimate), and compilation
   stops there: planning needs no execution (``test_plan_cmd`` also runs a whole step on
   meta tensors to show the runtime itself works on them).
2. **Check the repeat.** The ``k`` decoder layers must have identical per-layer numbers
   (parameter bytes, saved activation bytes under each policy, FLOPs forward and backward,
   bytes loaded and offloaded, op counts); otherwise the extrapolation is refused.
3. **Extrapolate to the full depth N** (repeated layers are compiled and planned once):
   per-layer quantities x N plus the embedding, final norm and head once; the device peak
   as explained in ``full_depth_peak``; time with the cost model
   (``cost_model.step_time`` of the traced program, per-layer lane times x N).
4. **Choose the plan the planner would choose** for N identical layers: keep everything if
   it fits, otherwise the per-layer mix of keep / offload / recompute with the least price
   under the planner's own prices (offload: saved bytes over the link both ways; recompute:
   the layer's forward again) whose extrapolated peak fits the budget (and whose offloaded
   activations fit the host).

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
import contextlib
import dataclasses
import json
import math
import re
import sys
import time
from typing import Any, Callable

import torch

from .hardware import ADAMW_BYTES_PER_PARAM, HardwareProfile, get_profile, known_profiles
from .options import OptionsError, format_bytes, parse_bytes
from .presets import build_transformers_config, count_parameters, known_presets, load_model_config

POLICIES = ("keep", "offload", "recompute")
PRECISIONS = ("fp32", "bf16")
DEFAULT_TRACED_LAYERS = 2
ATTN_IMPLEMENTATION = "megatrain_host_sdpa"

# Host bytes per parameter, (pinned, pageable), and what they are.
# fp32: fp32 weights (pinned: streamed to the device) + fp32 gradients (pinned: they land
#   there from the device) | AdamW exp_avg + exp_avg_sq (pageable: only the host optimizer
#   touches them) = 4 + 4 | 8 = 16 B/param.
# bf16: bf16 weights (pinned, streamed) + fp32 gradients (pinned, accumulated on the host) |
#   fp32 master weights + fp32 exp_avg + exp_avg_sq (pageable) = 2 + 4 | 4 + 8 = 18 B/param.
HOST_BYTES_PER_PARAM = {
    "fp32": {"weights": (4, "pinned"), "gradients": (4, "pinned"), "optimizer_states": (8, "pageable")},
    "bf16": {"weights": (2, "pinned"), "gradients": (4, "pinned"), "master_weights": (4, "pageable"),
             "optimizer_states": (8, "pageable")},
}
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
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

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
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _host_sdpa)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def host_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), labels)`` (mean, ignore_index -100) in the ops the host
    trace decomposes it into; unlike ``F.cross_entropy`` it keeps its gradient on meta tensors."""
    import torch.nn.functional as F

    flat = logits.reshape(-1, logits.size(-1)).float()
    return torch.ops.aten.nll_loss_forward(F.log_softmax(flat, -1), labels.reshape(-1), None, 1, -100)[0]


def build_meta_model(config: dict, num_layers: int, precision: str = "fp32"):
    """The Hugging Face causal LM of ``config`` with ``num_layers`` decoder layers, on meta."""
    from transformers import AutoModelForCausalLM

    _register_attention()
    cfg = dict(config)
    cfg["num_hidden_layers"] = int(num_layers)
    cfg["use_cache"] = False
    cfg.pop("layer_types", None)  # sized by the full depth in some config.json files
    hf = build_transformers_config(cfg)
    with torch.device("meta"):
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
    from . import backend
    from .errors import PlacementError

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


class _Traced(Exception):
    """Raised from inside the planner once the policies are built: nothing needs to run."""


@contextlib.contextmanager
def _capture_policies(out: dict, execute: bool = False):
    """Replace the planner for one compile: build every uniform policy from the one joint graph.

    ``capture.TrainingCompiler.partition`` hands the planner a ``build(plan)`` that runs the
    passes on the joint graph under a plan and estimates the memory of the result. Here it is
    called once per policy (``keep``, ``offload``, ``recompute``: what the planner's own
    candidates are made of) and the attempts are kept in ``out``. Unless ``execute``, the
    compile is then stopped (``_Traced``).
    """
    from . import planner
    from .plan import TrainingPlan

    original = planner.plan_training

    def plan_all(build, layers, options, profile):
        t0 = time.perf_counter()
        attempts = {}
        for policy in POLICIES:
            attempts[policy] = build(TrainingPlan(policy=policy, budget=None, default_policy=policy))
        # The last build leaves the joint graph marked for its policy; build the one
        # AOTAutograd continues with (keep) last.
        attempts["keep"] = build(TrainingPlan(policy="keep", budget=None, default_policy="keep")) \
            if execute else attempts["keep"]
        out.update(attempts=attempts, layers=list(layers), build_s=time.perf_counter() - t0)
        if not execute:
            raise _Traced()
        return attempts["keep"]

    planner.plan_training = plan_all
    try:
        yield
    finally:
        planner.plan_training = original


def trace_policies(config: dict, *, num_layers: int, batch: int, seq_len: int, precision: str = "fp32",
                   execute: bool = False) -> dict:
    """Compile a training step of ``num_layers`` layers on meta tensors with megatrain.

    Returns ``{"attempts": {policy: planner.Attempt}, "layers": [...], "model": model,
    "trace_s": seconds}``. With ``execute``, the step also runs (on meta tensors).
    """
    import torch._dynamo

    t0 = time.perf_counter()
    model = build_meta_model(config, num_layers, precision)
    step = make_step(model)
    # One compile per probe: the step's code object is the same each time, so without a reset
    # Dynamo would count the probes as recompiles of one frame.
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager"})
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    out: dict = {}
    with _meta_placement(), _capture_policies(out, execute=execute):
        try:
            compiled(ids, ids)
        except Exception:  # noqa: BLE001  (Dynamo wraps _Traced in BackendCompilerFailed)
            if "attempts" not in out:
                raise
    torch._dynamo.reset()
    out["model"] = model
    out["trace_s"] = time.perf_counter() - t0
    return out


# --- what one traced program says per layer ------------------------------------------------------

@dataclasses.dataclass
class LayerNumbers:
    """Per decoder layer numbers of one uniform policy, from the traced k-layer program."""

    policy: str
    # Memory (bytes). early/late: the traced plan's peak before / after the point where the
    # extra N-k layers would be inserted (see full_depth_peak); saved_device: activations a
    # layer keeps on the device from its forward to its backward; saved_host: activations
    # it offloads to the host for that time.
    peak: int
    early_peak: int
    late_peak: int
    saved_device: int
    saved_host: int
    # Time (seconds) a steady-state layer adds to the step, forward and backward.
    forward_period_s: float
    backward_period_s: float
    lanes_s: dict
    flops: int
    model_flops: int
    h2d_bytes: int
    d2h_bytes: int
    # The planner's price of this policy for one layer: bytes freed vs keep, seconds added.
    freed_bytes: int = 0
    price_s: float = 0.0


@dataclasses.dataclass
class Trace:
    """One meta-device trace of k layers at one (batch, seq_len), digested."""

    k: int
    batch: int
    seq_len: int
    precision: str
    policies: dict  # policy -> LayerNumbers
    # Everything that is not a decoder layer, from the keep program: device seconds, lane
    # seconds, FLOPs, bytes moved.
    glue: dict
    param_bytes_by_layer: dict
    layer_checks: dict  # quantity -> per-layer values (identical when the repeat holds)
    trace_s: float
    prediction: Any = None  # cost_model.StepTimePrediction of the traced keep program


def _layer_of(node) -> str | None:
    from .node_info import has_info, info

    return info(node).layer if has_info(node) else None


def _first_compute_index(gm, layer: str) -> int:
    from .node_info import has_info, info

    for i, node in enumerate(gm.graph.nodes):
        if node.op == "call_function" and has_info(node) and info(node).layer == layer \
                and info(node).role == "compute":
            return i
    raise PlanError(f"no compute op of layer {layer!r} in the traced graph")


def _curve(gm, keep_outputs_alive: bool) -> list[int]:
    from .plan import estimate_memory

    points: list = []
    estimate_memory(gm, keep_outputs_alive=keep_outputs_alive, curve=points)
    return [live for _, live in points]


def _sum_by_layer(gm, attr: str, where: Callable | None = None) -> dict:
    from .cost_model import COST_KEY

    out: dict = {}
    for node in gm.graph.nodes:
        c = node.meta.get(COST_KEY)
        if c is None or (where is not None and not where(node, c)):
            continue
        key = _layer_of(node) or "(glue)"
        out[key] = out.get(key, 0) + getattr(c, attr)
    return out


def _digest(raw: dict, profile: HardwareProfile, *, k: int, batch: int, seq_len: int, precision: str,
            num_params_full: int) -> Trace:
    from . import cost_model
    from .node_info import has_info, info, layer_of_module_path
    from .planner import _forward_seconds_by_layer, _saved_device_bytes_by_layer

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
    glue: dict = {}
    for policy in POLICIES:
        a = attempts[policy]
        pred = cost_model.step_time(a.forward, a.backward, profile, optimizer_param_bytes=opt_bytes,
                                    precision=precision)
        fw_curve, bw_curve = _curve(a.forward, True), _curve(a.backward, False)
        f_split = _first_compute_index(a.forward, second)
        b_split = _first_compute_index(a.backward, first)
        early = max(fw_curve[:f_split] + bw_curve[b_split:], default=0)
        late = max(fw_curve[f_split:] + bw_curve[:b_split], default=0)
        saved_dev = _saved_device_bytes_by_layer(a)
        is_offload = lambda node, c: c.lane == "d2h"  # noqa: E731
        saved_host = _sum_by_layer(a.forward, "bytes_touched", is_offload)
        flops_f, flops_b = _sum_by_layer(a.forward, "flops"), _sum_by_layer(a.backward, "flops")
        recompute = _sum_by_layer(a.backward, "flops", lambda n, c: has_info(n) and info(n).phase == "recompute")
        loads = [_sum_by_layer(g, "bytes_touched", lambda n, c: c.lane == "h2d") for g in (a.forward, a.backward)]
        offs = [_sum_by_layer(g, "bytes_touched", lambda n, c: c.lane == "d2h") for g in (a.forward, a.backward)]
        ops = [_sum_by_layer(g, "time_s", lambda n, c: c.time_s > 0 and c.lane == "compute")
               for g in (a.forward, a.backward)]

        def per_layer(d: dict | list, layer: str):
            return sum(x.get(layer, 0) for x in d) if isinstance(d, list) else d.get(layer, 0)

        for layer_set, name in ((saved_dev, "saved_device_bytes"), (saved_host, "saved_host_bytes"),
                                (flops_f, "forward_flops"), (flops_b, "backward_flops"),
                                (loads, "h2d_bytes"), (offs, "d2h_bytes")):
            checks[f"{policy}.{name}"] = [per_layer(layer_set, layer) for layer in decoder]
        checks[f"{policy}.compute_seconds"] = [round(per_layer(ops, layer), 12) for layer in decoder]

        # Steady-state time of one layer: forward, a layer that follows a layer (the second
        # traced one); backward, a layer whose backward follows another's (the first).
        def period(tl, layer: str) -> float:
            t = tl.per_layer.get(layer)
            if t is None:
                return 0.0
            if synchronous:  # copies run on the compute lane
                return t.compute_s + t.h2d_s + t.d2h_s + t.exposed_wait_s
            return max(t.compute_s + t.exposed_wait_s, t.h2d_s, t.d2h_s)

        lanes = {"compute": 0.0, "h2d": 0.0, "d2h": 0.0}
        for tl in (pred.forward, pred.backward):
            t = tl.per_layer.get(first)
            if t is not None:
                lanes["compute"] += t.compute_s
                lanes["h2d"] += t.h2d_s
                lanes["d2h"] += t.d2h_s
        numbers = LayerNumbers(
            policy=policy, peak=a.plan.peak_bytes, early_peak=early, late_peak=late,
            saved_device=saved_dev.get(first, 0) if policy != "offload" else 0,
            saved_host=saved_host.get(first, 0) if policy == "offload" else 0,
            forward_period_s=period(pred.forward, second), backward_period_s=period(pred.backward, first),
            lanes_s=lanes, flops=flops_f.get(first, 0) + flops_b.get(first, 0),
            model_flops=flops_f.get(first, 0) + flops_b.get(first, 0) - recompute.get(first, 0),
            h2d_bytes=per_layer(loads, first), d2h_bytes=per_layer(offs, first),
        )
        policies[policy] = numbers
        if policy == "keep":
            keep_pred = pred
            keep_fwd_s = _forward_seconds_by_layer(a.forward, profile)
            device_s = pred.total_s - pred.host_optimizer_s
            glue = {
                "device_s": device_s - k * (numbers.forward_period_s + numbers.backward_period_s),
                "lanes_s": {lane: getattr(pred, f"{lane}_s") - k * numbers.lanes_s[lane] for lane in lanes},
                "flops": pred.flops - k * numbers.flops,
                "model_flops": pred.model_flops - k * numbers.model_flops,
                "h2d_bytes": pred.h2d_bytes - k * numbers.h2d_bytes,
                "d2h_bytes": pred.d2h_bytes - k * numbers.d2h_bytes,
                "host_optimizer_s": pred.host_optimizer_s,
                "host_optimizer_bytes": pred.host_optimizer_bytes,
            }
    # The planner's prices (planner.plan_training): offloading frees the saved bytes and costs
    # them over the link both ways; recomputing frees all but the layer's boundary input and
    # costs its forward again.
    keep_saved = policies["keep"].saved_device
    link = 1.0 / profile.d2h_bandwidth + 1.0 / profile.h2d_bandwidth
    policies["offload"].freed_bytes, policies["offload"].price_s = keep_saved, keep_saved * link
    policies["recompute"].freed_bytes = max(0, keep_saved - policies["recompute"].saved_device)
    policies["recompute"].price_s = keep_fwd_s.get(first, 0.0)
    return Trace(k=k, batch=batch, seq_len=seq_len, precision=precision, policies=policies, glue=glue,
                 param_bytes_by_layer=param_bytes_by_layer, layer_checks=checks, trace_s=raw["trace_s"],
                 prediction=keep_pred)


def check_repeat(trace: Trace, rel_tol: float = 1e-9) -> list[str]:
    """The quantities in which the traced decoder layers differ (empty: they repeat)."""
    differ = []
    for name, values in trace.layer_checks.items():
        lo, hi = min(values), max(values)
        if hi - lo > rel_tol * max(abs(hi), 1):
            differ.append(f"{name} {values}")
    return differ


def trace_model(config: dict, profile: HardwareProfile, *, batch: int, seq_len: int, precision: str = "fp32",
                k: int = DEFAULT_TRACED_LAYERS) -> Trace:
    """Trace k layers on the meta device and digest the three policies' programs."""
    if k < 2:
        raise ValueError("at least 2 traced layers are needed to check that the layers repeat")
    raw = trace_policies(config, num_layers=k, batch=batch, seq_len=seq_len, precision=precision)
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
    price_s: float
    device_s: float
    lanes_s: dict
    flops: int
    model_flops: int
    h2d_bytes: int
    d2h_bytes: int
    offloaded_activation_bytes: int
    peak_region: str  # "late" (head / later layers, grows with depth) or "early"

    @property
    def summary(self) -> str:
        used = [f"{p} {n}" for p, n in self.counts.items() if n]
        if len(used) == 1:
            return f"{used[0].split()[0]} all {sum(self.counts.values())} layers"
        return "per-layer (" + ", ".join(used) + ")"


def full_depth_peak(trace: Trace, counts: dict) -> tuple[int, str]:
    """The device peak of N = sum(counts) layers, from the traced k-layer plans.

    Think of the N-k extra layers as inserted between the first and the second traced layer.
    Their saved activations are live on the device from their forward to their backward, so
    they add to every point of the traced program that lies between those (the "late" region:
    the forward from the second layer's first op on, the head and loss, and the backward up
    to the first layer's backward); the "early" region (embedding and the first layer,
    forward and backward) does not see them. For a uniform policy p with s_p saved device
    bytes per layer (keep: all saved activations; recompute: the layer's input only;
    offload: none) this is

        peak(N) = max(early_k, late_k + (N - k) * s_p)

    where early_k / late_k are the traced plan's peaks in each region: the planner's peak
    for k layers plus (N-k) x the saved activation bytes a layer keeps on the device. With a
    mix of policies the layer at the peak may have any of the policies used, so the largest
    of their working sets is taken:

        peak(N) = max( max_p early_p, max_p (late_p - k * s_p) + sum_p n_p * s_p )

    over the policies p with n_p > 0. ``test_plan_cmd`` checks the k=2 extrapolation against
    a real k=4 plan.
    """
    used = [p for p, n in counts.items() if n]
    early = max(trace.policies[p].early_peak for p in used)
    saved = sum(n * trace.policies[p].saved_device for p, n in counts.items())
    late = max(trace.policies[p].late_peak - trace.k * trace.policies[p].saved_device for p in used) + saved
    return (late, "late") if late >= early else (early, "early")


def evaluate(trace: Trace, counts: dict) -> DepthPlan:
    """Peak, time, FLOPs and bytes of N layers under ``counts`` (policy -> number of layers)."""
    peak, region = full_depth_peak(trace, counts)
    g = trace.glue
    pol = trace.policies
    lanes = {lane: g["lanes_s"][lane] + sum(n * pol[p].lanes_s[lane] for p, n in counts.items())
             for lane in ("compute", "h2d", "d2h")}
    lanes = {lane: max(0.0, v) for lane, v in lanes.items()}
    lanes["host_optimizer"] = g["host_optimizer_s"]
    return DepthPlan(
        counts=dict(counts), peak_bytes=peak,
        price_s=sum(n * pol[p].price_s for p, n in counts.items()),
        device_s=max(0.0, g["device_s"] + sum(n * (pol[p].forward_period_s + pol[p].backward_period_s)
                                             for p, n in counts.items())),
        lanes_s=lanes,
        flops=g["flops"] + sum(n * pol[p].flops for p, n in counts.items()),
        model_flops=g["model_flops"] + sum(n * pol[p].model_flops for p, n in counts.items()),
        h2d_bytes=g["h2d_bytes"] + sum(n * pol[p].h2d_bytes for p, n in counts.items()),
        d2h_bytes=g["d2h_bytes"] + sum(n * pol[p].d2h_bytes for p, n in counts.items()),
        offloaded_activation_bytes=sum(n * pol[p].saved_host for p, n in counts.items()),
        peak_region=region,
    )
