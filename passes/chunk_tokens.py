"""chunk_tokens: runs of per-token ops inside a layer become one op over chunks of tokens.

Runs on the graph Dynamo captured (stage ``dynamo``, after ``fuse_lm_head``), so the op's own
autograd formula (``megacompile.core.token_chunks``) makes the backward. A run is a connected
set of ops of one layer that each treat every token alone, recognised by what the op is, not
by module names:

- ``F.linear`` / ``nn.Linear``, ``x @ W`` and ``torch.addmm(b, x, W)`` with ``W`` not a token value;
- pointwise arithmetic and activations, dtype casts, ``.contiguous()``;
- ``mean`` / ``sum`` over the last dimension with ``keepdim=True`` (a hand-written RMSNorm),
  ``F.layer_norm`` / ``F.rms_norm`` over the last dimension;
- reshapes that keep the last dimension and the token count (GPT-2's ``Conv1D`` flattens tokens);
  a dropout that drops nothing (p=0 or not training).

Every token operand has the op's leading (token) shape; anything else it reads (weights, a
norm's scale, a bias) is a *shared* input of the run. A run is replaced where its
intermediates hold more bytes than its inputs and outputs (an MLP, a norm followed by
projections), by ``token_chunked(body, chunks, tokens, shared)``; attention and everything
else that mixes tokens stays as it was.

Option ``token_chunks``: an int forces that many chunks on every run; ``"auto"`` leaves the
graph alone unless the step does not fit the budget without it, and then the planner picks the
chunk count (``capture/training_compiler``: the fewest chunks whose plan fits).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from megacompile.core import token_chunks
from megacompile.core.node_info import layer_of_module_path, normalize_module_path
from megacompile.core.torch_compat import NN_LINEAR
from megacompile.passes.contract import PassContract

CONTRACT = PassContract(name="chunk_tokens", stages=("dynamo",),
                        uses=frozenset({"lm_head_fused", "operators_canonical"}),
                        provides=frozenset({"tokens_chunked"}))

NOTE_KEY = "megatrain_token_chunks"  # in node.meta["custom"]: why a layer's runs were left alone
PLANNER_CHOOSES = "planner"  # options.token_chunks while the planner picks the count (set by the backend)

_LINEAR = {F.linear, NN_LINEAR}
_MATMUL = {operator.matmul, torch.matmul}
_POINTWISE = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.sqrt, torch.exp,
    torch.tanh, torch.sigmoid, torch.relu, torch.erf, F.silu, F.gelu, F.relu, F.tanh, F.sigmoid,
}
_POINTWISE_METHODS = {"add", "sub", "mul", "div", "truediv", "pow", "neg", "rsqrt", "sqrt", "exp", "tanh",
                      "sigmoid", "relu", "float", "half", "bfloat16", "to", "type_as", "contiguous"}
_NORMS = {F.layer_norm, F.rms_norm}
_RESHAPE_METHODS = {"view", "reshape", "flatten"}
_IDENTITY = "identity"


def _val(node):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _static_tensor(val) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and all(isinstance(d, int) for d in val.shape) \
        and val.is_floating_point()


def _tokens(val) -> int:
    return val.numel() // max(1, val.shape[-1])


def _layer(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, _type = list(stack.values())[-1]
    return layer_of_module_path(normalize_module_path(path))


def _arg(node, i, name, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


class _Classifier:
    """Which Dynamo nodes are per-token ops, and which of their operands are token values."""

    def __init__(self) -> None:
        self.kind: dict[fx.Node, str] = {}  # per-token node -> "op" or _IDENTITY (a reshape in rows)

    def token_operands(self, node: fx.Node) -> list[fx.Node] | None:
        """The node's token operands if it is a per-token op, else None."""
        out = _val(node)
        if node.op not in ("call_function", "call_method") or not _static_tensor(out):
            return None
        lead = tuple(out.shape[:-1])
        tensors = [a for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]
        # A token operand has the op's leading (token) shape; the weight of a projection never is one.
        is_token = {a: _static_tensor(_val(a)) and tuple(_val(a).shape[:-1]) == lead for a in tensors}
        target = node.target
        first = node.args[0] if node.args else None
        if node.op == "call_function" and (target in _LINEAR or target in _MATMUL):
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            if target in _MATMUL and (_val(weight) is None or _val(weight).dim() != 2):
                return None
            others = [a for a in tensors if a is not first]
            ok = isinstance(first, fx.Node) and is_token.get(first) and all(
                _val(a).dim() <= 2 and (a is weight or _val(a).dim() == 1) for a in others)
            return [first] if ok else None
        if node.op == "call_function" and target is torch.addmm:
            x = node.args[1] if len(node.args) > 1 else None
            bias = node.args[0]
            ok = isinstance(x, fx.Node) and is_token.get(x) and (not isinstance(bias, fx.Node) or _val(bias).dim() == 1)
            return [x] if ok and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1 else None
        if (node.op == "call_method" and target in _RESHAPE_METHODS) or (
                node.op == "call_function" and target in (torch.reshape, torch.flatten)):
            src = _val(first) if isinstance(first, fx.Node) else None
            if _static_tensor(src) and src.shape[-1] == out.shape[-1] and src.numel() == out.numel():
                self.kind[node] = _IDENTITY
                return [first]
            return None
        if node.op == "call_function" and target is F.dropout:
            p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
            if isinstance(first, fx.Node) and is_token.get(first) and (p == 0 or training is False):
                self.kind[node] = _IDENTITY  # (a dropout that drops nothing; a random one is never replayed)
                return [first]
            return None
        if node.op == "call_function" and target in _NORMS:
            shape = _arg(node, 1, "normalized_shape")
            if isinstance(first, fx.Node) and is_token.get(first) and tuple(shape or ()) == (out.shape[-1],):
                return [first] if all(_val(a).dim() == 1 for a in tensors if a is not first) else None
            return None
        if node.op == "call_method" and target in ("mean", "sum"):
            dim, keep = _arg(node, 1, "dim"), _arg(node, 2, "keepdim", False)
            dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
            src = _val(first)
            if keep and src is not None and dims in ((-1,), (src.dim() - 1,)) and is_token.get(first) \
                    and tuple(src.shape[:-1]) == lead and len(tensors) == 1:
                return [first]
            return None
        pointwise = (node.op == "call_function" and target in _POINTWISE) or (
            node.op == "call_method" and target in _POINTWISE_METHODS)
        if not pointwise:
            return None
        if node.op == "call_method" and target == "to" and any(
                not isinstance(a, torch.dtype) for a in list(node.args[1:]) + list(node.kwargs.values())):
            return None  # a move between devices, or copy=...
        if target == "contiguous":
            self.kind[node] = _IDENTITY
        tokens = []
        for a in tensors:
            v = _val(a)
            if is_token[a]:
                if tuple(v.shape[:-1]) != lead or v.shape[-1] not in (1, out.shape[-1]):
                    return None
                tokens.append(a)
            elif v.dim() > 0 and any(d != 1 for d in v.shape[:-1]):
                return None  # varies along a token dimension without being a token value
        return tokens or None


def _find_runs(gm: fx.GraphModule) -> list[list[fx.Node]]:
    cls = _Classifier()
    operands: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        found = cls.token_operands(node)
        if found is not None and _layer(node):
            operands[node] = found
    parent = {n: n for n in operands}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node, ops in operands.items():
        for a in ops:
            if a in operands and _layer(a) == _layer(node):
                parent[root(a)] = root(node)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node in operands:
            groups.setdefault(root(node), []).append(node)
    runs = []
    for nodes in groups.values():
        members = set(nodes)
        if _convex(gm, members) and _worth_it(members, cls, operands):
            runs.append((nodes, cls, operands))
    return runs


def _convex(gm: fx.GraphModule, members: set) -> bool:
    """No path leaves the run and comes back (the run can become one node)."""
    tainted: set = set()
    for node in gm.graph.nodes:
        ins = node.all_input_nodes
        if node in members:
            if any(a in tainted for a in ins):
                return False
        elif any(a in members or a in tainted for a in ins):
            tainted.add(node)
    return True


def _bytes(val) -> int:
    return val.numel() * val.element_size()


def _worth_it(members: set, cls: _Classifier, operands: dict) -> bool:
    outputs = [n for n in members if any(u not in members for u in n.users)]
    inputs = {a for n in members for a in operands[n] if a not in members}
    inner = sum(_bytes(_val(n)) for n in members if n not in outputs and cls.kind.get(n) != _IDENTITY)
    return inner > sum(_bytes(_val(n)) for n in outputs) + sum(_bytes(_val(a)) for a in inputs)


def _linear_only(node: fx.Node, members: set) -> bool:
    """``node`` (a weight) is read inside the run only as a projection's weight or bias."""
    return all(u in members and u.op == "call_function" and u.target in _LINEAR and u.args[0] is not node
               for u in node.users)


def _replace(gm: fx.GraphModule, nodes: list[fx.Node], cls: _Classifier, operands: dict, options,
             renamed: dict) -> None:
    """Replaces one run; ``renamed`` maps the outputs of runs replaced before to their getitems."""
    members = set(nodes)
    operands = {n: [renamed.get(a, a) for a in operands[n]] for n in nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    token_in = list(dict.fromkeys(a for n in nodes for a in operands[n] if a not in members))
    shared_in = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                   if a not in members and a not in token_in))
    if any(not isinstance(_val(a), torch.Tensor) for a in shared_in) or any(
            a in operands[n] for n in nodes for a in shared_in):
        return  # a non-tensor input, or a value read both per token and whole: left alone
    if any(a in token_in for n in nodes for a in n.all_input_nodes if a not in operands[n]):
        return
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    first_user = min(order[u] for n in outputs for u in n.users if u not in members)
    if any(order[a] >= first_user for a in token_in + shared_in):
        return  # an input is made after a reader of the run's outputs: left alone
    # The run as a graph over (rows, width) tensors.
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, a in enumerate(token_in):
        env[a] = body.placeholder(f"token_{i}")
    for i, a in enumerate(shared_in):
        env[a] = body.placeholder(f"shared_{i}")
    for node in nodes:
        if cls.kind.get(node) == _IDENTITY:
            env[node] = env[node.args[0]]
        else:
            env[node] = body.node_copy(node, lambda a: env[a])
    body.output(tuple(env[n] for n in outputs))
    names = [getattr(n.target, "__name__", str(n.target)) for n in nodes if cls.kind.get(n) != _IDENTITY]
    key = token_chunks.register_body(token_chunks.ChunkBody(
        graph=fx.GraphModule(torch.nn.Module(), body), num_token_inputs=len(token_in),
        out_lead=[tuple(_val(n).shape[:-1]) for n in outputs], autocast=options.autocast_dtype, ops=names,
        autocast_lists=options.traced_autocast_lists))
    chunks = 1 if options.token_chunks == PLANNER_CHOOSES else int(options.token_chunks)
    graph = gm.graph
    anchor = min((u for n in outputs for u in n.users if u not in members), key=order.__getitem__)
    keep = {k: nodes[-1].meta[k] for k in ("nn_module_stack", "source_fn_stack", "stack_trace") if k in nodes[-1].meta}
    with graph.inserting_before(anchor):
        shared = []
        for a in shared_in:
            if options.autocast_dtype is not None and _val(a).dtype == torch.float32 and _linear_only(a, members):
                a = graph.call_method("to", (a, options.autocast_dtype))  # what autocast does to a projection's weight
            shared.append(a)
        op = graph.call_function(token_chunks.FORWARD, (key, chunks, list(token_in), shared))
        op.meta.update(keep)
        for i, n in enumerate(outputs):
            got = graph.call_function(operator.getitem, (op, i))
            got.meta.update(keep)
            got.meta["example_value"] = _val(n)
            n.replace_all_uses_with(got, delete_user_cb=lambda u: u not in members)
            renamed[n] = got
    for node in reversed(nodes):
        graph.erase_node(node)


def may_retry(options) -> bool:
    """Whether a step that does not fit is traced again with its runs chunked (option "auto")."""
    return options.token_chunks == "auto" and options.memory_budget is not None and \
        CONTRACT.name not in options.disable_passes


def chunks_now(options) -> bool:
    """Whether the pass chunks this trace (a count given, or the planner's retry): it then has to
    see every layer's ops in Dynamo's graph (the backend inlines marked layers' calls first)."""
    return options.token_chunks != "auto" and CONTRACT.name not in options.disable_passes


def applies(ctx) -> bool:
    """Only with a chunk count: an int given, or the planner's retry (option "auto" otherwise
    leaves Dynamo's graph as it is)."""
    return ctx.options.token_chunks != "auto"


def run(gm: fx.GraphModule, ctx) -> None:
    renamed: dict = {}
    for nodes, cls, operands in _find_runs(gm):
        _replace(gm, nodes, cls, operands, ctx.options, renamed)
    gm.graph.lint()
    gm.recompile()


def has_runs(gm: fx.GraphModule) -> bool:
    """Whether the pass would chunk anything in ``gm`` (the backend's retry asks before tracing again)."""
    return bool(_find_runs(gm))
