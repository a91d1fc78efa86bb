"""elide_causal_mask: an attention mask proven causal becomes ``is_causal=True``, and its
construction is removed.

Under ``torch.compile`` Hugging Face's ``sdpa_mask`` builds the causal mask as a tensor (its
``is_causal`` shortcut is off while Dynamo traces): a (tokens x tokens) bool mask, read by
every layer's ``scaled_dot_product_attention``. At long context that mask, not a layer, is
what fills the device. This pass runs on Dynamo's graph (stage ``dynamo``) and, for each
attention call with a mask, interprets the mask's producers in the index algebra
(``core/mask_interpreter``): when the mask is, for every query q and key k, exactly
``k <= q`` (bool) or ``0 / -inf`` (additive) and the query and key lengths are equal, the call
gets ``attn_mask=None, is_causal=True`` (the same attention: sdpa's causal mask is ``k <= q``
when the lengths are equal) and the producers nothing else reads are erased.

Marked layers (``nested_compile_region``) attend inside their one traced body, the mask an
input of it: the body's mask is interpreted once per call, its inputs holding what that call
passes, and rewritten only if it is causal at every call; the input it no longer reads is
then dropped from the body and from each call, so the step builds no mask.

A mask built from values unknown at compile time (an ``attention_mask`` input, padding), a
sliding window, an offset, different lengths, or any op the algebra does not cover leaves
the call as it was; the reason is in the attention node's ``meta["custom"]``, which
AOTAutograd copies to the aten nodes traced from it, and ``annotate`` puts it in
``NodeInfo.attention_mask`` (``inspect`` shows it). Attention calls: ``F.scaled_dot_product_attention``
and the CPU flash op ``megacompile plan`` traces on meta tensors.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from megacompile.core import index_algebra as ia
from megacompile.core import torch_compat as compat
from megacompile.core.index_algebra import Unknown
from megacompile.core.mask_interpreter import MaskInterpreter, example_tensor, static_shape
from megacompile.core.torch_compat import CPU_FLASH_ATTENTION
from megacompile.passes.contract import PassContract

CONTRACT = PassContract(name="elide_causal_mask", stages=("dynamo",), provides=frozenset({"causal_masks_elided"}),
                        uses=frozenset({"operators_canonical"}))

NOTE_KEY = "megatrain_attention_mask"  # in node.meta["custom"] (AOTAutograd copies "custom" to the aten nodes)

# target -> (index of attn_mask, index of is_causal) among the positional arguments, or None
# where the argument is keyword-only.
_ATTENTION = {
    F.scaled_dot_product_attention: (3, 5),
    CPU_FLASH_ATTENTION: (None, 4),
    CPU_FLASH_ATTENTION.default: (None, 4),
}


class _Call:
    """One attention call's mask and causal flag, wherever they are passed."""

    def __init__(self, node: fx.Node) -> None:
        self.node = node
        self.mask_at, self.causal_at = _ATTENTION[node.target]

    def _get(self, at, name, default):
        if at is not None and len(self.node.args) > at:
            return self.node.args[at]
        return self.node.kwargs.get(name, default)

    def _set(self, at, name, value) -> None:
        if at is not None and len(self.node.args) > at:
            args = list(self.node.args)
            args[at] = value
            self.node.args = tuple(args)
        else:
            self.node.kwargs = {**self.node.kwargs, name: value}

    @property
    def mask(self):
        return self._get(self.mask_at, "attn_mask", None)

    @property
    def causal(self):
        return self._get(self.causal_at, "is_causal", False)

    def make_causal(self) -> None:
        self._set(self.mask_at, "attn_mask", None)
        self._set(self.causal_at, "is_causal", True)


def _note(node: fx.Node, text: str) -> None:
    node.meta["custom"] = {**node.meta.get("custom", {}), NOTE_KEY: text}


def _prove(call: _Call, interpreter: MaskInterpreter) -> str:
    """Why the call's mask is the causal mask (a note), or ``Unknown`` saying why it may not be."""
    mask = call.mask
    if not isinstance(mask, fx.Node) or example_tensor(mask) is None:
        raise Unknown("the mask is not a tensor of this graph")
    if call.causal is not False:
        raise Unknown(f"is_causal is {call.causal!r} as well as a mask")
    query, key = example_tensor(call.node.args[0]), example_tensor(call.node.args[1])
    if query is None or key is None or query.dim() < 2:
        raise Unknown("the query / key are not tensors of this graph")
    if not all(isinstance(d, int) for d in (*query.shape, *key.shape)):
        raise Unknown(f"symbolic shapes (query {tuple(query.shape)}, key {tuple(key.shape)})")
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if q_len != kv_len:
        raise Unknown(f"{q_len} queries attend to {kv_len} keys (is_causal aligns the mask to the top left)")
    shape = static_shape(mask)
    ndim = query.dim()
    if len(shape) > ndim:
        raise Unknown(f"a mask of {len(shape)} dims for a query of {ndim}")
    out = tuple(query.shape[:-2]) + (q_len, kv_len)
    if any(s not in (1, o) for s, o in zip(shape, out[ndim - len(shape):])):
        raise Unknown(f"a mask of shape {tuple(shape)} for scores of shape {out}")
    value = ia.substitute(interpreter.value(mask), {d: ia.Affine.index(d + ndim - len(shape))
                                                    for d in range(len(shape))}, out)
    why_not = ia.is_causal(value, ndim, q_len)
    if why_not:
        raise Unknown(why_not)
    kind = "bool" if example_tensor(mask).dtype == torch.bool else "additive"
    return (f"causal: the {kind} mask ({mask.name}) is k <= q for every query q and key k ({q_len} x {kv_len}), "
            f"proven from its construction; attention runs with is_causal=True and no mask")


def _erase_dead(graph: fx.Graph, nodes: set[fx.Node]) -> int:
    """Erases the interpreted nodes (pure by construction) that nothing reads any more."""
    erased = 0
    for node in reversed(list(graph.nodes)):
        if node in nodes and node.op != "placeholder" and not node.users:
            graph.erase_node(node)
            erased += 1
    return erased


def _elide_in(graph: fx.Graph, interpreter_for) -> set[fx.Node]:
    """Every attention call of ``graph`` whose mask is proven causal gets ``is_causal=True``;
    ``interpreter_for(call)`` gives the interpreters to prove it with (all must). Returns the
    nodes interpreted (what may have become dead)."""
    interpreted: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _ATTENTION:
            continue
        call = _Call(node)
        if call.mask is None:
            continue
        notes = []
        try:
            for where, interpreter in interpreter_for(call):
                try:
                    notes.append(_prove(call, interpreter))
                finally:
                    interpreted |= set(interpreter.values)
                notes[-1] += where
        except Unknown as why:
            _note(node, f"kept: {why}")
            continue
        call.make_causal()
        _note(node, notes[0])
    return interpreted


def _called_inside_a_region(gm: fx.GraphModule, body: fx.GraphModule) -> bool:
    """Whether some region's body reads ``body`` too (a region called inside another): its calls
    there pass masks this pass does not see, so the body is left as it is."""
    for _, module in gm.named_modules():
        if module is gm or not isinstance(module, fx.GraphModule):
            continue
        if any(n.op == "get_attr" and getattr(module, n.target, None) is body for n in module.graph.nodes):
            return True
    return False


def _inputs_behind(node) -> set[fx.Node]:
    """The placeholders among a body node's producers."""
    seen, stack = set(), [node] if isinstance(node, fx.Node) else []
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return {n for n in seen if n.op == "placeholder"}


def _interpreters_at_calls(name: str, body: fx.GraphModule, calls: list[fx.Node], outer: MaskInterpreter):
    """For one attention call of a region's body: per call of the region, an interpreter of the
    body whose inputs behind the mask hold what that call passes (their values at the call
    site, where the algebra knows them). A body is traced once for all its calls, so its mask
    is causal only if it is at every call."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]

    def interpreters(attention: _Call):
        behind = _inputs_behind(attention.mask)
        for call in calls:
            inner = MaskInterpreter()
            for p, operand in zip(placeholders, compat.invoke_subgraph_operands(call)):
                if p not in behind:
                    continue
                try:
                    if not isinstance(operand, fx.Node):
                        raise Unknown(f"{operand!r} is not a tensor")
                    inner.values[p] = outer.value(operand)
                except Unknown as why:
                    inner.failed[p] = f"the layer region's input {p.name} at its call '{call.name}': {why}"
            yield f" (inside the layer region '{name}', at each of its {len(calls)} call(s))", inner
    return interpreters


def _drop_unread_inputs(body: fx.GraphModule, calls: list[fx.Node], candidates: set[fx.Node]) -> None:
    """Removes the body's inputs among ``candidates`` that nothing reads any more (an elided
    mask), from the body and from every call of it."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    unread = {i for i, p in enumerate(placeholders) if p in candidates and not p.users}
    if not unread:
        return
    for i in sorted(unread, reverse=True):
        body.graph.erase_node(placeholders[i])
    for call in calls:
        compat.set_invoke_subgraph_operands(
            call, [o for i, o in enumerate(compat.invoke_subgraph_operands(call)) if i not in unread])


def run(gm: fx.GraphModule, ctx) -> None:
    interpreter = MaskInterpreter()
    _elide_in(gm.graph, lambda call: [("", interpreter)])
    # Attention inside marked layers (torch.compiler.nested_compile_region): the mask is built
    # in the step and passed to every call of the layer's body.
    for body, calls in compat.region_calls(gm).items():
        if _called_inside_a_region(gm, body):
            continue
        name = calls[0].args[0].target
        interpreted = _elide_in(body.graph, _interpreters_at_calls(name, body, calls, interpreter))
        if interpreted:
            _erase_dead(body.graph, interpreted)
            _drop_unread_inputs(body, calls, interpreted)
            body.graph.lint()
            body.recompile()
    _erase_dead(gm.graph, set(interpreter.values))
    gm.graph.lint()
    gm.recompile()
