"""The optimizer's state as ``torch.distributed.checkpoint`` (DCP) saves and loads it.

A data-parallel model's parameters are the same on every rank (``model.state_dict()`` is a
replicated entry DCP writes once); a sharded optimizer's state is not: each rank holds its
own parameters' moments. ``optimizer_state_dict`` names each state tensor by its parameter's
name (``state.layers.0.weight.exp_avg``) and lists only what this rank holds, so DCP writes
each shard from its owner; loading asks, on each rank, for the parameters it owns now, which
DCP reads from whichever rank wrote them: a checkpoint resumes on any number of ranks.

    state = {"model": model.state_dict(), "optim": megacompile.optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)                # every rank
    ...
    state = {"model": model.state_dict(), "optim": megacompile.optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)                # loads in place, on every rank
    megacompile.load_optimizer_state_dict(model, opt, state["optim"])
"""
from __future__ import annotations

from typing import Any

import torch

from megacompile.core.errors import DataParallelError
from megacompile.runtime.data_parallel import group_of

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _named_params(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[int, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise DataParallelError("megacompile.optimizer_state_dict: the optimizer holds a parameter that is "
                                        "not one of the model's (pass the model the optimizer trains)")
    return names


def optimizer_state_dict(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Adam / AdamW state by parameter name: this rank's shard with a sharded optimizer
    (``megacompile.data_parallel(..., shard_optimizer=True)``), every parameter's otherwise.
    A parameter without state yet gets zero moments and step 0 (what its first step would
    start from), so the same call makes the template that ``dcp.load`` fills in."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        raise DataParallelError(f"megacompile.optimizer_state_dict supports Adam and AdamW, not {type(opt).__name__}")
    names = _named_params(model, opt)
    replicas = group_of(p for g in opt.param_groups for p in g["params"])
    state: dict[str, dict[str, torch.Tensor]] = {}
    groups = []
    for group in opt.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            if replicas is not None and not replicas.owns(p):
                continue
            s = opt.state.get(p) or {}
            state[names[id(p)]] = {
                "step": s["step"] if "step" in s else torch.tensor(0.0),
                **{m: s[m] if m in s else torch.zeros_like(p) for m in _MOMENTS},
            }
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(model: torch.nn.Module, opt: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """Puts what ``dcp.load`` read into ``loaded`` (a dict made by ``optimizer_state_dict``)
    into the optimizer: the moments of the parameters this rank owns, and every group's
    hyperparameters (learning rate, betas, ... as saved)."""
    names = _named_params(model, opt)
    if len(loaded["param_groups"]) != len(opt.param_groups):
        raise DataParallelError(f"the checkpoint has {len(loaded['param_groups'])} parameter groups, the optimizer "
                                f"{len(opt.param_groups)}: build the optimizer as it was when the checkpoint was saved")
    for group, saved in zip(opt.param_groups, loaded["param_groups"]):
        if list(saved["params"]) != [names[id(p)] for p in group["params"]]:
            raise DataParallelError("a parameter group of the checkpoint holds other parameters than the "
                                    "optimizer's: build the optimizer as it was when the checkpoint was saved")
        for key, value in saved.items():
            if key != "params":
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        for p in group["params"]:
            s = loaded["state"].get(names[id(p)])
            if s is None:
                continue  # another rank's shard
            # The template's own tensors, filled in place by dcp.load (the optimizer's, where it
            # had state already): nothing is copied twice.
            opt.state[p] = {"step": s["step"], **{m: s[m] for m in _MOMENTS}}
