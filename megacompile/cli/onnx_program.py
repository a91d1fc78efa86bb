"""A rewritten program as an ONNX model (``megacompile inspect SCRIPT --format onnx --out DIR``).

Built node by node from the FX graph that runs, in its order, so Netron shows the program
``inspect`` prints: memory ops as nodes of the domain ``megatrain`` (attributes ``tensor``,
``layer``, ``bytes``, ...; ``wait`` and ``evict`` have no outputs, their place is their
meaning), aten ops as standard ONNX ops where ``onnx_ops.STANDARD`` maps them, every other op
as a node of the domain ``aten`` named after it, its non-tensor arguments as attributes. Each
node's ``metadata_props`` name its FX node, layer, placement, phase and creating pass. The
mapping is described in docs/onnx_and_plots.md. Nothing here runs the model.
"""
from __future__ import annotations

import operator
import os
from typing import Any

import onnx
import torch
import torch.fx as fx
from onnx import AttributeProto, TensorProto, helper

from megacompile.cli.onnx_ops import ONNX_DTYPES, STANDARD, onnx_dtype, value_of
from megacompile.core import ops
from megacompile.core import torch_compat as compat
from megacompile.core.node_info import has_info, info, tensor_nbytes_hint
from megacompile.core.printer import target_name

OPSET = 20
MEMORY_DOMAIN = "megatrain"
ATEN_DOMAIN = "aten"
PYTHON_DOMAIN = "fx"


def _dim(size: Any) -> int | str:
    """A dimension: a number, or a symbolic size's expression (an ONNX named dimension)."""
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if expr.is_number else str(expr)
    return int(size)


def _value_info(name: str, val: Any) -> onnx.ValueInfoProto | None:
    if isinstance(val, torch.Tensor) and val.dtype in ONNX_DTYPES:
        return helper.make_tensor_value_info(name, onnx_dtype(val.dtype), [_dim(s) for s in val.shape])
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
        return helper.make_tensor_value_info(name, TensorProto.INT64, [])
    return None


def _tensor_proto(name: str, t: torch.Tensor) -> onnx.TensorProto:
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return helper.make_tensor(name, onnx_dtype(t.dtype), list(t.shape), raw, raw=True)


class _Program:
    """The ONNX graph being built from one FX graph."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self.domains: set[str] = set()
        self.current: fx.Node | None = None  # the FX node being converted (metadata of what it emits)
        self.emitted: dict[str, int] = {}  # FX node name -> ONNX nodes emitted for it

    # --- names and constants ------------------------------------------------------------
    @staticmethod
    def name(arg: Any) -> str:
        return arg.name if isinstance(arg, fx.Node) else ""

    def const(self, suffix: str, value: Any, dtype: torch.dtype) -> str:
        """An initializer for a Python number or list the op takes as a tensor input."""
        name = f"{self.current.name}__{suffix}"
        self.initializers.append(_tensor_proto(name, torch.tensor(value, dtype=dtype)))
        return name

    def ints(self, suffix: str, values: list[int]) -> str:
        return self.const(suffix, [int(v) for v in values], torch.int64)

    # --- emitting -----------------------------------------------------------------------
    def emit(self, op_type: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs: Any) -> None:
        # The node is named after its FX node; a second ONNX node of one FX node gets a suffix.
        fx_name = self.current.name
        count = self.emitted.get(fx_name, 0)
        self.emitted[fx_name] = count + 1
        node = helper.make_node(op_type, inputs, outputs, name=fx_name if count == 0 else f"{fx_name}/{count}",
                                domain=domain or None)
        for key, value in attrs.items():
            node.attribute.append(_attribute(key, value))
        fx_node = self.current
        props = {"fx_node": fx_node.name, "fx_target": target_name(fx_node)}
        if has_info(fx_node):
            ni = info(fx_node)
            props.update(layer=ni.layer or "", placement=str(ni.placement), phase=str(ni.phase),
                         created_by=ni.created_by)
            if ni.decision:
                props["decision"] = ni.decision
            if ni.reason:
                props["reason"] = ni.reason
        for key, value in props.items():
            node.metadata_props.add(key=key, value=value)
        if domain:
            self.domains.add(domain)
        self.nodes.append(node)


def _attribute(key: str, value: Any) -> onnx.AttributeProto:
    if isinstance(value, (list, tuple)) and not value:
        return helper.make_attribute(key, [], attr_type=AttributeProto.INTS)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        if all(isinstance(v, int) for v in value):
            return helper.make_attribute(key, [int(v) for v in value])
        return helper.make_attribute(key, [float(v) for v in value])
    if isinstance(value, (list, tuple)):
        return helper.make_attribute(key, [_attr_text(v) for v in value])
    if isinstance(value, (bool, int)):
        return helper.make_attribute(key, int(value))
    if isinstance(value, float):
        return helper.make_attribute(key, value)
    return helper.make_attribute(key, _attr_text(value))


def _attr_text(value: Any) -> str:
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_attr_text(v) for v in value) + "]"
    return str(value)


# --- memory ops --------------------------------------------------------------------------

def memory_op_attributes(node: fx.Node) -> dict[str, Any]:
    """The attributes a memory op's ONNX node carries (tensor, layer, bytes, ...)."""
    moved = node if node.target in (ops.load, ops.offload) else node.args[0]
    if moved.op == "call_function" and moved.target in (ops.load, ops.offload):
        tensor = moved.args[1]
    else:
        tensor = moved.name
    ni = info(node)
    attrs: dict[str, Any] = {"tensor": tensor, "layer": ni.layer or "",
                             "bytes": tensor_nbytes_hint(moved.meta.get("val")),
                             "placement": str(ni.placement), "created_by": ni.created_by}
    if ni.decision:
        attrs["decision"] = ni.decision
    if ni.reason:
        attrs["reason"] = ni.reason
    return attrs


def _memory_op(p: _Program, node: fx.Node) -> None:
    op_type = node.target._schema.name.split("::")[-1]
    outputs = [node.name] if node.target in (ops.load, ops.offload) else []
    p.emit(op_type, [p.name(node.args[0])], outputs, MEMORY_DOMAIN, **memory_op_attributes(node))


# --- everything else: the custom domains -------------------------------------------------

def _custom(p: _Program, node: fx.Node) -> None:
    target = node.target
    outputs = _output_names(node)
    if not isinstance(target, compat.OpOverload):
        inputs = [a.name for a in node.all_input_nodes]
        attrs = {f"arg{i}": a for i, a in enumerate(node.args) if a is not None}
        p.emit(getattr(target, "__name__", str(target)), inputs, outputs, PYTHON_DOMAIN, **attrs)
        return
    inputs, input_names, attrs = [], [], {}
    schema_args = target._schema.arguments
    given = {a.name: v for a, v in zip(schema_args, node.args)}
    given.update(node.kwargs)
    for arg in schema_args:
        if arg.name in given:
            value = given[arg.name]
        elif arg.has_default_value():  # spelled out, so the node says everything the op was called with
            value = arg.default_value
        else:
            continue
        if "Tensor" in str(arg.type):
            for i, v in enumerate(value if isinstance(value, (list, tuple)) else [value]):
                name = arg.name if not isinstance(value, (list, tuple)) else f"{arg.name}[{i}]"
                if isinstance(v, (bool, int, float)):  # a Python number passed as a tensor: a constant
                    inputs.append(p.const(name.replace("[", "_").rstrip("]"), v, torch.tensor(v).dtype))
                else:
                    inputs.append(p.name(v))  # "" (ONNX's missing optional input) for None
                input_names.append(name)
        elif value is not None:
            items = value if isinstance(value, (list, tuple)) else [value]
            for v in (v for v in items if isinstance(v, fx.Node)):  # a symbolic size: its value is an input too
                inputs.append(v.name)
                input_names.append(f"{arg.name}:{v.name}")
            attrs[arg.name] = value
    if target._overloadname != "default":
        attrs["overload"] = target._overloadname
    attrs["input_names"] = input_names
    p.emit(target._schema.name.split("::")[-1], inputs, outputs, ATEN_DOMAIN, **attrs)


def _output_names(node: fx.Node) -> list[str]:
    val = value_of(node)
    if isinstance(val, (tuple, list)):
        return [f"{node.name}.{i}" for i in range(len(val))]
    return [node.name] if val is not None or node.users else []


def _convert(p: _Program, node: fx.Node) -> None:
    p.current = node
    if ops.is_memory_op(node):
        _memory_op(p, node)
    elif node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        # A multi-output op's outputs are named "<op>.<index>"; the getitem names one of them.
        p.emit("Identity", [f"{node.args[0].name}.{node.args[1]}"], [node.name])
    elif not (node.target in STANDARD and STANDARD[node.target](p, node)):
        _custom(p, node)
    for name, val in _named_values(node):
        vi = _value_info(name, val)
        if vi is not None:
            p.value_info.append(vi)


def _named_values(node: fx.Node) -> list[tuple[str, Any]]:
    val = value_of(node)
    if isinstance(val, (tuple, list)):
        return list(zip(_output_names(node), val))
    return [(node.name, val)] if val is not None else []


def program_to_onnx(gm: fx.GraphModule, title: str, metadata: dict[str, str] | None = None) -> onnx.ModelProto:
    """The FX program ``gm`` as an ONNX model (see the module docstring for the mapping)."""
    p = _Program()
    inputs: list[onnx.ValueInfoProto] = []
    outputs: list[onnx.ValueInfoProto] = []
    output_doc: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            vi = _value_info(node.name, value_of(node)) or helper.make_empty_tensor_value_info(node.name)
            if has_info(node):
                ni = info(node)
                vi.doc_string = " | ".join(filter(None, [str(ni.role), ni.source, str(ni.placement), ni.layer]))
            inputs.append(vi)
        elif node.op == "get_attr":
            p.current = node
            value = getattr(gm, node.target) if isinstance(node.target, str) else None
            if isinstance(value, torch.Tensor):
                p.initializers.append(_tensor_proto(node.name, value))
            else:
                _custom(p, node)
        elif node.op == "call_function":
            _convert(p, node)
        elif node.op == "output":
            p.current = node
            returned = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            seen: set[str] = set()
            for i, value in enumerate(returned):
                if not isinstance(value, fx.Node):
                    output_doc.append(f"{i}: {value!r} (not a tensor)")
                    continue
                name = value.name
                if name in seen:  # an ONNX graph names each output once
                    p.emit("Identity", [name], [f"output_{i}"])
                    name = f"output_{i}"
                seen.add(name)
                output_doc.append(f"{i}: {name}")
                outputs.append(_value_info(name, value_of(value)) or helper.make_empty_tensor_value_info(name))
    graph = helper.make_graph(p.nodes, title, inputs, outputs, initializer=p.initializers, value_info=p.value_info,
                              doc_string="outputs by position: " + ", ".join(output_doc))
    opsets = [helper.make_opsetid("", OPSET)] + [helper.make_opsetid(d, 1) for d in sorted(p.domains)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="megacompile")
    helper.set_model_props(model, dict(metadata or {}))
    return model


def write_programs(records, directories: list[str], out: str) -> list[str]:
    """Each record's rewritten forward and backward as ``OUT/<directory>/<program>.onnx``, checked
    by ``onnx.checker`` (with shape inference); returns the paths written."""
    written = []
    for record, directory in zip(records, directories):
        if record.plan is None:
            continue  # a host graph: no rewritten program
        for part in ("forward", "backward"):
            gm = getattr(record, part)
            if gm is None:
                continue
            options = record.options
            metadata = {"graph": record.label, "program": part, "policy": str(record.plan.policy),
                        "planned_peak_bytes": str(record.plan.peak_bytes),
                        "memory_budget": str(options.memory_budget or ""), "device": str(options.device),
                        "lowering": str(options.lowering)}
            model = program_to_onnx(gm, f"{record.label} {part}", metadata)
            onnx.checker.check_model(model, full_check=True)
            path = os.path.join(out, directory, f"{part}.onnx")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            onnx.save_model(model, path)
            written.append(path)
    return written
