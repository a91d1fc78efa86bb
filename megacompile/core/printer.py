"""Prints a rewritten graph as the readable program that runs.

One line per node, with the value's dtype and shape, where it lives, its layer, and the pass
that created it when that was not the capture. Deterministic, so golden files are stable.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from megacompile.core import torch_compat as compat
from megacompile.core.node_info import has_info, info

_DTYPE = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.uint8: "u8", torch.int8: "i8",
}


def describe_value(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        shape = ", ".join(str(s) for s in val.shape)
        return f"{_DTYPE.get(val.dtype, str(val.dtype))}[{shape}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(describe_value(v) for v in val) + ")"
    if isinstance(val, torch.SymInt):
        return f"sym {val}"
    return type(val).__name__ if val is not None else "none"


def target_name(node: fx.Node) -> str:
    """How the program text names the node's op: ``aten.sum.dim_IntList``, ``megatrain.load``."""
    t = node.target
    if isinstance(t, compat.OpOverload):
        ns = t.namespace
        name = t._schema.name.split("::")[-1]
        overload = t._overloadname
        return f"{ns}.{name}" + ("" if overload == "default" else f".{overload}")
    if isinstance(t, compat.HigherOrderOperator):
        return f"higher_order.{t.__name__}"
    return getattr(t, "__name__", str(t))


def _fmt_arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, str):
        return repr(a)
    if isinstance(a, torch.dtype):
        return str(a)
    return repr(a)


def _comment(node: fx.Node) -> str:
    parts = [describe_value(node.meta.get("val", node.meta.get("example_value")))]  # (Dynamo's graph: example_value)
    if has_info(node):
        ni = info(node)
        parts.append(ni.placement)
        if ni.layer:
            parts.append(ni.layer)
        if ni.phase == "recompute":
            parts.append("recompute")
        if ni.created_by != "capture":
            parts.append(f"by {ni.created_by}")
        if ni.decision:
            parts.append(f"{ni.decision}: {ni.reason}" if ni.reason else ni.decision)
        if ni.head_fusion:
            parts.append(f"lm head {ni.head_fusion}")
        if ni.token_chunks:
            parts.append(ni.token_chunks)
        if ni.attention_mask:
            parts.append(f"attention mask {ni.attention_mask}")
    return "  # " + " | ".join(parts)


def format_graph(gm: fx.GraphModule, title: str) -> str:
    lines = [f"# {title}"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    lines.append("def program(")
    for p in placeholders:
        src = info(p).source if has_info(p) else None
        role = info(p).role if has_info(p) else "input"
        lines.append(f"    {p.name},{_comment(p)} | {role}" + (f" {src}" if src else ""))
    lines.append("):")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            lines.append(f"    return {_fmt_arg(node.args[0])}")
            continue
        if node.op == "get_attr":
            lines.append(f"    {node.name} = self.{node.target}{_comment(node)}")
            continue
        args = [_fmt_arg(a) for a in node.args] + [f"{k}={_fmt_arg(v)}" for k, v in node.kwargs.items()]
        call = f"{target_name(node)}({', '.join(args)})"
        if node.meta.get("val") is None and not node.users and node.op == "call_function":
            lines.append(f"    {call}{_comment(node)}")
        else:
            lines.append(f"    {node.name} = {call}{_comment(node)}")
    return "\n".join(lines) + "\n"
