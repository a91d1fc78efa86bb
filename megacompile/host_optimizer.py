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

import gc
from typing import Any, Callable

import torch
import torch.fx as fx


def optimizer_of(tensors: dict[int, torch.Tensor]) -> torch.optim.Optimizer | None:
    """The one live optimizer holding any of ``tensors`` (by id), or None (none, or two)."""
    found = None
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.optim.Optimizer):  # type(): no __class__ properties run
            params = [p for group in obj.param_groups for p in group["params"]]
            if params and any(id(p) in tensors for p in params):
                if found is not None and found is not obj:
                    return None  # two optimizers share these tensors: do not guess
                found = obj
    return found


def _supported(opt: torch.optim.Optimizer) -> bool:
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    for group in opt.param_groups:
        if group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
            return False
        for p in group["params"]:
            if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
                return False
    return True


def optimizer_of_graph(gm: fx.GraphModule) -> torch.optim.Optimizer | None:
    """The live optimizer whose parameters or state a captured host graph holds, if one."""
    attrs = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if isinstance(value, torch.Tensor):
                attrs[id(value)] = value
    return optimizer_of(attrs) if attrs else None


def fused_step_for(gm: fx.GraphModule) -> Callable[..., Any] | None:
    """A fused replacement for a captured Adam / AdamW step graph, or None to keep the graph."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    if output.args[0] not in ((), [], None):
        return None
    opt = optimizer_of_graph(gm)
    if opt is None or not _supported(opt):
        return None
    from megacompile.runtime.host_adam import fused_adam_step, host_adam_available

    if not host_adam_available():
        return None
    decoupled_default = isinstance(opt, torch.optim.AdamW)

    def fused_step(*_graph_inputs: Any) -> tuple:
        # The graph's inputs are the parameters' .grad tensors; read them from the
        # optimizer, group by group, like torch.optim does.
        for group in opt.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = opt.state[p]
                if not state:  # first step of a parameter the graph never initialised
                    raise RuntimeError("optimizer state missing for a parameter with a gradient")
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not params:
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
        return ()

    fused_step.optimizer = opt
    return fused_step
