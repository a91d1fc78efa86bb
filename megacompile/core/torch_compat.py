"""Every private PyTorch API megacompile touches, in one place.

PyTorch's internals move between releases (we support 2.11 to 2.13). Nothing outside this
module imports from ``torch._*``; when a release moves something, this is the one file to fix.
"""
from __future__ import annotations

import contextlib
import inspect
import types
from typing import Any, Callable, Sequence

import torch
import torch._dynamo.external_utils
import torch._guards
import torch._logging._internal
import torch.fx as fx
import torch.optim.optimizer as optim_module
from torch._dynamo import list_backends, register_backend
from torch._dynamo.exc import BackendCompilerFailed, ShortenTraceback  # noqa: F401
from torch._dynamo.resume_execution import ContinueExecutionCache
from torch._dynamo.source import ConstantSource
from torch._dynamo.symbolic_convert import InstructionTranslator
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.amp.autocast_mode import _enter_autocast, _exit_autocast
from torch.fx.experimental import symbolic_shapes as sym
from torch.fx.experimental.proxy_tensor import is_sym_node as _is_sym_node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import _disable_current_modes


def passthrough_exception_base() -> type:
    """A base class whose exceptions Dynamo re-raises to the user unwrapped.

    Dynamo wraps any other backend exception in ``BackendCompilerFailed``; users of
    megacompile should be able to write ``except megacompile.BudgetError``.
    """
    return ShortenTraceback


def dynamo_input_source_name(placeholder: fx.Node) -> str | None:
    """The user-facing source of a Dynamo graph input, e.g. ``G['model']._modules['0']...``."""
    grapharg = placeholder.meta.get("grapharg")
    if grapharg is None or getattr(grapharg, "source", None) is None:
        return None
    try:
        return grapharg.source.name
    except Exception:  # pragma: no cover - source kinds without a name
        return None


def wrap_in_autocast(gm: fx.GraphModule, device_type: str, dtype: torch.dtype) -> None:
    """Make the whole Dynamo graph run under ``torch.autocast(device_type, dtype)``.

    Inserts the ``_enter_autocast`` / ``_exit_autocast`` nodes Dynamo itself records for a
    ``with torch.autocast(...)`` block, around every op of the graph, so AOTAutograd traces
    the forward with autocast's casts and the backward outside it, exactly as an eager step
    under ``with torch.autocast(...): loss = ...`` followed by ``loss.backward()``.
    """
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    output = next(iter(graph.find_nodes(op="output")))
    if placeholders:
        with graph.inserting_after(placeholders[-1]):
            enter = graph.call_function(_enter_autocast, (device_type, dtype, True, None))
    else:
        with graph.inserting_before(next(iter(graph.nodes))):
            enter = graph.call_function(_enter_autocast, (device_type, dtype, True, None))
    with graph.inserting_before(output):
        graph.call_function(_exit_autocast, (enter,))
    gm.recompile()


def retarget_autocast_regions(gm: fx.GraphModule, device_type: str = "cuda") -> bool:
    """Makes the step's own ``with torch.autocast("cuda", ...)`` regions (Dynamo records them as
    ``_enter_autocast`` nodes) CPU autocast regions, since the trace runs on host tensors, where
    CUDA autocast casts nothing (the caller traces them under CUDA's op lists). Whether there
    were any."""
    found = False
    for node in gm.graph.find_nodes(op="call_function", target=_enter_autocast):
        if node.args and node.args[0] == device_type:
            node.args = ("cpu", *node.args[1:])
            found = True
    if found:
        gm.recompile()
    return found


def traces_under_autocast(gm: fx.GraphModule) -> bool:
    """Whether AOTAutograd's trace of ``gm`` runs any op under autocast: the graph opens an
    autocast region, or the caller's CPU autocast is on."""
    return torch.is_autocast_enabled("cpu") or any(
        True for _ in gm.graph.find_nodes(op="call_function", target=_enter_autocast))


def ambient_cuda_autocast_dtype() -> torch.dtype | None:
    """The dtype of a ``torch.autocast("cuda")`` the caller is inside of (Dynamo compiles a
    function called in one without recording it in the graph), or None."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def autocast_disabled():
    """A context where no autocast (any device) applies: a program whose casts are explicit."""
    return torch._C._DisableAutocast()


# --- AOTAutograd ------------------------------------------------------------------------
from torch._functorch import partitioners as _partitioners  # noqa: E402
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: E402,F401

try:  # AOTAutograd's input/output descriptors (node.meta["desc"] of the joint graph)
    from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput as _InputMutation  # noqa: E402
except ImportError:  # pragma: no cover (a release without descriptors)
    _InputMutation = None


def is_primal(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.target.startswith("primals")


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.target.startswith("tangents")


def is_forward_tagged(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_forward"


def is_backward_tagged(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def mutated_inputs(joint: fx.GraphModule) -> list[fx.Node]:
    """The joint graph's placeholders whose value the step updates in place (a BatchNorm's
    running statistics, ``num_batches_tracked``). AOTAutograd's forward returns their new
    values and its runtime copies them into the inputs once the forward has run, so in the
    backward such an input holds its updated value (and autograd refuses it as a saved
    tensor: its version moved). Read from the output's descriptors
    (``InputMutationAOTOutput``); none where a release records no descriptors."""
    output = next(iter(joint.graph.find_nodes(op="output")))
    descs = output.meta.get("desc") if _InputMutation is not None else None
    if not descs:
        return []
    mutated = {d.mutated_input for d in descs if isinstance(d, _InputMutation)}
    return [n for n in joint.graph.find_nodes(op="placeholder") if n.meta.get("desc") in mutated]


def extract_forward_backward(
    joint: fx.GraphModule,
    saved_values: list[fx.Node],
    saved_sym_nodes: list[fx.Node],
    num_fwd_outputs: int,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split a joint graph given the values the forward saves for the backward.

    Forward nodes the backward needs but that are not saved are copied into the backward
    (recomputed there).
    """
    fn = _partitioners._extract_fwd_bwd_modules
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {"num_fwd_outputs": num_fwd_outputs}
    if "saved_opaque_nodes" in params:
        kwargs["saved_opaque_nodes"] = []
    with _each_extraction_once():
        return fn(joint, saved_values, saved_sym_nodes=saved_sym_nodes, **kwargs)


@contextlib.contextmanager
def _each_extraction_once():
    """``_extract_fwd_bwd_modules`` extracts the backward twice: once to find saved values it
    does not read, then again with the final inputs. Where nothing was dropped or reordered the
    second call has the same arguments as the first, and extraction is a pure function of
    them: the first graph (read only in between) is handed back instead of copying every
    backward node again (a sixth of each candidate plan's build)."""
    extract = _partitioners._extract_graph_with_inputs_outputs
    made: dict[tuple, fx.Graph] = {}

    def key(value):
        if isinstance(value, (list, tuple)):
            return tuple(map(id, value))
        return id(value) if isinstance(value, fx.Graph) else value

    def extract_once(*args, **kwargs):
        k = (tuple(map(key, args)), tuple(sorted((name, key(v)) for name, v in kwargs.items())))
        if k not in made:
            made[k] = extract(*args, **kwargs)
        return made[k]

    _partitioners._extract_graph_with_inputs_outputs = extract_once
    try:
        yield
    finally:
        _partitioners._extract_graph_with_inputs_outputs = extract


def save_everything_partition(joint: fx.GraphModule, num_fwd_outputs: int) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split a joint graph saving every forward value the backward reads (no recompute):
    AOTAutograd's ``default_partition``. Used for a marked layer's own joint graph, which
    AOTAutograd partitions once per distinct layer; the streaming passes decide later."""
    return _partitioners.default_partition(joint, [], num_fwd_outputs=num_fwd_outputs)


def is_compile_region(fn: Any) -> bool:
    """Whether ``fn`` is already wrapped by ``torch.compiler.nested_compile_region`` (the wrapper
    carries the attribute ``mark_compile_region`` sets, in 2.11 and 2.13)."""
    return hasattr(fn, "__marked_compile_region_fn__")


def is_sym_node(node: fx.Node) -> bool:
    return _is_sym_node(node)


# --- Fake tensors -----------------------------------------------------------------------
def fake_mode_of(gm: fx.GraphModule):
    """The FakeTensorMode the graph's ``meta['val']`` tensors belong to, if any."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode
    return None


def is_fake_tensor(x: Any) -> bool:
    return isinstance(x, FakeTensor)


def fake_like(val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``val``'s kind (fake, in its mode, symbolic sizes kept) with its shape,
    strides and device and another dtype."""
    mode = val.fake_mode if isinstance(val, FakeTensor) else contextlib.nullcontext()
    with mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=dtype, device=val.device)


def _autograd_dispatch_keys():
    outside = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._AutoDispatchBelowAutograd():
        return torch._C._dispatch_tls_local_exclude_set() - outside


_AUTOGRAD_KEYS = _autograd_dispatch_keys()  # (at import: outside any such guard)


@contextlib.contextmanager
def autograd_dispatch():
    """Autograd on again where the caller runs below it: a custom op called with inputs that
    require grad runs its kernel below autograd (``torch.library``'s no-grad forward), and there
    ``torch.enable_grad()`` alone records nothing for ``torch.autograd.grad``."""
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                         torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS):
        yield


def trace_aten(fn: Callable, args: Sequence[Any]) -> fx.GraphModule:
    """``fn`` traced to an aten graph (autograd and autocast included) on fake host tensors
    of the shapes and dtypes of ``args`` (tensors or lists of tensors); nothing is computed."""
    with no_dispatch_modes(), FakeTensorMode():
        def fake(x):
            if isinstance(x, (list, tuple)):
                return [fake(v) for v in x]
            if isinstance(x, torch.Tensor):
                return torch.empty(tuple(int_hint(d) for d in x.shape), dtype=x.dtype, device="cpu",
                                   requires_grad=False)
            return x
        return make_fx(fn, tracing_mode="real")(*[fake(a) for a in args])


# --- Inductor ---------------------------------------------------------------------------
def inductor_compile(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Compile an FX graph with Inductor (Triton on CUDA, C++ on CPU)."""
    from torch._inductor.compile_fx import compile_fx  # lazy: Inductor takes seconds to import

    return compile_fx(gm, list(example_inputs))


def inductor_compile_segment(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Compile a segment of a traced program with Inductor.

    Inductor traces the segment again, with its own decompositions, and those may lay a value
    out otherwise than the trace that made the segment: its ``cat`` of one non-empty tensor
    (a KV cache's empty start and the keys) clones the keys' transposed layout, where eager's
    ``cat`` is contiguous, and the trace's ``view`` of it then fails. Views run as reshapes
    (``layout_tolerant_target``)."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.target = layout_tolerant_target(node)
    gm.recompile()
    return inductor_compile(gm, example_inputs)


def symbolic_examples(inputs: Sequence[Any], varying: Sequence[Any], orders: Sequence[Any]) -> list:
    """Example inputs for Inductor like ``inputs`` where the sizes ``varying`` names are symbols,
    so that the kernels it compiles take any value there (dynamic shapes).

    ``varying[i]``: for a tensor, one entry per dim, None where the size is fixed and otherwise
    a key (equal keys: one symbol, as in the traced program); for an int, a key or None. A size
    of 0 or 1 stays a constant (Inductor specialises those). ``orders[i]``: a dense tensor's
    dims from the innermost out (its strides are products of the sizes in that order); None:
    the tensor is taken as it is, sizes and strides fixed.
    """
    shape_env = sym.ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    symbols: dict[Any, Any] = {}

    def size(key: Any, value: int) -> Any:
        if key is None or value < 2:
            return value
        if key not in symbols:
            source = ConstantSource(f"segment_size{len(symbols)}")
            expr = shape_env.create_symbol(value, source, dynamic_dim=sym.DimDynamic.DYNAMIC)
            symbols[key] = shape_env.create_symintnode(expr, hint=value, source=source)
        return symbols[key]

    out = []
    for x, keys, order in zip(inputs, varying, orders):
        if isinstance(x, torch.Tensor) and (keys is None or order is None):
            out.append(mode.from_tensor(x, static_shapes=True))
        elif isinstance(x, torch.Tensor):
            sizes = [size(k, v) for k, v in zip(keys, x.shape)]
            strides: list[Any] = [0] * x.dim()
            written: Any = 1
            for d in order:
                strides[d] = written
                written = written * sizes[d]
            with mode:
                out.append(torch.empty_strided(sizes, strides, dtype=x.dtype, device=x.device))
        elif isinstance(x, int) and not isinstance(x, bool):
            out.append(size(keys, x))
        else:
            out.append(x)
    return out


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def layout_tolerant_target(node: fx.Node) -> Any:
    """The op to run for a traced node: a view that nothing writes through runs as a reshape.

    A value's strides at run time are not always the trace's: a fake tensor's strides may not
    be the eager kernel's (2.13, CPU: ``softplus_backward`` of a transposed gradient keeps its
    layout, its fake is contiguous; Qwen3-Next's gated delta rule then fails in plain
    ``torch.compile(backend="aot_eager")`` too), and a compiler may lay a value out otherwise.
    The trace's ``view`` of such a value fails. The graphs are functional, so a reshape is the
    same view wherever one is possible and a copy otherwise, at a view's dispatch cost."""
    if node.target in _VIEWS and not any(
            isinstance(user.target, OpOverload) and user.target._schema.is_mutable for user in node.users):
        return torch.ops.aten.reshape.default
    return node.target


def inductor_backend() -> Callable:
    """Plain Inductor as a Dynamo backend: the fallback for graphs megacompile declines."""
    from torch._inductor.compile_fx import compile_fx  # lazy: Inductor takes seconds to import

    return compile_fx


def no_dispatch_modes():
    """A context with no active Python dispatch modes (fake / functional tensor modes)."""
    return _disable_current_modes()


def int_hint(x) -> int:
    """A SymInt's value at the traced example (an int passes through).

    2.13 spells this ``optimization_hint``; earlier releases ``hint_int``.
    """
    if not isinstance(x, torch.SymInt):
        return int(x)

    for name in ("optimization_hint", "hint_int"):
        fn = getattr(sym, name, None)
        if fn is not None:
            return int(fn(x))
    return int(x.node.hint)


# --- Op types and small private entry points --------------------------------------------
OpOverload = torch._ops.OpOverload
HigherOrderOperator = torch._ops.HigherOrderOperator


# The functional linear as Dynamo records it (``F.linear`` is this builtin).
NN_LINEAR = torch._C._nn.linear

# The CPU flash attention op (what sdpa becomes on host tensors; ``megacompile plan`` calls it
# on meta tensors): (query, key, value, dropout_p, is_causal, *, attn_mask, scale).
CPU_FLASH_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def reset_dynamo() -> None:
    """Forget every compiled frame (``torch._dynamo.reset``)."""
    torch._dynamo.reset()


def register_dynamo_backend(fn, name: str) -> None:
    if name not in list_backends(exclude_tags=()):
        register_backend(fn, name=name)


def register_torch_logs(name: str = "megatrain", logger: str = "megacompile") -> None:
    """Let torch's logging system switch the ``megacompile`` loggers by ``name``:
    ``torch._logging.set_logs(modules={"megatrain": logging.INFO})``, and ``TORCH_LOGS`` where
    the name was registered before torch read it (megacompile_autoload.py, the same call)."""
    torch._logging._internal.register_log(name, [logger])


def has_composite_implicit_kernel(op) -> bool:
    return bool(op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd))


def foreach_add_(tensors, scalar) -> None:
    torch._foreach_add_(tensors, scalar)


def fused_adam_(decoupled: bool):
    """torch's fused CPU Adam / AdamW kernels (``torch._fused_adam_`` / ``_fused_adamw_``)."""
    return torch._fused_adamw_ if decoupled else torch._fused_adam_


# --- What may run between backward() and optimizer.step() (megacompile/optimizer/overlap.py) ---------
def is_dynamo_resume_function_name(name: str) -> bool:
    """Dynamo continues a frame after a graph break in a generated function of this name."""
    return name.startswith("__resume_at_")


def is_dynamo_resume_code(value) -> bool:
    """A resume function's code object. 2.13 loads a resume function by its global name
    (``is_dynamo_resume_function_name``); 2.11 builds one that has a closure from a constant
    code object (LOAD_CONST code; MAKE_FUNCTION), whose name carries this prefix."""
    return isinstance(value, types.CodeType) and value.co_name.startswith("torch_dynamo_resume_in_")


def optimizer_has_step_hooks(opt: torch.optim.Optimizer) -> bool:
    """Any step pre/post hook, on this optimizer or global (they could read gradients)."""
    return bool(
        getattr(opt, "_optimizer_step_pre_hooks", None) or getattr(opt, "_optimizer_step_post_hooks", None)
        or getattr(optim_module, "_global_optimizer_pre_hooks", None)
        or getattr(optim_module, "_global_optimizer_post_hooks", None)
    )


def tensor_has_grad_hooks(t: torch.Tensor) -> bool:
    """Hooks on a leaf's gradient (``register_hook``, ``register_post_accumulate_grad_hook``)."""
    return bool(getattr(t, "_backward_hooks", None) or getattr(t, "_post_accumulate_grad_hooks", None))


def backward_keeps_graph() -> bool:
    """Whether the backward running on this thread was called with ``retain_graph=True``: autograd
    then holds every saved tensor until the graph is freed (AOTAutograd reads the same flag)."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def at_backward_end(callback: Callable[[], None]) -> None:
    """Runs ``callback`` once the backward running on this thread has finished every node (the
    whole ``loss.backward()``), before it returns; an error it raises is the backward's. The
    engine's queue, as DDP and FSDP use it (nothing public does this)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def step_is_stock(opt: torch.optim.Optimizer) -> bool:
    """``opt.step`` is its class's step, possibly behind the LR scheduler's bookkeeping
    wrapper (which sets ``opt._opt_called`` and calls the class's step, nothing else)."""
    own = vars(opt).get("step")
    if own is None:
        return True
    return bool(getattr(own, "_wrapped_by_lr_sched", False)) and getattr(own, "__wrapped__", None) is type(opt).step


def note_optimizer_step_called(opt: torch.optim.Optimizer) -> None:
    """What the LR scheduler's wrapper of ``opt.step`` records at every call (its check that
    ``optimizer.step()`` ran before ``scheduler.step()``)."""
    opt._opt_called = True


def set_instance_step(opt: torch.optim.Optimizer, step) -> None:
    """Install ``step`` as ``opt.step`` on the instance, as an LR scheduler's wrapper is
    installed: flagged as that wrapper, so a scheduler made later neither wraps it again nor
    warns that ``step`` was overridden (``step`` must call ``note_optimizer_step_called``)."""
    step._wrapped_by_lr_sched = True
    opt.step = step


def dynamo_resume_code(fn):
    """The code of a Dynamo resume function. For a frame with a closure Dynamo's global is a
    factory that builds the function from its ``code`` cell; this returns that code."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    closure = getattr(fn, "__closure__", None) or ()
    if "code" in code.co_freevars and closure:
        inner = closure[code.co_freevars.index("code")].cell_contents
        if isinstance(inner, types.CodeType):
            return inner
    return code


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's in-place modification counter (bumped by every in-place op on it)."""
    return t._version


def is_activation_checkpoint(target) -> bool:
    """A region under ``torch.utils.checkpoint`` as Dynamo records it (``tag_activation_checkpoint``)."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    return hop is not None and target is hop


def is_custom_autograd_function(target) -> bool:
    """A ``torch.autograd.Function`` as Dynamo records it (``autograd_function_apply``): AOTAutograd
    traces its forward into the forward graph and its own backward into the backward graph."""
    hop = getattr(torch.ops.higher_order, "autograd_function_apply", None)
    return hop is not None and target is hop


def is_invoke_subgraph(target) -> bool:
    """A call of a ``torch.compiler.nested_compile_region`` body (``invoke_subgraph``)."""
    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    return hop is not None and target is hop


def invoke_subgraph_operands(call: fx.Node) -> list:
    """The body's inputs among an ``invoke_subgraph`` call's arguments, in the order of the
    body's placeholders: the call is ``invoke_subgraph(body, identifier, *operands)``."""
    return list(call.args[2:])


def region_calls(gm: fx.GraphModule) -> dict[fx.GraphModule, list[fx.Node]]:
    """The ``nested_compile_region`` calls in ``gm``'s own graph, by body (one body may be a
    ``gm`` attribute under several names: Dynamo reuses a traced body)."""
    calls: dict[fx.GraphModule, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and is_invoke_subgraph(n.target) and n.args[0].op == "get_attr":
            calls.setdefault(getattr(gm, n.args[0].target), []).append(n)
    return calls


def set_invoke_subgraph_operands(call: fx.Node, operands: list) -> None:
    """Passes ``operands`` to the call's body instead (after its placeholders changed alike)."""
    call.args = (*call.args[:2], *operands)


def _operand_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (type(value), tuple(str(s) for s in value.shape), tuple(str(s) for s in value.stride()),
                value.dtype, value.device, value.requires_grad)
    return (type(value), str(value))


class invoke_subgraph_schema_memo:
    """While AOTAutograd traces one step graph: each marked layer's schema derived once.

    Under autograd, every call of an ``invoke_subgraph`` body first derives the body's
    schema to refuse in-place input mutation (``HigherOrderOperator.py_autograd_impl``), and
    ``invoke_subgraph.gen_schema`` re-traces the whole body to do so, at every call, for every
    layer. The schema depends on the body (one per identifier
    within a graph) and on its operands' metadata only, so it is kept for the duration of
    one AOTAutograd call, keyed by both. Where the operator or its ``gen_schema`` is missing
    (another release), nothing is changed.
    """

    def __enter__(self):
        self.hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
        if self.hop is None or "gen_schema" not in type(self.hop).__dict__ or "gen_schema" in vars(self.hop):
            self.hop = None
            return self
        derive = self.hop.gen_schema  # the class's method, bound to the operator
        memo: dict = {}

        def gen_schema(subgraph, identifier, *operands):
            key = (identifier, tuple(_operand_key(o) for o in operands))
            if key not in memo:
                memo[key] = derive(subgraph, identifier, *operands)
            return memo[key]

        self.hop.gen_schema = gen_schema  # an instance attribute: shadows the method until __exit__
        return self

    def __exit__(self, *exc) -> None:
        if self.hop is not None:
            del self.hop.gen_schema


# --- Which user function a graph comes from ----------------------------------------------
# The frame Dynamo compiles for ``torch.compile(module)``: a wrapper around the module's call.
_MODULE_WRAPPER_CODE = torch._dynamo.external_utils.wrap_inline(lambda: None).__code__


def compiling_owner() -> Any:
    """What the user handed ``torch.compile`` for the frame Dynamo is compiling now (inside a
    backend call): the function's code object, with a resume function (the rest of a frame
    after a graph break) mapped back to the function it was cut from, or the module for a
    compiled module. None outside a Dynamo compile."""
    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # no translator on this thread: not inside a Dynamo compile
        return None
    code = tx.f_code
    if code is _MODULE_WRAPPER_CODE and getattr(tx, "closure", None):
        wrapped = tx.closure[0].cell_contents
        return wrapped if isinstance(wrapped, torch.nn.Module) else getattr(wrapped, "__code__", code)
    seen = set()
    while id(code) not in seen:
        seen.add(id(code))
        meta = ContinueExecutionCache.generated_code_metadata.get(code)
        if meta is None:
            break
        code = meta.code
    return code


def frame_compile_count() -> tuple[types.CodeType, int] | None:
    """Inside a backend call: the code of the frame Dynamo is compiling and how many times it
    compiled that frame before (0 the first time; each guard failure compiles it again, up to
    ``torch._dynamo.config.recompile_limit``). None outside a Dynamo compile."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # no translator on this thread: not inside a Dynamo compile
        return None
    if compile_id is None or compile_id.frame_compile_id is None:
        return None
    return tx.f_code, compile_id.frame_compile_id


def recompile_limit() -> int:
    """How many times Dynamo compiles one frame before it runs it uncompiled."""
    return int(getattr(torch._dynamo.config, "recompile_limit", None)
               or getattr(torch._dynamo.config, "cache_size_limit", 8))


def compiled_owner(fn: Any) -> Any:
    """The key ``compiling_owner`` files ``fn``'s graphs under: for a function (or the wrapper
    ``torch.compile`` returned for it) its code object; for a module (or its compiled
    wrapper) the module."""
    if isinstance(fn, torch.nn.Module):
        return getattr(fn, "_orig_mod", fn)  # a compiled module's wrapper: the module
    fn = getattr(fn, "_torchdynamo_orig_callable", fn)
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    return getattr(fn, "__code__", None)


# --- FX node hooks --------------------------------------------------------------------------
def add_node_hooks(gm: fx.GraphModule, on_create: Callable[[fx.Node], Any], on_erase: Callable[[fx.Node], Any]) -> None:
    """Call ``on_create`` / ``on_erase`` for every node created in / erased from ``gm``'s graph
    (the hooks torch's GraphTransformObserver uses for provenance)."""
    gm._register_create_node_hook(on_create)
    gm._register_erase_node_hook(on_erase)


def remove_node_hooks(gm: fx.GraphModule, on_create: Callable[[fx.Node], Any],
                      on_erase: Callable[[fx.Node], Any]) -> None:
    gm._unregister_create_node_hook(on_create)
    gm._unregister_erase_node_hook(on_erase)


def register_host_memory(t: torch.Tensor) -> None:
    """Page-lock ``t``'s memory in place for the CUDA driver (``cudaHostRegister``): exactly
    its bytes, no copy, unlike ``pin_memory()`` whose caching allocator rounds each block up
    to a power of two. ``torch.cuda.cudart()`` is the runtime binding torch itself uses for this."""
    code = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.untyped_storage().nbytes(), 0))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {t.untyped_storage().nbytes()} bytes failed with cudaError {code}")


# cudaErrorHostMemoryAlreadyRegistered: the range is page-locked already (another mapping's
# registration of the same shared pages, or an earlier call), which is what was asked.
_ALREADY_REGISTERED = 712


def register_host_storage(storage: torch.UntypedStorage) -> None:
    """Page-lock a whole storage in place (``register_host_memory`` for a storage that views
    of it share: a data-parallel host's one shared copy of the weights)."""
    code = int(torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0))
    if code not in (0, _ALREADY_REGISTERED):
        raise RuntimeError(f"cudaHostRegister of {storage.nbytes()} bytes failed with cudaError {code}")


def unregister_host_memory(data_ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(data_ptr)


def storage_use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage: every tensor or view over it holds one (torch's CUDA
    graph trees read liveness the same way). Compare counts taken alike: the call itself holds
    one through the storage object it makes."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


# --- torch.profiler -----------------------------------------------------------------------
_autograd_profiler = torch.autograd.profiler


def profiler_enabled() -> bool:
    """Whether any torch profiler (``torch.profiler.profile``, ``emit_nvtx``, ``emit_itt``) is
    recording in this process: the process-wide flag torch sets for its own fast checks, one
    attribute read, true on every thread (the C++ ``_profiler_enabled()`` is per thread)."""
    return _autograd_profiler._is_profiler_enabled


def nvtx_profiler_on_this_thread() -> bool:
    """Whether ``emit_nvtx`` is active on this thread (its record_function ranges already
    become NVTX ranges, so a second, explicit one would duplicate them)."""
    return torch._C._autograd._profiler_type() == torch._C._profiler.ActiveProfilerType.NVTX


def profile_all_threads_config() -> Any:
    """``experimental_config`` for ``torch.profiler.profile`` that records threads the profiler
    did not start (megatrain's host optimizer worker); without it only the thread that
    entered the profiler is recorded."""
    return torch.profiler._ExperimentalConfig(profile_all_threads=True)


# --- the dispatcher (core/autocast_lists.py) ----------------------------------------------
def ops_with_kernel_for(dispatch_key: str) -> set[str]:
    """Qualified names (``aten::mm``, ``aten::pow.Scalar``) of the ops with a kernel of their own
    at ``dispatch_key`` (e.g. ``AutocastCPU``: the ops CPU autocast lists), fallbacks excluded."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return {name for name in torch._C._dispatch_get_all_op_names() if has(name, dispatch_key)}


def destroy_library(library) -> None:
    """Unregisters every kernel a ``torch.library.Library`` registered."""
    library._destroy()
