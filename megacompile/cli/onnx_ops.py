"""How aten ops become standard ONNX ops (opset 20): the table ``STANDARD``.

Each converter gets the program being built (``Emitter``: ``emit`` a node, ``const`` /
``ints`` an initializer) and one FX node, and returns False where the op's
arguments fall outside what the ONNX op means (another dtype, an ``alpha``, a symbolic size):
``onnx_program`` then writes the op in the custom ``aten`` domain instead. A converter may emit
two nodes (``rsqrt`` = Sqrt + Reciprocal); both carry the FX node's name in their metadata.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.fx as fx
from onnx import TensorProto

ONNX_DTYPES = {
    torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16,
    torch.float64: TensorProto.DOUBLE, torch.int64: TensorProto.INT64, torch.int32: TensorProto.INT32,
    torch.int16: TensorProto.INT16, torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8,
    torch.bool: TensorProto.BOOL,
}


class Emitter(Protocol):
    """What a converter writes into (``onnx_program._Program``)."""

    def emit(self, op_type: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs: Any) -> None: ...

    def const(self, suffix: str, value: Any, dtype: torch.dtype) -> str: ...

    def ints(self, suffix: str, values: list[int]) -> str: ...


def onnx_dtype(dtype: torch.dtype) -> int:
    if dtype not in ONNX_DTYPES:
        raise ValueError(f"no ONNX element type for {dtype}")
    return ONNX_DTYPES[dtype]


def value_of(arg: Any) -> Any:
    """The fake tensor (or tuple, or SymInt) an FX node stands for."""
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def _same_dtype(node: fx.Node, *args: Any) -> bool:
    out = value_of(node)
    if not isinstance(out, torch.Tensor):
        return False
    return all(isinstance(value_of(a), torch.Tensor) and value_of(a).dtype == out.dtype for a in args
               if isinstance(a, fx.Node))


def _static(shape: Any) -> bool:
    return all(isinstance(s, int) or (isinstance(s, torch.SymInt) and str(s).lstrip("-").isdigit()) for s in shape)


def _rank(arg: Any) -> int:
    return value_of(arg).dim()


def _axis(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _operand(p: Emitter, node: fx.Node, arg: Any, index: int) -> str | None:
    """A tensor operand's name, or a Python number as a constant of the result's dtype."""
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return p.const(f"arg{index}", arg, value_of(node).dtype)
    return None


def _elementwise(op_type: str) -> Callable[[Emitter, fx.Node], bool]:
    def convert(p: Emitter, node: fx.Node) -> bool:
        if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("rounding_mode") is not None:
            return False
        if not _same_dtype(node, *node.args):
            return False
        operands = [_operand(p, node, a, i) for i, a in enumerate(node.args)]
        if None in operands:
            return False
        p.emit(op_type, operands, [node.name])
        return True
    return convert


def _unary(*op_types: str) -> Callable[[Emitter, fx.Node], bool]:
    """One input, one output; several op types are applied in turn (rsqrt = Sqrt, Reciprocal)."""
    def convert(p: Emitter, node: fx.Node) -> bool:
        if len(node.args) != 1 or node.kwargs or not _same_dtype(node, node.args[0]):
            return False
        current = node.args[0].name
        for i, op_type in enumerate(op_types):
            out = node.name if i == len(op_types) - 1 else f"{node.name}__{op_type.lower()}"
            p.emit(op_type, [current], [out])
            current = out
        return True
    return convert


def _comparison(op_type: str, negate: bool = False) -> Callable[[Emitter, fx.Node], bool]:
    def convert(p: Emitter, node: fx.Node) -> bool:
        a, b = node.args[:2]
        dtype = value_of(a).dtype
        if isinstance(b, fx.Node) and value_of(b).dtype != dtype:
            return False
        other = b.name if isinstance(b, fx.Node) else p.const("other", b, dtype)
        if negate:
            p.emit(op_type, [a.name, other], [f"{node.name}__{op_type.lower()}"])
            p.emit("Not", [f"{node.name}__{op_type.lower()}"], [node.name])
        else:
            p.emit(op_type, [a.name, other], [node.name])
        return True
    return convert


def _logical(op_type: str) -> Callable[[Emitter, fx.Node], bool]:
    def convert(p: Emitter, node: fx.Node) -> bool:
        if any(value_of(a).dtype != torch.bool for a in node.args):
            return False  # bitwise ops on integers have no ONNX op in the standard domain here
        p.emit(op_type, [a.name for a in node.args], [node.name])
        return True
    return convert


def _matmul(p: Emitter, node: fx.Node) -> bool:
    p.emit("MatMul", [node.args[0].name, node.args[1].name], [node.name])
    return True


def _addmm(p: Emitter, node: fx.Node) -> bool:
    bias, a, b = node.args[:3]
    if not _same_dtype(node, bias, a, b):
        return False
    p.emit("Gemm", [a.name, b.name, bias.name], [node.name],
           alpha=float(node.kwargs.get("alpha", 1.0)), beta=float(node.kwargs.get("beta", 1.0)))
    return True


def _identity(p: Emitter, node: fx.Node) -> bool:
    p.emit("Identity", [node.args[0].name], [node.name])
    return True


def _to_copy(p: Emitter, node: fx.Node) -> bool:
    dtype = node.kwargs.get("dtype")
    if dtype is None or dtype == value_of(node.args[0]).dtype:
        return _identity(p, node)
    p.emit("Cast", [node.args[0].name], [node.name], to=onnx_dtype(dtype))
    return True


def _transpose_perm(p: Emitter, node: fx.Node, perm: list[int]) -> bool:
    p.emit("Transpose", [node.args[0].name], [node.name], perm=perm)
    return True


def _t(p: Emitter, node: fx.Node) -> bool:
    if _rank(node.args[0]) < 2:
        return _identity(p, node)
    return _transpose_perm(p, node, [1, 0])


def _transpose(p: Emitter, node: fx.Node) -> bool:
    rank = _rank(node.args[0])
    perm = list(range(rank))
    d0, d1 = (_axis(d, rank) for d in node.args[1:3])
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _transpose_perm(p, node, perm)


def _permute(p: Emitter, node: fx.Node) -> bool:
    rank = _rank(node.args[0])
    return _transpose_perm(p, node, [_axis(d, rank) for d in node.args[1]])


def _reshape(p: Emitter, node: fx.Node) -> bool:
    shape = value_of(node).shape
    if not _static(shape):
        return False
    p.emit("Reshape", [node.args[0].name, p.ints("shape", [int(s) for s in shape])], [node.name])
    return True


def _expand(p: Emitter, node: fx.Node) -> bool:
    shape = value_of(node).shape
    if not _static(shape):
        return False
    p.emit("Expand", [node.args[0].name, p.ints("shape", [int(s) for s in shape])], [node.name])
    return True


def _unsqueeze(p: Emitter, node: fx.Node) -> bool:
    p.emit("Unsqueeze", [node.args[0].name, p.ints("axes", [_axis(node.args[1], value_of(node).dim())])], [node.name])
    return True


def _squeeze_dim(p: Emitter, node: fx.Node) -> bool:
    x = node.args[0]
    axis = _axis(node.args[1], max(_rank(x), 1))
    if _rank(x) == 0 or value_of(x).shape[axis] != 1:
        return _identity(p, node)  # aten squeezes only a size-1 dim and otherwise returns the input
    p.emit("Squeeze", [x.name, p.ints("axes", [axis])], [node.name])
    return True


def _slice(p: Emitter, node: fx.Node) -> bool:
    x, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    if any(isinstance(v, fx.Node) for v in (start, end, step)):
        return False
    rank = _rank(x)
    start = 0 if start is None else start
    end = 2 ** 63 - 1 if end is None else end
    p.emit("Slice", [x.name, p.ints("starts", [start]), p.ints("ends", [end]),
                     p.ints("axes", [_axis(dim, rank)]), p.ints("steps", [step])], [node.name])
    return True


def _reduce(op_type: str) -> Callable[[Emitter, fx.Node], bool]:
    """``sum.dim_IntList(x, dims, keepdim)``; ``sum(x)`` (no dims: every element)."""
    def convert(p: Emitter, node: fx.Node) -> bool:
        x, dims = node.args[0], node.args[1] if len(node.args) > 1 else None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if node.kwargs.get("dtype") is not None or not _same_dtype(node, x):
            return False
        if not dims:  # ONNX reduces every axis when none is given
            p.emit(op_type, [x.name], [node.name], keepdims=int(keepdim))
            return True
        rank = _rank(x)
        p.emit(op_type, [x.name, p.ints("axes", [_axis(d, rank) for d in dims])], [node.name], keepdims=int(keepdim))
        return True
    return convert


def _softmax(op_type: str) -> Callable[[Emitter, fx.Node], bool]:
    def convert(p: Emitter, node: fx.Node) -> bool:
        x, dim, half_to_float = node.args[:3]
        if half_to_float or not _same_dtype(node, x):
            return False
        p.emit(op_type, [x.name], [node.name], axis=_axis(dim, _rank(x)))
        return True
    return convert


def _cat(p: Emitter, node: fx.Node) -> bool:
    tensors = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not _same_dtype(node, *tensors):
        return False
    p.emit("Concat", [t.name for t in tensors], [node.name], axis=_axis(dim, value_of(node).dim()))
    return True


def _embedding(p: Emitter, node: fx.Node) -> bool:
    weight, indices = node.args[:2]
    p.emit("Gather", [weight.name, indices.name], [node.name], axis=0)
    return True


def _where(p: Emitter, node: fx.Node) -> bool:
    cond, a, b = node.args
    if not _same_dtype(node, a, b):
        return False
    p.emit("Where", [cond.name, a.name, b.name], [node.name])
    return True


def _gelu(p: Emitter, node: fx.Node) -> bool:
    if not _same_dtype(node, node.args[0]):
        return False
    p.emit("Gelu", [node.args[0].name], [node.name], approximate=node.kwargs.get("approximate", "none"))
    return True


def _silu(p: Emitter, node: fx.Node) -> bool:
    x = node.args[0]
    p.emit("Sigmoid", [x.name], [f"{node.name}__sigmoid"])
    p.emit("Mul", [x.name, f"{node.name}__sigmoid"], [node.name])
    return True


def _layer_norm(p: Emitter, node: fx.Node) -> bool:
    x, normalized_shape, weight, bias, eps = node.args
    if weight is None or bias is None or not _same_dtype(x, weight, bias) or value_of(x).dtype != torch.float32:
        return False  # mapped for fp32 only: the statistics outputs of other dtypes differ between the two
    p.emit("LayerNormalization", [x.name, weight.name, bias.name], [f"{node.name}.{i}" for i in range(3)],
           axis=-len(normalized_shape), epsilon=float(eps))
    return True


def _split(p: Emitter, node: fx.Node) -> bool:
    """``split.Tensor(x, size, dim)`` and ``split_with_sizes(x, sizes, dim)``: the pieces' sizes
    are read from the outputs."""
    x = node.args[0]
    dim = _axis(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), _rank(x))
    if not all(_static(v.shape) for v in value_of(node)):
        return False
    pieces = [int(v.shape[dim]) for v in value_of(node)]
    p.emit("Split", [x.name, p.ints("split", pieces)], [f"{node.name}.{i}" for i in range(len(pieces))], axis=dim)
    return True


def _pow_scalar(p: Emitter, node: fx.Node) -> bool:
    x, exponent = node.args
    if not _same_dtype(node, x) or not isinstance(exponent, (int, float)):
        return False
    p.emit("Pow", [x.name, p.const("exponent", exponent, value_of(node).dtype)], [node.name])
    return True


aten = torch.ops.aten
STANDARD: dict[Any, Callable[[Emitter, fx.Node], bool]] = {
    aten.mm.default: _matmul, aten.bmm.default: _matmul, aten.matmul.default: _matmul,
    aten.addmm.default: _addmm,
    aten.add.Tensor: _elementwise("Add"), aten.add.Scalar: _elementwise("Add"),
    aten.sub.Tensor: _elementwise("Sub"), aten.sub.Scalar: _elementwise("Sub"),
    aten.mul.Tensor: _elementwise("Mul"), aten.mul.Scalar: _elementwise("Mul"),
    aten.div.Tensor: _elementwise("Div"), aten.div.Scalar: _elementwise("Div"),
    aten.pow.Tensor_Scalar: _pow_scalar,
    aten.neg.default: _unary("Neg"), aten.relu.default: _unary("Relu"), aten.exp.default: _unary("Exp"),
    aten.log.default: _unary("Log"), aten.sqrt.default: _unary("Sqrt"),
    aten.rsqrt.default: _unary("Sqrt", "Reciprocal"),
    aten.reciprocal.default: _unary("Reciprocal"), aten.tanh.default: _unary("Tanh"),
    aten.sigmoid.default: _unary("Sigmoid"), aten.sin.default: _unary("Sin"), aten.cos.default: _unary("Cos"),
    aten.abs.default: _unary("Abs"),
    aten.gelu.default: _gelu, aten.silu.default: _silu,
    aten.eq.Tensor: _comparison("Equal"), aten.eq.Scalar: _comparison("Equal"),
    aten.ne.Tensor: _comparison("Equal", negate=True), aten.ne.Scalar: _comparison("Equal", negate=True),
    aten.lt.Tensor: _comparison("Less"), aten.lt.Scalar: _comparison("Less"),
    aten.le.Tensor: _comparison("LessOrEqual"), aten.le.Scalar: _comparison("LessOrEqual"),
    aten.gt.Tensor: _comparison("Greater"), aten.gt.Scalar: _comparison("Greater"),
    aten.ge.Tensor: _comparison("GreaterOrEqual"), aten.ge.Scalar: _comparison("GreaterOrEqual"),
    aten.bitwise_not.default: _logical("Not"), aten.bitwise_and.Tensor: _logical("And"),
    aten.bitwise_or.Tensor: _logical("Or"), aten.logical_not.default: _logical("Not"),
    aten.where.self: _where,
    aten.t.default: _t, aten.transpose.int: _transpose, aten.permute.default: _permute,
    aten.view.default: _reshape, aten._unsafe_view.default: _reshape, aten.reshape.default: _reshape,
    aten.expand.default: _expand, aten.unsqueeze.default: _unsqueeze, aten.squeeze.dim: _squeeze_dim,
    aten.slice.Tensor: _slice, aten.cat.default: _cat, aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.clone.default: _identity, aten.detach.default: _identity, aten.alias.default: _identity,
    aten._to_copy.default: _to_copy,
    aten.sum.dim_IntList: _reduce("ReduceSum"), aten.sum.default: _reduce("ReduceSum"),
    aten.mean.dim: _reduce("ReduceMean"), aten.mean.default: _reduce("ReduceMean"),
    aten.amax.default: _reduce("ReduceMax"),
    aten._softmax.default: _softmax("Softmax"), aten._log_softmax.default: _softmax("LogSoftmax"),
    aten.embedding.default: _embedding,
    aten.native_layer_norm.default: _layer_norm,
}


