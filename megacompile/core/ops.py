"""The explicit memory ops: a ``torch.library`` namespace ``megatrain``.

Passes insert these into FX graphs; the streaming runtime executes them (it dispatches on
the op, see ``megacompile.runtime.executor``). The kernels registered here are plain,
synchronous reference implementations, so a rewritten GraphModule is still runnable on its
own (tests and debugging); fake kernels make shape propagation work.

Every op is registered as side-effecting: no dead-code elimination may drop an ``evict`` or a
``wait`` whose result nobody reads.

| op | meaning |
| --- | --- |
| load(host, name) -> device | start a host -> device copy into a pooled slot |
| offload(device, name) -> host | start a device -> host copy (a gradient or an output) |
| wait(t) | block the compute lane until the copy that produced ``t`` has landed |
| evict(t) | the device copy ``t`` is dead; its slot returns to the pool |
"""
from __future__ import annotations

import torch
import torch.fx

LIB_NAME = "megatrain"
_lib = torch.library.Library(LIB_NAME, "DEF")

_lib.define("load(Tensor host, str name) -> Tensor")
_lib.define("offload(Tensor device, str name) -> Tensor")
_lib.define("wait(Tensor t) -> ()")
_lib.define("evict(Tensor t) -> ()")


def _load_ref(host: torch.Tensor, name: str) -> torch.Tensor:
    return host.clone()


def _offload_ref(device: torch.Tensor, name: str) -> torch.Tensor:
    return device.clone()


def _noop(t: torch.Tensor) -> None:
    return None


for _op, _fn in (("load", _load_ref), ("offload", _offload_ref), ("wait", _noop), ("evict", _noop)):
    _lib.impl(_op, _fn, "CompositeExplicitAutograd")


def _fake_copy(t: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


torch.library.register_fake(f"{LIB_NAME}::load", _fake_copy, lib=_lib)
torch.library.register_fake(f"{LIB_NAME}::offload", _fake_copy, lib=_lib)
torch.library.register_fake(f"{LIB_NAME}::wait", _noop, lib=_lib)
torch.library.register_fake(f"{LIB_NAME}::evict", _noop, lib=_lib)

load = torch.ops.megatrain.load.default
offload = torch.ops.megatrain.offload.default
wait = torch.ops.megatrain.wait.default
evict = torch.ops.megatrain.evict.default

MEMORY_OPS = (load, offload, wait, evict)

for _op in MEMORY_OPS:
    torch.fx.node.has_side_effect(_op)


def is_memory_op(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in MEMORY_OPS
