"""The ``megatrain`` Dynamo backend: ``torch.compile(step, backend="megatrain", options=...)``.

Dynamo splits the user's step into graphs and calls ``megatrain`` once per graph:
- a graph that needs gradients (the forward and loss) goes through AOTAutograd with our
  partitioner and passes (``capture.TrainingCompiler``) and runs on the streaming runtime;
- a graph that needs none, typically the optimizer's ``step`` (Dynamo captures stock
  ``torch.optim`` optimizers), runs on the host over the host-resident parameters and
  optimizer state;
- a graph the passes cannot handle falls back to plain Inductor (plain eager under
  ``lowering="eager"``) with one warning line saying why.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
from typing import Any

import torch
import torch.fx as fx

from megacompile.capture import records
from megacompile.capture.inline_regions import inline_checkpoint_regions, inline_nested_regions
from megacompile.capture.records import CompiledGraph
from megacompile.capture.training_compiler import TrainingCompiler, lower_with
from megacompile.core import torch_compat as compat
from megacompile.core.autocast_lists import autocast_lists_for
from megacompile.core.collector import cycle_collector_paused
from megacompile.core.errors import (
    BudgetError,
    MegacompileError,
    PlacementError,
    UnsupportedGraph,
    UnsupportedStepError,
)
from megacompile.core.node_info import module_root, qualify_module_stacks, source_to_name
from megacompile.core.printer import format_graph
from megacompile.core.units import format_bytes
from megacompile.optimizer import eager_update_watch
from megacompile.optimizer.host_step import fused_step_for, host_step_label, take_step_out_of_trace
from megacompile.optimizer.ownership import optimizer_of_graph
from megacompile.options import Options, parse_options
from megacompile.passes import GraphSnapshot, PassContext, chunk_tokens, run_passes
from megacompile.plan.training_plan import TrainingPlan
from megacompile.report import RECORDER
from megacompile.runtime import trace
from megacompile.runtime.device import get_device

# TORCH_LOGS="megatrain" (docs/guide.md, "Logs"); the capture stage logs the phases that follow.
log = logging.getLogger(__name__)


def describe_inputs(gm: fx.GraphModule, example_inputs: list) -> tuple[list[str], list[str]]:
    """The user's names for the graph inputs and whether each is a parameter or an input.

    Parameters of several roots (``policy`` and ``reference`` passed to the step, a teacher and
    a student) keep the root in their names and in the graph's module paths (layer names), so
    that two models of one architecture do not share layer names."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sources = [compat.dynamo_input_source_name(placeholders[i]) if i < len(placeholders) else None
               for i in range(len(example_inputs))]
    roles = ["param" if isinstance(value, torch.nn.Parameter) or (
        isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf) else "input"
        for value in example_inputs]
    # Frozen weights (a reference model's) count: their layers are planned too.
    several_roots = len({module_root(src) for src in sources if src} - {None}) > 1
    if several_roots:
        qualify_module_stacks(gm)
    names = [source_to_name(src, keep_root=several_roots) if src else
             placeholders[i].name if i < len(placeholders) else f"input_{i}" for i, src in enumerate(sources)]
    # Two inputs must never share a name: generated node names derive from them.
    seen: dict[str, int] = {}
    for i, n in enumerate(names):
        if n in seen:
            names[i] = f"{n}_{i}"
        seen[names[i]] = i
    return names, roles


def check_placement(example_inputs: list, names: list[str], roles: list[str]) -> None:
    """megatrain keeps parameters in host memory and moves them itself.

    A parameter already on an accelerator (``model.cuda()``) would be duplicated on the device
    and count against the budget twice, so it is an error that says what to change.
    """
    for value, name, role in zip(example_inputs, names, roles):
        if role == "param" and isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise PlacementError(
                f"megatrain: parameter '{name}' is on {value.device}, but megatrain keeps parameters in host "
                f"memory and streams them to the device itself. Keep the model on the CPU (remove "
                f"model.to('{value.device.type}') / model.cuda()); inputs may stay where they are."
            )


# Lookups that take a `sparse` flag, and where their weight is: a trainable weight read with
# sparse=True gets a sparse COO gradient.
_SPARSE_GRADIENT_LOOKUPS = {torch.nn.functional.embedding: "weight", torch.nn.functional.embedding_bag: "weight"}


def check_sparse_gradients(gm: fx.GraphModule, names: list[str]) -> None:
    """megatrain streams dense gradients back to host memory; a sparse COO gradient has a
    data-dependent size that neither the plan nor the gradient sink can hold. Said before
    anything runs, with the dense equivalent."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    for node in gm.graph.nodes:
        weight_arg = _SPARSE_GRADIENT_LOOKUPS.get(node.target) if node.op == "call_function" else None
        if weight_arg is None:
            continue
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments
        weight = bound.get(weight_arg)
        example = weight.meta.get("example_value") if isinstance(weight, fx.Node) else None
        if bound.get("sparse") is True and getattr(example, "requires_grad", False):
            name = names[placeholders[weight]] if weight in placeholders else weight.name
            kind = "nn.EmbeddingBag" if node.target is torch.nn.functional.embedding_bag else "nn.Embedding"
            raise UnsupportedStepError(
                f"megatrain: parameter '{name}' is read by an embedding with sparse=True ({kind}(..., sparse=True)), "
                f"whose sparse gradient megatrain cannot stream: it moves dense gradients to host memory. Build it "
                f"with sparse=False: SGD (with or without momentum) and Adagrad compute the same update from the "
                f"dense gradient; SparseAdam's lazy update has no dense form (use Adam or AdamW)."
            )


def _unsupported_reason(gm: fx.GraphModule) -> str | None:
    # Marked layers are inlined here or partitioned per body; a custom autograd.Function is
    # traced by AOTAutograd into plain ops of both graphs (its own backward in the backward).
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, compat.HigherOrderOperator) \
                and not compat.is_invoke_subgraph(node.target) and not compat.is_custom_autograd_function(node.target):
            return (f"the graph calls the higher-order op '{node.target.__name__}', whose subgraphs the "
                    f"streaming passes cannot rewrite yet")
    return None


# Calls with matmul-class work (many FLOPs per byte read). A graph without gradients and without
# them (an optimizer step, an EMA of the weights, a weight clamp, a gradient norm) is memory-bound
# wherever it runs, and runs where its tensors live, on the host: on the device it would first
# move every byte over the link (and back, for what it writes). A graph with them (an evaluation
# forward under no_grad) streams through the device like a training forward.
_CONTRACTIONS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "mv", "einsum", "tensordot",
    "bilinear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "scaled_dot_product_attention", "multi_head_attention_forward", "lstm", "gru", "rnn_tanh",
    "rnn_relu", "__matmul__",
})


def _does_contractions(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_module" or (node.op == "call_function"
                                        and isinstance(node.target, compat.HigherOrderOperator)):
            return True  # a module Dynamo kept whole, a marked layer's body: assume the layer's work
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op in ("call_function", "call_method") and name in _CONTRACTIONS:
            return True
    return False


def _outputs_require_grad(gm: fx.GraphModule) -> bool:
    """Whether an output of the graph requires grad (unknown counts as yes): a graph with grad
    mode on may open no_grad itself, as an EMA update or a weight clamp after ``opt.step()`` does."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = [n.meta.get("example_value") for n in output.all_input_nodes]
    return any(v is None or (isinstance(v, torch.Tensor) and v.requires_grad) for v in values)


def _runs_on_host(gm: fx.GraphModule, needs_grad: bool, roles: list[str]) -> bool:
    """Whether a graph runs on the host rather than as a streamed program: one with nothing to
    differentiate that is an optimizer's step or does no matmul-class work (``_CONTRACTIONS``)
    on the parameters it reads. Glue of a training step without parameters (``loss.detach()``)
    keeps its place in the step."""
    reads_params = "param" in roles
    if needs_grad and (_outputs_require_grad(gm) or not reads_params):
        return False
    if not reads_params or (_looks_like_optimizer(gm) and optimizer_of_graph(gm) is not None):
        return True
    return not _does_contractions(gm)


def _looks_like_optimizer(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if isinstance(name, str) and name.endswith("_") and not name.startswith("__") and node.op != "placeholder":
            return True
    return False


def _host_region(gm: fx.GraphModule, example_inputs: list, options: Options) -> Any:
    """A graph without gradients (the optimizer step): it runs on the host, on host state."""
    label = "optimizer (host)" if _looks_like_optimizer(gm) else "host graph"
    record = CompiledGraph(label=label, options=options)
    record.snapshots = []

    record.snapshots.append(GraphSnapshot("optimizer" if "optimizer" in label else "host", "captured",
                                          format_graph(gm, f"{label}: captured (runs on the host)"), 0, 0, 0.0))
    records.add(record)

    fused = fused_step_for(gm) if "optimizer" in label else None
    optimizer = fused.optimizer if fused is not None else None
    if optimizer is None and "optimizer" in label:
        optimizer = optimizer_of_graph(gm)
    if fused is not None:
        # Adam / AdamW: the fused, vectorized host kernel instead of the captured op chain.
        record.label = label = f"optimizer (host, fused {type(fused.optimizer).__name__})"
        compiled = fused
    elif options.lowering == "inductor":
        compiled = compat.inductor_compile(gm, example_inputs)
    else:
        compiled = gm.forward

    lane = "host optimizer" if "optimizer" in label else "host"

    @torch.compiler.disable
    def run_on_host(*args):
        with trace.span(lane, label):
            out = compiled(*args)
        eager_update_watch.host_step_ran()
        RECORDER.host_graph_ran(label, optimizer)
        return out

    return run_on_host


def _fallback(gm: fx.GraphModule, example_inputs: list, options: Options, reason: str) -> Any:
    target = "Inductor" if options.lowering == "inductor" else "eager (lowering='eager')"
    warnings.warn(f"megatrain: {reason}; compiling this graph with plain {target} instead (results stay correct)",
                  stacklevel=2)
    if options.lowering == "inductor":
        return compat.inductor_backend()(gm, example_inputs)
    return gm.forward



def _graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _neither_fits(whole: BudgetError, chunked: BudgetError) -> BudgetError:
    """The error of the plans with the layers whole (its minimum is where they fit), naming
    the lower minimum chunking reaches (where "auto" would chunk), and where chunked plans fit
    the budget but not host_activation_budget, the cap that would do with them."""
    lower = chunked.minimum_budget if chunked.minimum_budget and whole.minimum_budget and \
        chunked.minimum_budget < whole.minimum_budget else None
    note = (f" With each layer's per-token runs in chunks (option token_chunks, which 'auto' picks at such a "
            f"budget) it needs at least {lower} bytes ({format_bytes(lower)}).") if lower else ""
    host = chunked.least_host_activation_bytes
    if host is not None and (whole.least_host_activation_bytes is None or host < whole.least_host_activation_bytes):
        note += (f" With each layer's per-token runs in chunks (which 'auto' picks then) a plan fits memory_budget "
                 f"putting {format_bytes(host)} of activations on the host: raise host_activation_budget to {host} "
                 f"for it.")
    else:
        host = whole.least_host_activation_bytes
    return BudgetError(f"{whole}{note}", minimum_budget=whole.minimum_budget, limiting_layer=whole.limiting_layer,
                       streaming_floor=whole.streaming_floor, token_chunked_minimum=lower,
                       least_host_activation_bytes=host)


def _compile_training(gm: fx.GraphModule, example_inputs: list, opts: Options, names, roles) -> tuple[Any, str | None]:
    """Dynamo's graph through the dynamo-stage passes and AOTAutograd (which calls the planner):
    (compiled, None), or (None, why) where the graph turns out unsupported."""
    # Graph passes on Dynamo's graph (the fused LM head + loss), before AOTAutograd traces it.
    captured = PassContext(opts, "dynamo", TrainingPlan(), names, roles)
    run_passes(gm, captured, keep_snapshots=opts.keeps_snapshots)
    device = get_device(opts.device)
    device.pinned.limit(opts.pinned_host_memory)
    if opts.autocast_dtype is not None:
        # Traced on host tensors (the parameters live there) under CPU autocast, which follows
        # the op lists of the device that runs the program (core/autocast_lists.py) while
        # AOTAutograd traces it below.
        compat.wrap_in_autocast(gm, "cpu", opts.autocast_dtype)
    # The step's own `with torch.autocast("cuda")` regions (a user moving from a GPU training
    # loop): traced as CPU autocast regions following CUDA's op lists, which is what they
    # compute on a GPU. Left as they were, CUDA autocast would cast nothing on host tensors.
    user_cuda_autocast = compat.retarget_autocast_regions(gm, "cuda")
    # Called inside the caller's own `with torch.autocast("cuda")` (a compiled model in a GPU
    # loop): the whole graph is such a region. (The programs run with autocast off: their
    # casts are explicit.)
    ambient = compat.ambient_cuda_autocast_dtype()
    if ambient is not None:
        compat.wrap_in_autocast(gm, "cpu", ambient)
        user_cuda_autocast = True
    compiler = TrainingCompiler(opts, device, names, roles, example_inputs, lower_with(opts, device))
    compiler.captured_snapshots = captured.snapshots
    compiler.autocast_added = opts.autocast_dtype is not None or user_cuda_autocast
    log.info("%s: compiling a graph of %d nodes (%d parameters) for %s; capturing it with AOTAutograd",
             compiler.record.label, len(gm.graph.nodes), roles.count("param"), opts.device)
    try:
        # Any autocast in the trace (precision="bf16", the step's own or the caller's regions)
        # follows the lists of the device that runs the program (option autocast_lists); a
        # trace without autocast leaves the dispatcher alone.
        lists = autocast_lists_for("cuda" if user_cuda_autocast else opts.traced_autocast_lists
                                   if compat.traces_under_autocast(gm) else "cpu")
        with compat.invoke_subgraph_schema_memo(), cycle_collector_paused(), lists:
            compiled = compat.aot_module_simplified(
                gm, example_inputs,
                fw_compiler=compiler.compile_forward,
                bw_compiler=compiler.compile_backward,
                partition_fn=compiler.partition,
                inference_compiler=compiler.compile_inference,
            )
    except UnsupportedGraph as e:
        return None, str(e)
    return compiled, None


# Compiles of one frame that pass without a word: the first, and the one Dynamo makes with
# dynamic sizes when the shapes change (automatic dynamic shapes).
QUIET_COMPILES = 2


def warn_if_compiled_again() -> None:
    """Each compile of a frame captures and plans its step from scratch (minutes at 7B), and
    Dynamo compiles a frame again whenever a guard on what the step read fails: a list it
    appends to grows every step, so every step compiled again, silently, until Dynamo's limit,
    after which the frame runs uncompiled (without megatrain). Said from the third compile."""
    found = compat.frame_compile_count()
    if found is None or found[1] < QUIET_COMPILES:
        return
    code, before = found
    owner = compat.compiling_owner()
    if isinstance(owner, torch.nn.Module):
        what = f"{type(owner).__name__}.forward"
    else:
        owner = owner if hasattr(owner, "co_name") else code
        what = f"{owner.co_name} ({owner.co_filename}:{owner.co_firstlineno})"
    part = " (its rest after a graph break)" if compat.is_dynamo_resume_code(code) else ""
    warnings.warn(
        f"megatrain: Dynamo is compiling {what}{part} again, compile {before + 1} of it; each compile captures and "
        f"plans the step anew. Dynamo compiles a frame again when a guard on what it read fails: a Python value the "
        f"step reads changed since (a list it appends to, a float argument, an attribute set between steps) or the "
        f"shapes changed once more. TORCH_LOGS=recompiles names the guard. Keep such values out of the compiled step "
        f"(e.g. append loss.item() after the call returns), pass numbers as tensors, or mark sizes dynamic "
        f"(torch._dynamo.mark_dynamic). After {compat.recompile_limit()} compiles Dynamo runs the frame uncompiled, "
        f"without megatrain.", stacklevel=2)


def megatrain(gm: fx.GraphModule, example_inputs: list, options: dict | None = None, **_ignored: Any) -> Any:
    opts = parse_options(options)
    warn_if_compiled_again()
    names, roles = describe_inputs(gm, example_inputs)
    check_placement(example_inputs, names, roles)
    if torch.is_grad_enabled():
        check_sparse_gradients(gm, names)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    )
    if _runs_on_host(gm, needs_grad, roles):
        return _host_region(gm, example_inputs, opts)
    # The step's own torch.utils.checkpoint regions: the planner decides what to recompute.
    if checkpoints := inline_checkpoint_regions(gm):
        log.info("megatrain: %d activation checkpoint region(s) of the step inlined; the plan decides what is "
                 "recomputed", checkpoints)
    # Layers marked with torch.compiler.nested_compile_region: Dynamo traced each body once.
    # AOTAutograd then traces and partitions each distinct body once too (under autocast as
    # well: the bodies are traced inside the step's autocast), and the step's partitioner
    # inlines the partitioned bodies per call (capture.TrainingCompiler.partition). Token
    # chunking reads the top-level graph's ops, not a region's body: where it chunks, the
    # calls are inlined here first. (The causal mask's elision reaches into the bodies.)
    if chunk_tokens.chunks_now(opts):
        inline_nested_regions(gm)
    reason = _unsupported_reason(gm)
    if reason is not None:
        return _fallback(gm, example_inputs, opts, reason)

    # Where token chunking may be needed (it is only when nothing fits without it), a copy of
    # Dynamo's graph as captured, to trace again with the per-token runs chunked.
    retry = _graph_copy(gm) if chunk_tokens.may_retry(opts) else None
    try:
        compiled, unsupported = _compile_training(gm, example_inputs, opts, names, roles)
    except BudgetError as whole:
        if retry is None:
            raise
        # Marked layers' per-token runs are in their regions' bodies: inlined, the pass sees them.
        inline_nested_regions(retry)
        if not chunk_tokens.has_runs(retry):
            raise
        log.info("megatrain: no plan fits memory_budget with the layers whole; chunking their per-token runs")
        try:
            compiled, unsupported = _compile_training(retry, example_inputs, dataclasses.replace(
                opts, token_chunks=chunk_tokens.PLANNER_CHOOSES), names, roles)
        except BudgetError as chunked:
            raise _neither_fits(whole, chunked) from None
        except MegacompileError:
            raise
        except Exception as failed:  # noqa: BLE001  (chunking is a second try: its failure leaves the first's answer)
            warnings.warn(f"megatrain: chunking this graph's per-token runs failed ({type(failed).__name__}: "
                          f"{str(failed).splitlines()[0][:200]}); the budget error below is without chunks",
                          stacklevel=2)
            raise whole from None
    if compiled is None:
        return _fallback(gm, example_inputs, opts, unsupported)
    if needs_grad:
        # Compiled: from here on the optimizer's step() runs on the host without being traced.
        params = {id(v): v for v, role in zip(example_inputs, roles) if role == "param"}
        _host_step_record(take_step_out_of_trace(params), opts)
    return compiled


def _host_step_record(opt: torch.optim.Optimizer | None, options: Options) -> None:
    """What ``inspect`` shows for an optimizer whose step() is no longer traced."""
    if opt is None:
        return

    params = [p for group in opt.param_groups for p in group["params"]]
    label = host_step_label(opt)
    text = "\n".join([
        f"# {label}: step() is not traced",
        f"# {len(opt.param_groups)} parameter group(s), {len(params)} parameters, "
        f"{sum(p.numel() for p in params):,} elements, updated on the host by the fused Adam kernel",
        "# (megacompile/optimizer/host_step.py: fused_update); lr, betas, eps and weight_decay are read from",
        "# param_groups at every call. Dynamo calls step() as one opaque function (a graph break), so",
        "# capturing the training step does not trace the update tensor by tensor.",
    ])
    record = CompiledGraph(label=label, options=options)
    record.snapshots = [GraphSnapshot("optimizer", "untraced", text, 0, 0, 0.0)]
    records.add(record)
