"""The host optimizer: stock Adam / AdamW steps run by the fused host kernel.

Dynamo captures a stock ``torch.optim`` optimizer's ``step`` as its own graph, which the
backend runs on the host (``backend._host_region``). For Adam and AdamW that graph is a
long chain of small per-tensor ops; ``fused_step_for`` recognises it and returns a callable
that performs the same update with the fused, vectorized kernel of
``megacompile.runtime.host_adam`` (one pass over memory per parameter group).

Recognising the graph: its ``get_attr`` tensors are the optimizer's parameters and state
(Dynamo keeps the objects themselves), so the optimizer is the live ``torch.optim.Adam`` /
``AdamW`` whose parameters they are. Hyperparameters are read from ``param_groups`` at every
call, so an LR scheduler's change takes effect without recompiling this part. Anything the
kernel does not implement (amsgrad, capturable, differentiable, non-fp32 or non-contiguous
state) keeps the captured graph.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx

from megacompile.core import torch_compat as compat
from megacompile.core.host_memory import check_host_allocation
from megacompile.optimizer import eager_update_watch
from megacompile.optimizer.ownership import fused_kernel_runs, optimizer_of, optimizer_of_graph
from megacompile.report import RECORDER
from megacompile.runtime import trace
from megacompile.runtime.data_parallel import group_of, share_updated
from megacompile.runtime.host_adam import fused_adam_step, host_adam_available


def _scalar_dtype() -> torch.dtype:
    # torch.optim keeps ``state["step"]`` in float64 when that is the default dtype.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def init_adam_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """The state a stock Adam / AdamW creates at a parameter's first step (non-fused,
    non-capturable): a zero step counter on the host and zero moments shaped like ``p``."""
    state = opt.state[p]
    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def fused_update(opt: torch.optim.Optimizer) -> None:
    """One step of a supported Adam / AdamW (``fused_kernel_runs``) with the fused host kernel, group
    by group, over the parameters that have a gradient, as ``opt.step()`` does.

    Hyperparameters are read from ``param_groups`` now, so a scheduler's change applies. A
    parameter without state gets it as torch.optim would create it. On meta parameters (a
    plan traced without memory) there are no values to update: the state is created and the
    step counters advance, nothing else.
    """
    decoupled_default = isinstance(opt, torch.optim.AdamW)
    # A data-parallel model whose optimizer is sharded: this rank updates (and keeps state
    # for) only the parameters it owns; the others arrive from their owners afterwards.
    replicas = group_of(p for group in opt.param_groups for p in group["params"])
    sharded = replicas if replicas is not None and replicas.shards_optimizer and replicas.world_size > 1 else None
    mine = (lambda p: p.grad is not None) if sharded is None else (lambda p: p.grad is not None and sharded.owns(p))
    # The moments of every parameter that has none yet, checked against the host's free
    # memory before the first is allocated (AdamW's state is the largest host allocation).
    new_state = sum(2 * p.numel() * p.element_size() for group in opt.param_groups for p in group["params"]
                    if mine(p) and not opt.state[p] and p.device.type != "meta")
    check_host_allocation(new_state, f"{type(opt).__name__}'s state (exp_avg and exp_avg_sq of each parameter)")
    for group in opt.param_groups:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if not mine(p):
                continue
            state = opt.state[p] or init_adam_state(opt, p)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            continue
        if params[0].device.type == "meta":
            with torch.no_grad():
                for step in steps:
                    step += 1
            continue
        beta1, beta2 = group["betas"]
        with torch.no_grad():
            fused_adam_step(
                params, grads, exp_avgs, exp_avg_sqs, steps,
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                decoupled=bool(group.get("decoupled_weight_decay", decoupled_default)),
                maximize=bool(group.get("maximize", False)),
            )
    if sharded is not None:
        share_updated(sharded, [p for group in opt.param_groups for p in group["params"] if p.grad is not None])


_warned_unavailable = False


def kernel_available() -> bool:
    """Whether the fused host Adam kernel runs here (building it on first use). Where it cannot
    (no C++ compiler, a failed build), one warning says why: the optimizer's own step runs."""
    global _warned_unavailable
    status = host_adam_available()
    if not status and not _warned_unavailable:
        _warned_unavailable = True
        warnings.warn(f"megatrain: the fused host AdamW kernel is not available ({status.reason}); the optimizer's "
                      "own step runs instead (correct, slower, and not overlapped with the backward)", stacklevel=2)
    return bool(status)


def fused_step_for(gm: fx.GraphModule) -> Callable[..., Any] | None:
    """A fused replacement for a captured Adam / AdamW step graph, or None to keep the graph."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    if output.args[0] not in ((), [], None):
        return None
    opt = optimizer_of_graph(gm)
    if opt is None or not fused_kernel_runs(opt):
        return None

    if not kernel_available():
        return None

    def fused_step(*_graph_inputs: Any) -> tuple:
        # The graph's inputs are the parameters' .grad tensors; read them from the
        # optimizer, group by group, like torch.optim does.
        fused_update(opt)
        return ()

    fused_step.optimizer = opt
    return fused_step


# --- the step taken out of Dynamo's trace -----------------------------------------------------
#
# Dynamo traces a stock optimizer's ``step()`` tensor by tensor: for AdamW on CPU parameters
# some fifteen ops per parameter, every parameter, gradient and state tensor a graph input. The
# backend then throws that graph away and runs the fused kernel instead (``fused_step_for``).
# That capture was 0.21 s of the 0.41 s a compile grew per marked decoder layer (2 cores;
# benchmarks/compile_time.py --breakdown, table (h)). So once a training graph has compiled, its
# optimizer's ``step`` is replaced, on the instance, by a function Dynamo does not trace
# (``torch.compiler.disable``): Dynamo calls it as one opaque call (a graph break) and it runs
# ``fused_update``. This is what torch's own LR schedulers do to count steps (an instance
# ``step`` that sets ``_opt_called``), and the replacement keeps that bookkeeping, so a
# scheduler made before or after it works as before.

HOST_STEP_MARK = "_megatrain_host_step"
# Meta parameters too: ``megacompile plan`` and the compile-time benchmark trace steps on them.
_HOST_STEP_DEVICES = ("cpu", "meta")


def has_host_step(opt: torch.optim.Optimizer) -> bool:
    return bool(getattr(vars(opt).get("step"), HOST_STEP_MARK, False))


def host_step_label(opt: torch.optim.Optimizer) -> str:
    return f"optimizer (host, fused {type(opt).__name__})"


def _step_can_leave_the_trace(opt: torch.optim.Optimizer) -> bool:
    if not (fused_kernel_runs(opt, _HOST_STEP_DEVICES) and compat.step_is_stock(opt)
            and not compat.optimizer_has_step_hooks(opt)):
        return False
    # Meta parameters need no kernel (and loading it takes seconds: not for `megacompile plan`).
    on_meta = all(p.device.type == "meta" for group in opt.param_groups for p in group["params"])
    return on_meta or kernel_available()


def take_step_out_of_trace(params: dict[int, torch.Tensor]) -> torch.optim.Optimizer | None:
    """Give the one optimizer of ``params`` (by id) a ``step`` Dynamo does not trace, which
    runs the fused host kernel; returns that optimizer, or None where nothing was changed:
    no optimizer, two, one the kernel does not run (``fused_kernel_runs``), a ``step`` the user
    overrode, step hooks, or no kernel. Done once per optimizer."""
    opt = optimizer_of(params)
    if opt is None or has_host_step(opt) or not _step_can_leave_the_trace(opt):
        return None
    # What it replaces is the class's step, or the LR scheduler's wrapper that counts calls
    # and then runs the class's step (``step_is_stock``); this does both. It holds the
    # optimizer weakly, as that wrapper does (no reference cycle). ``Optimizer.__getstate__``
    # leaves instance attributes out, so a copied or unpickled optimizer has the stock step.
    opt_ref = weakref.ref(opt)
    label = host_step_label(opt)

    @torch.compiler.disable
    def step(closure=None):
        me = opt_ref()
        compat.note_optimizer_step_called(me)
        if closure is not None or compat.optimizer_has_step_hooks(me) or not fused_kernel_runs(me, _HOST_STEP_DEVICES):
            # What the kernel does not do (a closure, hooks, a setting changed since): the
            # stock step, run eagerly, as Dynamo runs a step it cannot capture.
            return type(me).step(me, closure)
        _run_host_step(me, label)
        return None

    setattr(step, HOST_STEP_MARK, True)
    compat.set_instance_step(opt, step)
    return opt


def _run_host_step(opt: torch.optim.Optimizer, label: str) -> None:
    with trace.span("host optimizer", label):
        fused_update(opt)
    eager_update_watch.host_step_ran()
    RECORDER.host_graph_ran(label, opt)
