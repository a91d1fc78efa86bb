"""Which optimizer owns a graph's parameters, and whether the fused host kernel can run it.

Found by a scan of live objects (``gc.get_objects``): Dynamo hands the backend tensors, not
the optimizer, and a user's step may be compiled before or after the optimizer is made.
"""
from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator

import torch
import torch.fx as fx


def optimizer_of(tensors: dict[int, torch.Tensor]) -> torch.optim.Optimizer | None:
    """The one live optimizer holding any of ``tensors`` (by id), or None (none, or two).

    A wrapper that is an ``Optimizer`` itself and delegates to the one it holds as
    ``.optimizer`` (accelerate's ``AcceleratedOptimizer``, which the Hugging Face Trainer
    steps) is not a second optimizer: the wrapped one is the owner."""
    found = {}
    for obj in _live_optimizers():
        params = [p for group in obj.param_groups for p in group["params"]]
        if params and any(id(p) in tensors for p in params):
            found[id(obj)] = obj
    owners = [obj for obj in found.values() if id(vars(obj).get("optimizer")) not in found]
    return owners[0] if len(owners) == 1 else None  # two optimizers share these tensors: do not guess


def _live_optimizers() -> Iterator[torch.optim.Optimizer]:
    """Every live ``Optimizer`` instance, found without a Python loop over every object (a
    process holds millions): the distinct types first, then the objects of the optimizer
    types among them. ``type()``: no ``__class__`` property runs."""
    objects = gc.get_objects()
    kinds = {t for t in set(map(type, objects)) if issubclass(t, torch.optim.Optimizer)}
    return itertools.compress(objects, map(kinds.__contains__, map(type, objects)))


def fused_kernel_runs(opt: torch.optim.Optimizer, devices: tuple[str, ...] = ("cpu",)) -> bool:
    """The fused kernel runs ``opt``'s update: a stock Adam / AdamW without amsgrad,
    capturable or differentiable, over contiguous fp32 parameters on ``devices``."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    for group in opt.param_groups:
        if group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
            return False
        for p in group["params"]:
            if p.dtype != torch.float32 or p.device.type not in devices or not p.is_contiguous():
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
