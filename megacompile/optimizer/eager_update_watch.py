"""Notices an optimizer step that ran outside megatrain, and says so once.

A stock optimizer's ``step()`` reaches the backend as a graph and runs on the host through
``backend._host_region`` (fused for Adam / AdamW), or inside the backward when it overlaps.
A custom optimizer Dynamo cannot capture (data-dependent Python, ``.item()``,
``torch._dynamo.disable``) never reaches the backend: Dynamo runs it eagerly. That is correct
(it runs on the host parameters, which is where they live) but neither fused nor overlapped,
so the user should hear it once, in one line.

How it is noticed: the parameters' in-place version counters are recorded when a backward
ends and whenever a megatrain host graph runs; if they moved by the next forward and no
megatrain host graph ran in between, something outside the compiled program updated them.
"""
from __future__ import annotations

import warnings

import torch

from megacompile.core import torch_compat as compat
from megacompile.optimizer.ownership import optimizer_of

_host_steps = 0  # megatrain host graphs run so far
_warned: set[type] = set()


def host_step_ran() -> None:
    global _host_steps
    _host_steps += 1


class EagerUpdateWatch:
    """One per compiled training graph: its parameters' versions since its last backward."""

    def __init__(self) -> None:
        self._versions: dict[int, int] | None = None
        self._host_steps_then = 0

    def backward_finished(self, params: dict[int, torch.Tensor]) -> None:
        self._versions = {id(p): compat.tensor_version(p) for p in params.values()}
        self._host_steps_then = _host_steps

    def forward_starting(self, params: dict[int, torch.Tensor]) -> None:
        versions, self._versions = self._versions, None
        if versions is None or _host_steps != self._host_steps_then:
            return
        changed = [p for p in params.values() if id(p) in versions and compat.tensor_version(p) != versions[id(p)]]
        if not changed:
            return
        opt = optimizer_of({id(p): p for p in changed})
        if opt is None or type(opt) in _warned:
            return
        _warned.add(type(opt))
        warnings.warn(
            f"megatrain: {type(opt).__name__}.step() ran eagerly on the host, outside the compiled program "
            f"(Dynamo could not capture it, or it is not inside the compiled function): results are correct, "
            f"but the update is neither fused nor overlapped with the device",
            stacklevel=2,
        )
