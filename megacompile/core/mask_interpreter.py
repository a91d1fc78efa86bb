"""What a node of Dynamo's graph holds, element by element, in the index algebra.

``MaskInterpreter(graph).value(node)`` interprets the node's producers (``arange``, constants
and ``ones`` / ``full``; adds and scales of indices; broadcasting, ``unsqueeze``, ``expand``,
size-1 reshapes, slicing and gathering by index tensors; comparisons; ``&`` / ``|`` / ``~``;
``where`` / ``masked_fill``; ``tril`` / ``triu``; ``diff`` / ``cumsum`` / ``cat`` along one dim;
casts and device moves) into an ``index_algebra`` value. A graph input, a parameter, or an op
not listed raises ``Unknown`` naming it: its elements are not known at compile time. Shapes
come from the nodes' example values and must be static.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from megacompile.core import index_algebra as ia
from megacompile.core.index_algebra import Affine, Const, Unknown, Value

_MAX_PRODUCERS = 400  # a mask is built by a few dozen ops; more means it reads the model's values

_COMPARE = {operator.le: "le", operator.lt: "lt", operator.ge: "ge", operator.gt: "gt", operator.eq: "eq",
            operator.ne: "ne", torch.le: "le", torch.lt: "lt", torch.ge: "ge", torch.gt: "gt", torch.eq: "eq",
            torch.ne: "ne"}
_LOGIC = {operator.and_: "and", operator.or_: "or", operator.xor: "xor", torch.logical_and: "and",
          torch.logical_or: "or", torch.logical_xor: "xor", torch.bitwise_and: "and", torch.bitwise_or: "or",
          torch.bitwise_xor: "xor"}
_ARITH = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", torch.add: "add", torch.sub: "sub",
          torch.mul: "mul"}
_NOT = {operator.invert, torch.logical_not, torch.bitwise_not}
_FILL = {torch.ones: 1, torch.zeros: 0, torch.ones_like: 1, torch.zeros_like: 0}
_METHOD_ALIASES = {"le": "le", "lt": "lt", "ge": "ge", "gt": "gt", "eq": "eq", "ne": "ne", "__and__": "and",
                   "__or__": "or", "logical_and": "and", "logical_or": "or", "add": "add", "sub": "sub",
                   "mul": "mul"}
_PASS_THROUGH = {"to", "contiguous", "clone", "detach", "bool", "float", "half", "bfloat16", "double", "int", "long",
                 "type_as", "type"}


def example_tensor(node) -> torch.Tensor | None:
    val = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def static_shape(x) -> tuple[int, ...]:
    val = example_tensor(x)
    if val is None:
        return ()
    if not all(isinstance(d, int) for d in val.shape):
        raise Unknown(f"{x.name} has a symbolic shape {tuple(val.shape)}")
    return tuple(val.shape)


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


def coerce(v: Value, kind: str, where: str) -> Value:
    """``v`` with its leaves in the element type ``kind`` (as a cast to that dtype would)."""

    def leaf(x):
        if kind == "int":
            if isinstance(x, Affine):
                return x
            if x.kind == "bool":
                return Affine.constant(int(x.value))
            raise Unknown(f"{where}: a float value cast to an integer")
        if isinstance(x, Affine):
            if x.coefs:
                raise Unknown(f"{where}: an index used as a {kind} value")
            return Const.of(bool(x.const) if kind == "bool" else float(x.const))
        return Const.of(bool(x.value) if kind == "bool" else float(x.value))

    return ia.lift(leaf, v)


def _same_kind(a, b):
    """Operands in one type, as torch promotes them: a bool next to an integer becomes an
    integer; an integer constant next to a float becomes a float."""
    if isinstance(a, Affine) and isinstance(b, Const):
        b, a = (Affine.constant(int(b.value)), a) if b.kind == "bool" else (b, _as_float(a))
    elif isinstance(b, Affine) and isinstance(a, Const):
        a, b = (Affine.constant(int(a.value)), b) if a.kind == "bool" else (a, _as_float(b))
    return a, b


def _as_float(a: Affine):
    return Const.of(float(a.const)) if not a.coefs else a  # an index stays an index (refused by the caller)


def _compare(op: str, x, y, sizes, where: str) -> Value:
    def leaf(a, b):
        a, b = _same_kind(a, b)
        if isinstance(a, Affine) and isinstance(b, Affine):
            le, ge = a.plus(b, -1), b.plus(a, -1)  # a - b <= 0, b - a <= 0
            if op == "le":
                return ia.le_zero(le, sizes)
            if op == "lt":
                return ia.le_zero(le.plus(Affine.constant(1)), sizes)
            if op == "ge":
                return ia.le_zero(ge, sizes)
            if op == "gt":
                return ia.le_zero(ge.plus(Affine.constant(1)), sizes)
            both = ia.lift(lambda p, q: Const.of(p.value and q.value), ia.le_zero(le, sizes), ia.le_zero(ge, sizes))
            return both if op == "eq" else ia.lift(lambda p: Const.of(not p.value), both)
        if isinstance(a, Const) and isinstance(b, Const):
            return Const.of(getattr(operator, op)(a.value, b.value))
        raise Unknown(f"{where}: compares an index with a {a.kind if isinstance(a, Const) else b.kind} value")

    return ia.lift(leaf, x, y)


def _arith(op: str, x, y, where: str) -> Value:
    def leaf(a, b):
        a, b = _same_kind(a, b)
        if isinstance(a, Affine) and isinstance(b, Affine):
            if op == "add":
                return a.plus(b)
            if op == "sub":
                return a.plus(b, -1)
            if not a.coefs:
                return b.scaled(a.const)
            if not b.coefs:
                return a.scaled(b.const)
            raise Unknown(f"{where}: a product of two indices")
        if isinstance(a, Const) and isinstance(b, Const):
            return Const.of({"add": operator.add, "sub": operator.sub, "mul": operator.mul}[op](a.value, b.value))
        raise Unknown(f"{where}: mixes an index and a {a.kind if isinstance(a, Const) else b.kind} value")

    return ia.lift(leaf, x, y)


def _logic(op: str, x, y) -> Value:
    fn = {"and": operator.and_, "or": operator.or_, "xor": operator.xor}[op]
    return ia.lift(lambda a, b: Const.of(bool(fn(a.value, b.value))), x, y)


def _broadcast(v: Value, shape: tuple[int, ...], out: tuple[int, ...]) -> Value:
    """``v`` (of ``shape``, size-1 dims already read at 0) as an operand of a result of shape ``out``."""
    shift = len(out) - len(shape)
    if shift == 0:
        return v
    return ia.substitute(v, {d: Affine.index(d + shift) for d in range(len(shape))}, out)


def _size_one_at_zero(v: Value, shape: tuple[int, ...]) -> Value:
    """Every size-1 dim's index is 0; stating it once lets broadcasting and expand ignore them."""
    if all(s != 1 for s in shape):
        return v
    subs = {d: Affine.constant(0) if s == 1 else Affine.index(d) for d, s in enumerate(shape)}
    return ia.substitute(v, subs, shape)


def _rounded(v: Value, node: fx.Node) -> Value:
    """Float constants as the node's dtype holds them (0.1 in bf16 is not 0.1)."""
    dtype = example_tensor(node).dtype
    if not dtype.is_floating_point:
        return v
    return ia.lift(lambda c: Const.of(torch.tensor(c.value, dtype=dtype).item()) if isinstance(c, Const) else c, v)


class MaskInterpreter:
    """Values of a graph's nodes in the index algebra, each computed once (memoised)."""

    def __init__(self) -> None:
        self.values: dict[fx.Node, Value] = {}
        self.failed: dict[fx.Node, str] = {}

    def value(self, node: fx.Node) -> Value:
        """The node's value, or ``Unknown`` with the first producer the algebra does not cover."""
        order = self._producers(node)
        for n in order:
            if n in self.failed:
                raise Unknown(self.failed[n])
            if n not in self.values:
                try:
                    try:
                        self.values[n] = _rounded(_size_one_at_zero(self._interpret(n), static_shape(n)), n)
                    except (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError) as bad:
                        # An argument spelled in a way the rules do not expect: not understood.
                        raise Unknown(f"{n.name} ({n.op} {getattr(n.target, '__name__', n.target)}): arguments "
                                      f"not understood ({type(bad).__name__}: {bad})") from None
                except Unknown as why:
                    self.failed[n] = str(why)
                    raise
        return self.values[node]

    def _producers(self, node: fx.Node) -> list[fx.Node]:
        """The node's producers in graph order (reading stops at nodes already known)."""
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if len(seen) > _MAX_PRODUCERS:
                raise Unknown(f"{node.name} is built from more than {_MAX_PRODUCERS} ops")
            if n in self.values or n in self.failed:
                continue
            stack.extend(n.all_input_nodes)
        index = {n: i for i, n in enumerate(node.graph.nodes)}
        return sorted(seen, key=index.__getitem__)

    def _operand(self, arg, out: tuple[int, ...], where: str) -> Value:
        if isinstance(arg, fx.Node):
            return _broadcast(self.values[arg], static_shape(arg), out)
        if isinstance(arg, bool):
            return Const.of(arg)
        if isinstance(arg, int):
            return Affine.constant(arg)
        if isinstance(arg, float):
            return Const.of(arg)
        raise Unknown(f"{where}: operand {arg!r} is not a tensor or a number")

    def _interpret(self, n: fx.Node) -> Value:
        where = f"{n.name} ({n.op} {getattr(n.target, '__name__', n.target)})"
        if n.op == "placeholder":
            raise Unknown(f"{n.name} is an input of the graph: its values are not known at compile time")
        if n.op not in ("call_function", "call_method"):
            raise Unknown(f"{where} is not understood")
        val = example_tensor(n)
        if val is None:
            raise Unknown(f"{where} does not make one tensor")
        out = static_shape(n)
        kind = _kind(val.dtype)
        target = n.target
        method = target if n.op == "call_method" else None
        args = list(n.args)

        if method in _PASS_THROUGH or (n.op == "call_function" and target in (torch.clone,)):
            return coerce(self.values[args[0]], kind, where)
        if method in _METHOD_ALIASES:
            target = {"le": operator.le, "lt": operator.lt, "ge": operator.ge, "gt": operator.gt, "eq": operator.eq,
                      "ne": operator.ne, "and": operator.and_, "or": operator.or_, "add": operator.add,
                      "sub": operator.sub, "mul": operator.mul}[_METHOD_ALIASES[method]]
        if method in ("logical_not", "__invert__", "bitwise_not"):
            target = operator.invert
        if n.kwargs.get("alpha", 1) != 1 or n.kwargs.get("out") is not None:
            raise Unknown(f"{where}: alpha / out arguments")

        if target in _COMPARE:
            return _compare(_COMPARE[target], self._operand(args[0], out, where), self._operand(args[1], out, where),
                            out, where)
        if target in _LOGIC:
            if kind != "bool":
                raise Unknown(f"{where}: bitwise logic on {val.dtype} values")
            x, y = (coerce(self._operand(a, out, where), "bool", where) for a in args[:2])
            return _logic(_LOGIC[target], x, y)
        if target in _NOT:
            if kind != "bool":
                raise Unknown(f"{where}: bitwise not on {val.dtype} values")
            return ia.lift(lambda a: Const.of(not a.value), self._operand(args[0], out, where))
        if target in _ARITH:
            x, y = (coerce(self._operand(a, out, where), kind, where) for a in args[:2])
            return coerce(_arith(_ARITH[target], x, y, where), kind, where)
        if target in (operator.neg, torch.neg) or method == "neg":
            return coerce(_arith("mul", self._operand(args[0], out, where), Affine.constant(-1)
                                 if kind == "int" else Const.of(-1.0), where), kind, where)
        if target is torch.where or method == "where":
            if len(args) != 3:
                raise Unknown(f"{where}: where() with keyword arguments")
            c, a, b = (self._operand(x, out, where) for x in args)
            return ia.lift(lambda t, p, q: p if t.value else q, coerce(c, "bool", where), coerce(a, kind, where),
                           coerce(b, kind, where))
        if target is torch.masked_fill or method in ("masked_fill", "masked_fill_"):
            if method == "masked_fill_":
                raise Unknown(f"{where}: an in-place fill")
            x, m, fill = (self._operand(a, out, where) for a in args[:3])
            return ia.lift(lambda t, p, q: p if t.value else q, coerce(m, "bool", where), coerce(fill, kind, where),
                           coerce(x, kind, where))
        if target is torch.arange:
            return self._arange(n, kind, where)
        if target in _FILL or target in (torch.full, torch.full_like, torch.scalar_tensor, torch.tensor) or method in (
                "new_ones", "new_zeros", "new_full", "fill_"):
            return self._constant(n, target, method, kind, where)
        if target in (torch.tril, torch.triu) or method in ("tril", "triu"):
            return self._triangle(n, target, method, out, kind, where)
        if target is torch.unsqueeze or method == "unsqueeze":
            d = args[1] if len(args) > 1 else n.kwargs["dim"]
            d = d % len(out)
            return ia.substitute(self.values[args[0]], {j: Affine.index(j if j < d else j + 1)
                                                        for j in range(len(out) - 1)}, out)
        if method in ("expand", "expand_as") or target is torch.broadcast_to:
            return _broadcast(self.values[args[0]], static_shape(args[0]), out)
        if method in ("view", "reshape") or target is torch.reshape:
            return self._reshape(args[0], out, where)
        if target is operator.getitem:
            return self._getitem(n, args[0], args[1], out, where)
        if target is torch.cat:
            return self._cat(n, out, where)
        if target is torch.diff or method == "diff":
            return self._diff(n, out, where)
        if target is torch.cumsum or method == "cumsum":
            return self._cumsum(n, out, kind, where)
        if method == "transpose" or target is torch.transpose:
            a, b = (d % len(out) for d in args[1:3])
            swap = {d: Affine.index(b if d == a else a if d == b else d) for d in range(len(out))}
            return ia.substitute(self.values[args[0]], swap, out)
        raise Unknown(f"{where} is not understood")

    def _arange(self, n: fx.Node, kind: str, where: str) -> Value:
        if kind != "int":
            raise Unknown(f"{where}: a floating-point arange")
        nums = list(n.args)
        if n.kwargs.keys() & {"start", "end", "step"} or not nums or not all(isinstance(a, int) for a in nums):
            raise Unknown(f"{where}: bounds that are not positional constants")
        start, step = (0, 1) if len(nums) == 1 else (nums[0], nums[2] if len(nums) > 2 else 1)
        return Affine.index(0, step, start)

    def _constant(self, n, target, method, kind, where) -> Value:
        if target in _FILL:
            fill = _FILL[target]
        elif method == "new_ones":
            fill = 1
        elif method == "new_zeros":
            fill = 0
        elif target is torch.scalar_tensor or target is torch.tensor:
            fill = n.args[0]
        else:  # full(size, value), full_like(x, value), new_full(x, size, value)
            fill = n.args[2] if method == "new_full" else n.args[1] if len(n.args) > 1 else n.kwargs.get("fill_value")
        if not isinstance(fill, (bool, int, float)):
            raise Unknown(f"{where}: its value is not a constant")
        if method == "fill_":
            raise Unknown(f"{where}: an in-place fill")
        base = Affine.constant(int(fill)) if isinstance(fill, (bool, int)) and kind == "int" else \
            Const.of(bool(fill) if kind == "bool" else float(fill))
        return coerce(base, kind, where)

    def _triangle(self, n, target, method, out, kind, where) -> Value:
        lower = target is torch.tril or method == "tril"
        diagonal = n.args[1] if len(n.args) > 1 else n.kwargs.get("diagonal", 0)
        if not isinstance(diagonal, int) or len(out) < 2:
            raise Unknown(f"{where}: diagonal {diagonal!r} / {len(out)} dims")
        r, c = len(out) - 2, len(out) - 1
        offset = Affine.of({c: 1, r: -1}, -diagonal)  # k - q - diagonal
        keep = ia.le_zero(offset if lower else offset.scaled(-1), out)  # tril: k - q <= d; triu: k - q >= d
        zero = Affine.constant(0) if kind == "int" else Const.of(False if kind == "bool" else 0.0)
        return ia.lift(lambda t, x: x if t.value else zero, keep, self.values[n.args[0]])

    def _reshape(self, source: fx.Node, out: tuple[int, ...], where: str) -> Value:
        shape = static_shape(source)
        kept_in = [d for d, s in enumerate(shape) if s != 1]
        kept_out = [d for d, s in enumerate(out) if s != 1]
        if [shape[d] for d in kept_in] != [out[d] for d in kept_out]:
            raise Unknown(f"{where}: a reshape that merges or splits dims {shape} -> {out}")
        subs = {d: Affine.constant(0) for d in range(len(shape))}
        subs.update({i: Affine.index(o) for i, o in zip(kept_in, kept_out)})
        return ia.substitute(self.values[source], subs, out)

    def _getitem(self, n, source, index, out, where) -> Value:
        shape = static_shape(source)
        items = list(index) if isinstance(index, tuple) else [index]
        tensors = [i for i in items if isinstance(i, fx.Node)]
        if tensors:
            return self._gather(source, items, shape, out, where)
        if Ellipsis in items:
            at = items.index(Ellipsis)
            fill = len(shape) - sum(1 for i in items if i is not None and i is not Ellipsis)
            items[at:at + 1] = [slice(None)] * fill
        subs, dim, o = {}, 0, 0
        for item in items:
            if item is None:
                o += 1
            elif isinstance(item, int) and not isinstance(item, bool):
                if not -shape[dim] <= item < shape[dim]:
                    raise Unknown(f"{where}: index {item} out of range")
                subs[dim] = Affine.constant(item % shape[dim])
                dim += 1
            elif isinstance(item, slice):
                start, _stop, step = item.indices(shape[dim])
                if step <= 0 or not all(x is None or isinstance(x, int) for x in (item.start, item.stop, item.step)):
                    raise Unknown(f"{where}: slice {item}")
                subs[dim] = Affine.index(o, step, start)
                dim, o = dim + 1, o + 1
            else:
                raise Unknown(f"{where}: index {item!r}")
        for d in range(dim, len(shape)):
            subs[d] = Affine.index(o)
            o += 1
        return ia.substitute(self.values[source], subs, out)

    def _gather(self, source, items, shape, out, where) -> Value:
        """``x[i0, i1, ...]`` with index tensors over its leading dims (Hugging Face's
        ``position_ids[batch_idx, q_idx]``): element j is x[i0[j], i1[j], ...]."""
        if not all(isinstance(i, fx.Node) for i in items) or len(items) > len(shape):
            raise Unknown(f"{where}: indexing that mixes index tensors with slices or None")
        rest = len(shape) - len(items)
        front = out[:len(out) - rest]
        subs = {}
        for d, idx in enumerate(items):
            if example_tensor(idx).dtype not in (torch.int64, torch.int32):
                raise Unknown(f"{where}: a {example_tensor(idx).dtype} index")
            v = _broadcast(self.values[idx], static_shape(idx), front)
            if not isinstance(v, Affine):
                raise Unknown(f"{where}: an index tensor that is not an affine function of its position")
            lo, hi = v.bounds(front)
            if lo < 0 or hi >= shape[d]:
                raise Unknown(f"{where}: an index in [{lo}, {hi}] of a dim of size {shape[d]} (negative indices wrap)")
            subs[d] = v
        for j in range(rest):
            subs[len(items) + j] = Affine.index(len(front) + j)
        return ia.substitute(self.values[source], subs, out)

    def _cat(self, n, out, where) -> Value:
        pieces = n.args[0]
        dim = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % len(out)
        # Element i along dim is piece p's element i - offset(p), for the piece i falls in.
        result, offset = None, 0
        chosen: list[tuple[int, Value, int]] = []
        for p in pieces:
            shape = static_shape(p)
            if len(shape) != len(out):
                raise Unknown(f"{where}: pieces of other ranks")
            subs = {d: Affine.index(d) for d in range(len(out))}
            subs[dim] = Affine.index(dim, 1, -offset)
            chosen.append((offset, ia.substitute(self.values[p], subs, out), shape[dim]))
            offset += shape[dim]
        for start, v, size in reversed(chosen):
            if result is None:
                result = v
                continue
            before_end = ia.le_zero(Affine.index(dim, 1, -(start + size) + 1), out)  # i < start + size
            result = ia.lift(lambda t, a, b: a if t.value else b, before_end, v, result)
        if result is None:
            raise Unknown(f"{where}: nothing to concatenate")
        return result

    def _diff(self, n, out, where) -> Value:
        source = n.args[0]
        steps = n.args[1] if len(n.args) > 1 else n.kwargs.get("n", 1)
        dim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", -1)) % len(out)
        prepend = n.args[3] if len(n.args) > 3 else n.kwargs.get("prepend")
        append = n.args[4] if len(n.args) > 4 else n.kwargs.get("append")
        if steps != 1 or append is not None:
            raise Unknown(f"{where}: diff with n={steps} / append")
        # y = cat(prepend, x) along dim; diff[i] = y[i + 1] - y[i]
        parts = ([prepend] if isinstance(prepend, fx.Node) else []) + [source]
        if prepend is not None and not isinstance(prepend, fx.Node):
            raise Unknown(f"{where}: a prepend that is not a tensor")
        ext = tuple(out[d] + 1 if d == dim else out[d] for d in range(len(out)))
        y, offset = None, 0
        for p in parts:
            shape = static_shape(p)
            subs = {d: Affine.index(d) for d in range(len(out))}
            subs[dim] = Affine.index(dim, 1, -offset)
            v = ia.substitute(_broadcast(self.values[p], shape, ext) if len(shape) != len(out) else self.values[p],
                              subs, ext)
            if y is None:
                y = v
            else:
                before_end = ia.le_zero(Affine.index(dim, 1, -offset + 1), ext)  # i < offset
                y = ia.lift(lambda t, a, b: a if t.value else b, before_end, y, v)
            offset += shape[dim]
        shifted = {d: Affine.index(d) for d in range(len(out))}
        shifted[dim] = Affine.index(dim, 1, 1)
        kind = _kind(example_tensor(n).dtype)
        return coerce(_arith("sub", ia.substitute(y, shifted, out), ia.substitute(
            y, {d: Affine.index(d) for d in range(len(out))}, out), where), kind, where)

    def _cumsum(self, n, out, kind, where) -> Value:
        dim = (n.args[1] if len(n.args) > 1 else n.kwargs["dim"]) % len(out)
        v = coerce(self.values[n.args[0]], "int", where) if kind == "int" else None
        if not isinstance(v, Affine) or v.coefs:
            raise Unknown(f"{where}: a running sum of anything but one integer constant")
        return Affine.index(dim, v.const, v.const)  # element i: (i + 1) * the constant
