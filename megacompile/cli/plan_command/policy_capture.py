"""One compile of the k-layer step with the planner swapped out: the joint graph is built under
every uniform policy the planner's candidates are made of (its last rung, "recompute, layer
inputs offloaded", included) and the two-policy "pair" plans,
the attempts are kept, and the compile stops before anything runs."""
from __future__ import annotations

import contextlib
import inspect
import time
from typing import Callable

import torch

from megacompile.cli.plan_command import BASIC_POLICIES, DECODER_LAYER, PAIRS, RESIDENT, STREAMED
from megacompile.cli.plan_command.meta_model import _meta_placement, make_step, traced_model
from megacompile.core import torch_compat as compat
from megacompile.passes import facts_after
from megacompile.plan import flat_planner as planner
from megacompile.plan.streamed_layers import layer_inputs, mixed_spec, streaming_minimum_spec
from megacompile.plan.training_plan import PlanSpec, TrainingPlan


def _reset_dynamo() -> None:
    compat.reset_dynamo()


class _Traced(Exception):
    """Raised from inside the planner once the policies are built: nothing needs to run."""


@contextlib.contextmanager
def _capture_policies(out: dict, extra_plans: dict | None = None, pairs: bool = True,
                      keep_suffices: Callable | None = None):
    """Replace the planner for one compile: build every uniform policy from the one joint graph.

    ``capture.TrainingCompiler.partition`` hands the planner a ``build(plan)`` that runs the
    passes on the joint graph under a plan and estimates the memory of the result. Here it is
    called once per policy the planner's candidates are made of (keep, keep with the
    parameters resident, offload, recompute, and the ladder's last rung built from the
    recompute plan: ``STREAMED``) and for the ``PAIRS`` plans; the attempts are
    kept in ``out`` and the compile is stopped (``_Traced``): nothing runs. ``extra_plans``:
    name -> per-layer policy dict ({"model.layers.0": "offload", ...}; ``STREAMED`` too), built
    too (tests of mixed plans).
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
        for policy in BASIC_POLICIES[1:] if not only_keep else ():
            attempts[policy] = build(TrainingPlan(PlanSpec(name=policy, default_policy=policy)))
        decoder = [layer for layer in layers if DECODER_LAYER.search(layer)]
        inputs: dict = {}
        recompute = attempts.get("recompute")
        if recompute is not None and recompute.plan.saved_values:
            # The runtime's last rung exactly as its ladder spells it (all layers), and each
            # layer's share of what it offloads, for the per-layer mixes below.
            attempts[STREAMED] = build(TrainingPlan(streaming_minimum_spec(recompute)))
            inputs = layer_inputs(recompute, decoder)
        if pairs and not only_keep and len(decoder) >= 2:
            # The working set of a layer whose predecessor has another policy (its backward
            # prefetches the predecessor's reloads): the first layer under one, the rest under another.
            for prev, cur in PAIRS:
                if STREAMED in (prev, cur) and STREAMED not in attempts:
                    continue
                policy = {decoder[0]: prev, **{layer: cur for layer in decoder[1:]}}
                attempts[f"pair:{prev}>{cur}"] = build(TrainingPlan(mixed_spec(
                    f"pair {prev}>{cur}", policy, inputs, default=cur)))
        for name, layer_policy in (extra_plans or {}).items():
            attempts[name] = build(TrainingPlan(mixed_spec(name, layer_policy, inputs)))
        out.update(attempts=attempts, layers=list(layers), build_s=time.perf_counter() - t0)
        raise _Traced()

    planner.plan_training = plan_all
    try:
        yield
    finally:
        planner.plan_training = original


def trace_policies(config: dict, *, num_layers: int, batch: int, seq_len: int, precision: str = "fp32",
                   extra_plans: dict | None = None, keep_suffices: Callable | None = None,
                   token_chunks: int | None = None, autocast_lists: str = "cuda") -> dict:
    """Compile a training step of ``num_layers`` layers with megatrain, up to the plans: on meta
    tensors, or for bf16 on unwritten host weights under autocast (``meta_model.traced_model``).

    ``token_chunks``: the per-token runs of each layer in that many chunks (passes/chunk_tokens.py).
    ``autocast_lists``: whose autocast op lists a bf16 trace follows (the device the plan is for).
    Returns ``{"attempts": {policy: planner.Attempt}, "layers": [...], "model": model,
    "trace_s": seconds, "build_s": seconds}``.
    """
    t0 = time.perf_counter()
    model, input_device = traced_model(config, num_layers, precision)
    step = make_step(model)
    # One compile per probe: the step's code object is the same each time, so without a reset
    # Dynamo would count the probes as recompiles of one frame.
    _reset_dynamo()
    options = {"device": "cpu", "lowering": "eager"}
    if precision == "bf16":
        options.update(precision="bf16", autocast_lists=autocast_lists)
    if token_chunks is not None:
        options["token_chunks"] = token_chunks
    compiled = torch.compile(step, backend="megatrain", options=options)
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device=input_device)
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

