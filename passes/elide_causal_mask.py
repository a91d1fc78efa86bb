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


def run(gm: fx.GraphModule, ctx) -> None:
    interpreter = MaskInterpreter()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _ATTENTION:
            continue
        call = _Call(node)
        if call.mask is None:
            continue
        try:
            note = _prove(call, interpreter)
        except Unknown as why:
            _note(node, f"kept: {why}")
            continue
        call.make_causal()
        _note(node, note)
    _erase_dead(gm.graph, set(interpreter.values))
    gm.graph.lint()
    gm.recompile()
