"""What the passes know about a node, under one documented key: ``node.meta["megatrain"]``.

Every pass reads and writes ``NodeInfo``; nothing else in ``node.meta`` is ours.
(``node.meta["val"]`` stays the fake tensor PyTorch put there: shapes, dtypes and strides.
Where a value lives is ``NodeInfo.placement``, because the fake tensors of a captured graph
all claim the device the user's model is on, the host.)

Fields
- ``layer``: the repeated block the node belongs to (``layers.3``), the module path for
  non-repeated modules (``lm_head``), or None for glue code outside any module.
- ``role``: param | input | tangent | saved | compute | memory | output.
- ``phase``: forward | backward | recompute (a forward op replayed in backward).
- ``placement``: host | device.
- ``nbytes``: bytes of the tensor(s) the node produces (int, or a sympy expression when
  shapes are symbolic); 0 for views and non-tensors. ``nbytes_hint``: the same at the
  traced example's sizes.
- ``source``: for inputs, the user's name (``layers.3.mlp.up.weight``, ``x``).
- ``created_by``: the pass that inserted the node (``capture`` for nodes from the trace).
- ``decision`` / ``reason``: the plan's decision for this value and why (save / offload /
  recompute / stream / resident), shown by ``megacompile inspect``. Decisions the planner
  made per saved activation or per parameter give its price in the reason (``planner:
  offload frees 4.00 KiB ... for <time> of copies``, ``small and read by both passes``).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import sympy
import torch
import torch.fx as fx

from megacompile.core.enums import Phase, Placement, Role
from megacompile.core.torch_compat import OpOverload, int_hint

META_KEY = "megatrain"

# node.meta key on every inlined copy: (the body's attribute name, the body node's name). The
# copies of one body node in every layer share it, which is how a decision made for one
# layer of a template (``plan/template_planner.py``) names the same value in every other layer.
BODY_NODE = "megatrain_body_node"


@dataclasses.dataclass
class NodeInfo:
    layer: str | None = None
    role: Role = Role.COMPUTE
    phase: Phase = Phase.FORWARD
    placement: Placement = Placement.DEVICE
    nbytes: Any = 0
    # ``nbytes`` evaluated at the traced example's sizes (what comparisons and peaks use).
    nbytes_hint: int = 0
    source: str | None = None
    created_by: str = "capture"
    decision: str | None = None
    reason: str | None = None
    head_fusion: str | None = None
    workspace_bytes: int = 0
    # A token-chunked run (passes/chunk_tokens.py): what it replaced and into how many chunks.
    token_chunks: str | None = None
    # On attention ops: whether passes/elide_causal_mask.py proved the mask causal, or why not.
    attention_mask: str | None = None

    def copy(self) -> "NodeInfo":
        """A shallow copy, as ``copy.copy`` makes, without its pickling protocol (annotate
        copies every node's NodeInfo in every graph the planner builds)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new


def info(node: fx.Node) -> NodeInfo:
    """The node's NodeInfo, created empty on first access."""
    found = node.meta.get(META_KEY)
    if found is None:
        found = NodeInfo()
        node.meta[META_KEY] = found
    return found


def has_info(node: fx.Node) -> bool:
    return META_KEY in node.meta


# --- sizes ------------------------------------------------------------------------------
def _to_expr(x: Any) -> Any:
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return int(x)


def tensor_nbytes(val: Any) -> Any:
    """Bytes of a (fake) tensor or a tuple of them; sympy where shapes are symbolic."""
    if isinstance(val, torch.Tensor):
        return _to_expr(val.numel()) * val.element_size()
    if isinstance(val, (tuple, list)):
        total: Any = 0
        for v in val:
            total = total + tensor_nbytes(v)
        return total
    return 0


def tensor_nbytes_hint(val: Any) -> int:
    """Bytes of a (fake) tensor or tuple at the sizes of the example it was traced with."""
    if isinstance(val, torch.Tensor):
        return int_hint(val.numel()) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(tensor_nbytes_hint(v) for v in val)
    return 0


def set_nbytes(ni: "NodeInfo", val: Any) -> None:
    ni.nbytes = tensor_nbytes(val)
    ni.nbytes_hint = tensor_nbytes_hint(val)


def size_hint(nbytes: Any) -> int:
    """A concrete byte count from an int or a constant sympy expression."""
    if isinstance(nbytes, sympy.Expr):
        if nbytes.is_number:
            return int(nbytes)
        raise ValueError(f"symbolic size {nbytes} has no concrete value here; use NodeInfo.nbytes_hint")
    return int(nbytes)


def is_tensor_node(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def is_view_node(node: fx.Node) -> bool:
    """Ops whose output aliases an input's storage (views), so they allocate nothing."""
    if node.op != "call_function":
        return False
    target = node.target
    view = _IS_VIEW.get(target)
    if view is None:  # decided once per target (the planner asks millions of times)
        view = isinstance(target, _compat_op_overload()) and (target in _UNDECLARED_VIEWS or any(
            r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns))
        _IS_VIEW[target] = view
    return view


_IS_VIEW: dict = {}


# Ops whose schema promises a fresh tensor but whose kernels return a view of the input
# (AOTAutograd emits _unsafe_view for reshapes of contiguous intermediates).
_UNDECLARED_VIEWS = {torch.ops.aten._unsafe_view.default}


# --- names ------------------------------------------------------------------------------
# The root local or global, with the tuple / dict indexing right after it: a module reached
# through ``*args`` (a decorated ``forward(*args, **kwargs)``) is ``L['args'][0]``; a module's
# own children are attributes (``L['blocks'].0``), never subscripts.
_ROOT = re.compile(r"^[LG]\['[^']*'\](?:\[\d+\]|\['[^']*'\])*")
_MODULE_TOKENS = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]")


@functools.lru_cache(maxsize=65536)  # pure; asked once per node of every graph the planner builds
def normalize_module_path(path: str) -> str:
    """``G['model'].layers.0.fc`` / ``L['self'].layers[0]`` / ``L['args'][0].layers.0.fc`` -> ``layers.0.fc``."""
    path = _ROOT.sub("", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def root_name(source: str) -> str | None:
    """The local or global a Dynamo source or module path starts from: ``L['policy']...`` ->
    ``policy``, ``L['args'][0]...`` -> ``args.0``; None without one."""
    m = _ROOT.match(source)
    if m is None:
        return None
    name, _, subscripts = m.group(0)[3:].partition("']")
    keys = ["".join(key) for key in _SUBSCRIPT.findall(subscripts)]
    return ".".join([name, *keys])


_SUBSCRIPT = re.compile(r"\[(\d+)\]|\['([^']*)'\]")


def module_root(source: str) -> str | None:
    """The root of a source that reaches a module's parameter or buffer, else None."""
    return root_name(source) if _MODULE_TOKENS.search(source) else None


def source_to_name(source: str, keep_root: bool = False) -> str:
    """A Dynamo input source -> the user's name for it, the path its module stack names too.

    ``G['model']._modules['layers']._modules['0']._parameters['weight']`` -> ``layers.0.weight``;
    ``L['self'].model._modules['fc']._parameters['weight']`` (a module in a plain object's
    attribute) -> ``model.fc.weight``; ``L['x']`` -> ``x``. ``keep_root``: the root too
    (``policy.layers.0.weight``), for a graph that reads parameters of several roots.
    """
    if _MODULE_TOKENS.search(source):
        m = _ROOT.match(source)
        rest = _MODULE_TOKENS.sub(lambda t: "." + t.group(1), source[m.end():] if m else source)
        name = normalize_module_path(rest)
        root = root_name(source) if keep_root else None
        return f"{root}.{name}" if root else name
    m = re.fullmatch(r"[LG]\['([^']+)'\](.*)", source)
    if m:
        rest = normalize_module_path(m.group(2))
        return f"{m.group(1)}.{rest}" if rest else m.group(1)
    return re.sub(r"[^0-9A-Za-z_.]", "_", source)


def qualify_module_stacks(gm) -> None:
    """Module paths that keep their root (``L['policy'].model.layers.0`` -> ``policy.model.layers.0``),
    for a graph that reads the parameters of several roots (a policy and its reference model
    in DPO, a teacher and a student): without the root their layers would share names."""
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {
                key: (_qualified(path), kind) for key, (path, kind) in stack.items()}


def _qualified(path: str) -> str:
    root = root_name(path)
    rest = normalize_module_path(path)
    return path if root is None else f"{root}.{rest}" if rest else root


@functools.lru_cache(maxsize=65536)
def layer_of_module_path(path: str) -> str | None:
    """The repeated block a module path belongs to.

    The prefix through the first numeric component (``model.layers.3`` for
    ``model.layers.3.mlp.up``); for modules outside a ModuleList, the module's own path.
    """
    if not path:
        return None
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return path


def identifier(name: str) -> str:
    """A readable identifier from a dotted name: ``layers.3.mlp.up.weight`` -> ``layers_3_mlp_up_weight``."""
    return re.sub(r"[^0-9A-Za-z_]", "_", name)


def _compat_op_overload():
    return OpOverload
