"""canonical_operators: one spelling for Python's operators on tensors in Dynamo's graph.

Dynamo records ``a == b`` on tensors as ``call_function operator.eq`` in torch 2.13, but torch
2.11 records some of them as ``call_method __eq__`` (measured on an H100 machine with torch
2.11: Hugging Face's causal mask came through as ``eq (call_method __eq__)``, the mask
interpreter did not know that spelling, and a 131k x 131k mask stayed in every layer). The
passes after this one (``elide_causal_mask``, ``fuse_lm_head``, ``chunk_tokens``) match
operators by their ``operator`` function; this pass turns each dunder method call into that
function, in place (same node, same meta), so they see one spelling whatever torch traced.

A reflected method swaps its operands: ``a.__rsub__(b)`` is ``operator.sub(b, a)``. A call
with keyword arguments or an unexpected number of operands is left as it is.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from megacompile.core import torch_compat as compat
from megacompile.passes.contract import PassContract

CONTRACT = PassContract(name="canonical_operators", stages=("dynamo",), provides=frozenset({"operators_canonical"}))

_BINARY = {
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
    "ge": operator.ge, "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow, "matmul": operator.matmul,
    "and": operator.and_, "or": operator.or_, "xor": operator.xor, "lshift": operator.lshift,
    "rshift": operator.rshift, "getitem": operator.getitem,
}
_UNARY = {"neg": operator.neg, "pos": operator.pos, "invert": operator.invert, "abs": operator.abs}
# Comparisons have no reflected methods (Python reflects ``2 < t`` as ``t.__gt__(2)``); getitem has none.
_REFLECTED = {name for name in _BINARY if name not in ("eq", "ne", "lt", "le", "gt", "ge", "getitem")}

# method name -> (operator function, operand count, operands swapped)
METHODS: dict[str, tuple] = {
    **{f"__{name}__": (fn, 2, False) for name, fn in _BINARY.items()},
    **{f"__r{name}__": (_BINARY[name], 2, True) for name in _REFLECTED},
    **{f"__{name}__": (fn, 1, False) for name, fn in _UNARY.items()},
}


def canonicalize(node: fx.Node) -> bool:
    """Rewrites one ``call_method __op__`` node into ``call_function operator.op``; True if it did."""
    if node.op != "call_method" or node.target not in METHODS or node.kwargs:
        return False
    fn, operands, swapped = METHODS[node.target]
    if len(node.args) != operands:
        return False
    node.op, node.target = "call_function", fn
    if swapped:
        node.args = (node.args[1], node.args[0])
    return True


def run(gm: fx.GraphModule, ctx) -> None:
    # The bodies of marked layers too (nested_compile_region): elide_causal_mask reads the
    # masks their attention calls are passed through them.
    for module in (gm, *compat.region_calls(gm)):
        if sum(canonicalize(node) for node in module.graph.nodes):
            module.graph.lint()
            module.recompile()
