"""Host optimizer updates overlapped with the backward.

A layer's parameters are updated on a host worker thread as soon as that layer's gradients
have landed on the host, while the device goes on with the backward of the layers before it.
The update consumes the gradient: the backward hands ``None`` back to autograd for those
parameters, so no host gradient buffer outlives its layer's update (parameters and the two
Adam states: 12 bytes per parameter at fp32, plus the gradients of the layers in flight).

When it is exact. Updating during ``loss.backward()`` is only equal to eager if nothing can
tell the difference. ``step_follows_backward`` proves that from the caller's bytecode: the
statements right after the ``backward()`` call must be ``opt.step()``, optionally a stock LR
scheduler's ``step()``, then ``opt.zero_grad()`` (set_to_none), for a stock Adam / AdamW
that the fused host kernel runs, with no optimizer step hooks and no gradient hooks on the
parameters. Then the only code that runs between the overlapped updates and the point where
eager would have cleared the gradients is ``opt.step()`` itself, which finds no gradients
(they were consumed), skips every parameter, and leaves parameters and state exactly as the
updates left them; whether that ``step()`` runs compiled or eagerly does not matter. When
``zero_grad()`` has run, eager has ``p.grad is None`` too. Anything else (gradient clipping,
a micro-batch that step() does not follow, a custom optimizer, ``zero_grad`` at the top of the loop,
hooks, the first step before the optimizer has state) runs the synchronous path unchanged,
and ``last_report().optimizer`` says why. With accumulation over micro-batches, the last
micro-batch's backward (the one ``step()`` follows) overlaps: its update adds the gradient
the earlier micro-batches accumulated, exactly as ``AccumulateGrad`` would.

The caller's bytecode is either the user's own (a compiled model inside an eager loop) or,
when the whole step is compiled, Dynamo's rewrite of it: after the graph break at
``backward()`` that code calls a resume function holding the rest of the user's statements
(``_torch_compat.is_dynamo_resume_function_name``). Either way the statements are read, never run.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import dis
import functools
import inspect
import os
import sys
import threading
import time
import weakref
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

import megacompile.runtime
from megacompile.core import torch_compat as compat
from megacompile.core.errors import GradientOutsideGraphsError
from megacompile.core.host_memory import check_host_allocation
from megacompile.optimizer.host_step import has_host_step, init_adam_state, kernel_available
from megacompile.optimizer.ownership import fused_kernel_runs
from megacompile.runtime import trace
from megacompile.runtime.data_parallel import GradientReducer, group_of, share_updated
from megacompile.runtime.gradient_sink import GradientSink
from megacompile.runtime.host_adam import fused_adam_step

# Instructions that only shuffle the value stack or mark positions: what Dynamo's rewritten
# frame does between the ``backward()`` call and the call of its resume function.
_STACK_ONLY = {
    "BUILD_LIST", "BUILD_TUPLE", "BUILD_SLICE", "COPY", "SWAP", "LOAD_CONST", "BINARY_SUBSCR",
    "STORE_SUBSCR", "DELETE_SUBSCR", "POP_TOP", "LIST_EXTEND", "LOAD_FAST", "STORE_FAST",
    "DELETE_FAST", "PUSH_NULL", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR",
    # Python 3.12 spells slicing of the stack lists with these instead of BUILD_SLICE + *_SUBSCR.
    "BINARY_SLICE", "STORE_SLICE",
}
# Instructions with no effect on what a statement does.
_IGNORED = {"CACHE", "NOP", "EXTENDED_ARG", "PRECALL", "PUSH_NULL", "RESUME"}
_NAME_LOADS = {"LOAD_GLOBAL", "LOAD_FAST", "LOAD_DEREF", "LOAD_NAME", "LOAD_FAST_CHECK"}
# Stock schedulers whose step() runs no user code (LambdaLR, CyclicLR's scale_fn and the
# composite schedulers can).
_STOCK_SCHEDULERS = (
    "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR", "PolynomialLR",
    "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "OneCycleLR",
)


@dataclasses.dataclass
class _Instr:
    op: str
    arg: Any
    offset: int


@functools.lru_cache(maxsize=256)
def _all_instructions(code) -> tuple[_Instr, ...]:
    out = []
    for ins in dis.get_instructions(code):
        if ins.opname in _IGNORED:
            continue
        op = "LOAD_ATTR" if ins.opname == "LOAD_METHOD" else ins.opname
        # 3.11/3.12's KW_NAMES indexes the constants; dis does not resolve it.
        arg = code.co_consts[ins.arg] if op == "KW_NAMES" else ins.argval
        out.append(_Instr(op, arg, ins.offset))
    return tuple(out)


def _instructions(code, start: int) -> list[_Instr]:
    return [i for i in _all_instructions(code) if i.offset >= start]


def _after_call(code, lasti: int) -> list[_Instr]:
    return [i for i in _instructions(code, lasti) if i.offset > lasti]


class _Namespace:
    """Resolves the names a continuation loads, without running any user code."""

    def __init__(self, frame_locals: dict, frame_globals: dict) -> None:
        self.locals = frame_locals
        self.globals = frame_globals

    def lookup(self, op: str, name: str) -> Any:
        missing = object()
        if op in ("LOAD_FAST", "LOAD_DEREF", "LOAD_FAST_CHECK"):
            value = self.locals.get(name, missing)
        else:
            value = self.locals.get(name, missing) if op == "LOAD_NAME" else missing
            if value is missing:
                value = self.globals.get(name, missing)
            if value is missing:
                builtins = self.globals.get("__builtins__", {})
                value = (builtins if isinstance(builtins, dict) else vars(builtins)).get(name, missing)
        if value is missing:
            raise LookupError(name)
        return value


def _continuation(frame) -> tuple[list[_Instr], _Namespace] | str:
    """The instructions that run after the ``backward()`` call in ``frame``, and their names.

    A string is the reason they could not be read.
    """
    code, lasti = frame.f_code, frame.f_lasti
    after = _after_call(code, lasti)
    namespace = _Namespace(dict(frame.f_locals), frame.f_globals)
    # Dynamo's rewrite of a compiled step calls a resume function: loaded by its global name
    # (torch 2.13), or made from a constant code object when it has a closure (torch 2.11).
    resume_at = next((k for k, i in enumerate(after)
                      if (i.op == "LOAD_GLOBAL" and compat.is_dynamo_resume_function_name(str(i.arg)))
                      or (i.op == "LOAD_CONST" and compat.is_dynamo_resume_code(i.arg))), None)
    if resume_at is None:
        return after, namespace
    # Only stack shuffling may precede the resume call.
    if any(i.op not in _STACK_ONLY for i in after[:resume_at]):
        return "the compiled frame does more than resume after backward()"
    if after[resume_at].op == "LOAD_CONST":
        resume, resume_code = None, after[resume_at].arg
    else:
        resume = frame.f_globals.get(after[resume_at].arg)
        resume_code = compat.dynamo_resume_code(resume)
    if resume_code is None:
        return "Dynamo's resume function was not found"
    body = _instructions(resume_code, 0)
    # Its prologue restores the value stack (backward()'s result) and jumps to the user's
    # next instruction.
    for ins in body:
        if ins.op in ("JUMP_FORWARD", "JUMP_ABSOLUTE", "JUMP_BACKWARD"):
            target = ins.arg
            rest = [i for i in body if i.offset >= target]
            # The resume function's locals are the rewritten frame's locals, by name.
            return rest, _Namespace(dict(frame.f_locals), getattr(resume, "__globals__", frame.f_globals))
        if ins.op not in ("LOAD_CONST", "STORE_FAST", "LOAD_FAST", "POP_TOP", "COPY_FREE_VARS", "MAKE_CELL"):
            return f"unexpected instruction {ins.op} in Dynamo's resume prologue"
    return "Dynamo's resume function has no jump to the user's code"


def _call_on(instrs: list[_Instr], k: int, namespace: _Namespace, method: str):
    """Matches ``<name>(.<attr>)*.<method>(...)`` at ``instrs[k]``.

    Returns (receiver object, arguments as (positional consts, keyword names), index after
    the call's POP_TOP), or None.
    """
    if k >= len(instrs) or instrs[k].op not in _NAME_LOADS:
        return None
    try:
        obj = namespace.lookup(instrs[k].op, str(instrs[k].arg))
    except LookupError:
        return None
    k += 1
    attrs = []
    while k < len(instrs) and instrs[k].op == "LOAD_ATTR":
        attrs.append(str(instrs[k].arg))
        k += 1
    if not attrs or attrs[-1] != method:
        return None
    for attr in attrs[:-1]:
        try:
            value = inspect.getattr_static(obj, attr)
        except AttributeError:
            return None
        if hasattr(type(value), "__get__"):
            return None  # a property or other descriptor: reading it would run code
        obj = value
    consts, kw_names = [], ()
    while k < len(instrs) and instrs[k].op == "LOAD_CONST":
        consts.append(instrs[k].arg)
        k += 1
    if k < len(instrs) and instrs[k].op == "KW_NAMES":
        kw_names = tuple(instrs[k].arg)
        k += 1
    if k < len(instrs) and instrs[k].op == "CALL_KW" and consts:
        kw_names = tuple(consts.pop())
    if k >= len(instrs) or instrs[k].op not in ("CALL", "CALL_KW") or instrs[k].arg != len(consts):
        return None
    k += 1
    if k >= len(instrs) or instrs[k].op != "POP_TOP":
        return None
    return obj, (consts, kw_names), k + 1


def _is_stock_scheduler(obj: Any, opt: torch.optim.Optimizer) -> bool:
    cls = type(obj)
    return (cls.__module__ == "torch.optim.lr_scheduler" and cls.__name__ in _STOCK_SCHEDULERS
            and getattr(obj, "optimizer", None) is opt and "step" not in vars(obj))


def _zero_grad_sets_none(args: tuple[list, tuple]) -> bool:
    consts, kw_names = args
    if not consts:
        return True
    if kw_names:
        return kw_names == ("set_to_none",) and consts == [True]
    return consts == [True]


def read_step_pattern(frame) -> tuple[torch.optim.Optimizer | None, str]:
    """(the optimizer whose step() and zero_grad() follow backward() in ``frame``, reason)."""
    found = _continuation(frame)
    if isinstance(found, str):
        return None, found
    instrs, namespace = found
    if not instrs or instrs[0].op != "POP_TOP":
        return None, "backward()'s caller does not go straight on to the next statement"
    step = _call_on(instrs, 1, namespace, "step")
    if step is None or not isinstance(step[0], torch.optim.Optimizer) or step[1] != ([], ()):
        return None, "the statement after loss.backward() is not optimizer.step()"
    opt, _, k = step
    sched = _call_on(instrs, k, namespace, "step")
    if sched is not None and _is_stock_scheduler(sched[0], opt) and sched[1] == ([], ()):
        k = sched[2]
    zero = _call_on(instrs, k, namespace, "zero_grad")
    if zero is None or zero[0] is not opt or not _zero_grad_sets_none(zero[1]):
        return None, ("optimizer.step() is not followed by optimizer.zero_grad() (set_to_none): the "
                      "gradients stay visible after step(), so they must be kept")
    return opt, "loss.backward(); optimizer.step(); optimizer.zero_grad() (set_to_none)"


def _user_frame():
    """The frame that called ``backward()``: the first one outside torch and megacompile."""
    skip = _internal_directories()
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    return frame


def _internal_directories() -> tuple[str, ...]:
    # megacompile/ (this file's grandparent) and runtime/, which a checkout installs apart.
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                 for path in (torch.__file__, os.path.join(package, "__init__.py"), megacompile.runtime.__file__))


def _optimizer_ready(opt: torch.optim.Optimizer, params: dict[int, torch.Tensor]) -> str | None:
    if not fused_kernel_runs(opt):
        return f"{type(opt).__name__} is not run by the fused host kernel (stock Adam / AdamW only)"
    if not kernel_available():
        return "the fused host Adam kernel is not available"
    if not (compat.step_is_stock(opt) or has_host_step(opt)) or "zero_grad" in vars(opt):
        return "the optimizer's step or zero_grad is overridden on the instance"
    if compat.optimizer_has_step_hooks(opt):
        return "optimizer step hooks are registered"
    owned = {id(p) for g in opt.param_groups for p in g["params"]}
    mine = [p for p in params.values() if id(p) in owned]
    if any(compat.tensor_has_grad_hooks(p) for p in mine):
        return "a parameter has gradient hooks"
    for p in mine:
        state = opt.state.get(p)
        if state and not ("exp_avg" in state and "exp_avg_sq" in state and "step" in state):
            return "the optimizer's state of a parameter is not Adam's (exp_avg, exp_avg_sq, step)"
    return None


def create_missing_state(opt: torch.optim.Optimizer, params: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """Before a first step that overlaps the backward: the Adam state of each of ``params``
    this optimizer updates here (a sharded optimizer: the ones this rank owns) and that has
    none yet, as torch.optim would create it at its first step (zero moments, step 0), so the
    first step too updates each layer as its gradients land and never holds every gradient
    at once. The host's free memory is checked first. Returns the parameters given state
    (``GradientLander.finish`` drops it again from those that got no gradient, as eager
    creates none for them)."""
    owned = {id(p) for g in opt.param_groups for p in g["params"]}
    mine = [p for p in params.values() if id(p) in owned]
    replicas = group_of(mine)
    if replicas is not None and replicas.shards_optimizer:
        mine = [p for p in mine if replicas.owns(p)]  # the rest has its state on other ranks
    missing = [p for p in mine if not opt.state.get(p)]
    if missing:
        check_host_allocation(sum(2 * p.numel() * p.element_size() for p in missing),
                              f"{type(opt).__name__}'s state (exp_avg and exp_avg_sq of each parameter)")
        for p in missing:
            init_adam_state(opt, p)
    return missing


def step_follows_backward(params: dict[int, torch.Tensor]) -> tuple[torch.optim.Optimizer | None, str]:
    """The optimizer to update ``params`` with while the backward runs, or (None, why not)."""
    frame = _user_frame()
    if frame is None:
        return None, "backward() was not called from Python code"
    try:
        opt, reason = read_step_pattern(frame)
    except Exception as e:  # unfamiliar bytecode must never break training: stay synchronous
        return None, f"the code after backward() could not be read ({type(e).__name__}: {e})"
    finally:
        del frame
    if opt is None:
        return None, reason
    why_not = _optimizer_ready(opt, params)
    if why_not is not None:
        return None, why_not
    return opt, reason


# Parameters that got gradient from outside megatrain's graphs after an overlapped update of
# them (``GradientLander.check_whole_gradients``): left to step() from then on.
_GRADIENT_FROM_OUTSIDE = WeakIdKeyDictionary()


def gets_gradient_from_outside(p: torch.Tensor) -> bool:
    return p in _GRADIENT_FROM_OUTSIDE


# --- the updates ----------------------------------------------------------------------------
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    # One worker: updates run in the order gradients land, each using all the kernel's
    # OpenMP threads; the device lane runs on the caller's thread meanwhile.
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-host-optimizer")
        return _POOL


class _Landed(NamedTuple):
    """One gradient of a layer's batch, as the update takes it."""

    param: torch.Tensor
    grad: torch.Tensor | None  # None: reduced to the rank that owns the parameter (not this one)
    ready: Any  # blocks until the gradient's copy has landed (None: it has)
    prior: torch.Tensor | None  # what earlier micro-batches accumulated in param.grad
    averaged: bool  # the device averaged it across the ranks already
    held_bytes: int  # host bytes it holds until its update (none in its weight's bf16 copy)


@dataclasses.dataclass
class OverlapStats:
    """What the last backward did with the optimizer (``last_report().optimizer``)."""

    overlapped: bool
    reason: str
    updated_params: int = 0
    update_seconds: float = 0.0  # summed over the worker's updates
    exposed_seconds: float = 0.0  # the backward's wait for updates still running at its end
    peak_pending_grad_bytes: int = 0  # host gradient bytes held at once by the updates
    # Gradients that landed in their weight's bf16 copy (``landing_place``): no host bytes of their own.
    landed_in_weight_copies: int = 0
    # Parameters of this graph left to autograd and step(): another forward call of the step
    # read them too, so their gradient comes in parts.
    left_to_step: int = 0
    consumed_grad_bytes: int = 0  # gradients the updates consumed (never kept in param.grad)


class GradientLander(GradientSink):
    """The backward program's gradient sink: takes the gradients of the parameters it updates
    as they land on the host and updates those parameters.

    ``take`` is called on the backward's thread, in the order gradients are produced (a bf16
    gradient as its bf16 copy: the fused kernel widens it exactly); the gradients of one layer
    are batched into one fused update on the worker thread. What it does not own is widened and
    returned as by the default sink.
    """

    def __init__(self, opt: torch.optim.Optimizer, params: dict[int, torch.Tensor], device, reason: str,
                 reducer: GradientReducer | None = None, created_state: list[torch.Tensor] = ()) -> None:
        self.opt = opt
        # Parameters whose state was made for this (first) step: dropped again where no update ran.
        self._created_state = list(created_state)
        # Data parallel: each layer's gradients are averaged across the ranks (an async
        # all-reduce issued as the layer is submitted) before its update uses them.
        self.reducer = reducer
        group = reducer.group if reducer is not None else None
        self._sharded = group if group is not None and group.shards_optimizer else None
        self.device = device
        self.stats = OverlapStats(True, reason)
        self._group_of = {}
        for index, group in enumerate(opt.param_groups):
            for p in group["params"]:
                self._group_of[id(p)] = index
        # Output position -> parameter, for the parameters this optimizer updates.
        self.params = {pos: p for pos, p in params.items() if id(p) in self._group_of}
        self._batch: list[tuple] = []
        self._batch_layer: str | None = None
        self._futures: list[concurrent.futures.Future] = []
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._updated: list[tuple[str | None, int]] = []  # (layer, parameters) done, in order
        self._on_device: set[int] = set()  # positions whose gradient the device averaged
        self._lent: set[int] = set()  # positions whose gradient lands in its weight's bf16 copy
        self._updated_params: list[torch.Tensor] = []  # the parameters an update ran for
        self._failed = False  # the program failed: its error is the one the backward raises
        try:
            compat.at_backward_end(self.check_whole_gradients)
        except RuntimeError:  # (not inside an autograd backward: nothing else can add to them)
            pass

    def owns(self, position: int) -> bool:
        return position in self.params

    def landing_place(self, position: int, like: torch.Tensor) -> torch.Tensor | None:
        """Under bf16 a weight's gradient lands in the weight's own bf16 copy, which the update
        reads and rewrites in one pass: the update is due with this very gradient (the lander
        owns it) and nothing loads the old weight after it lands (loads read the weight as the
        update leaves it, the same contract as rewriting the copy at all). Not with data
        parallel: the reduction reads the landed gradients on its own schedule."""
        if self.reducer is not None or like.dtype != torch.bfloat16 or not like.is_contiguous():
            return None
        p = self.params[position]
        if like.shape != p.shape:
            return None
        place = self.device.weight_copies.lend(p)
        if place is not None:
            self._lent.add(position)
        return place

    def before_offload(self, position: int, value: torch.Tensor, layer: str | None):
        """Data parallel, averaged on the device: starts the gradient's reduction before its
        copy. With a sharded optimizer only the rank that updates the parameter needs its
        average (nothing else reads it here: the lander takes the place of step()), so it is
        reduced to that rank alone and the others copy nothing to their host."""
        if self.reducer is None or not self.reducer.on_device:
            return None
        p = self.params[position]
        owner = self._sharded.owner_of(p) if self._sharded is not None else None
        work = self.reducer.reduce_on_device(value, layer, owner=owner)
        if work is not None:
            self._on_device.add(position)
        return work

    def not_copied(self, position: int, layer: str | None, after) -> None:
        """Another rank updates this parameter and received its average: nothing lands here."""
        if self._batch and layer != self._batch_layer:
            self._submit()
        # No gradient: the update skips the parameter (not this rank's); ``after`` is waited for there.
        self._batch.append(_Landed(self.params[position], None, after, None, True, 0))
        self._batch_layer = layer

    def take(self, position: int, host_grad: torch.Tensor, layer: str | None, ready=None) -> None:
        """``ready``: blocks until the gradient's copy to the host is complete (None: it is)."""
        if self._batch and layer != self._batch_layer:
            self._submit()
        p = self.params[position]
        # A gradient accumulated by earlier micro-batches: eager's AccumulateGrad would add
        # this one to it; the worker does the same add once the copy has landed.
        held = 0 if position in self._lent else host_grad.numel() * host_grad.element_size()
        self._batch.append(_Landed(p, host_grad, ready, p.grad, position in self._on_device, held))
        self._batch_layer = layer
        with self._lock:
            self.stats.landed_in_weight_copies += position in self._lent
            self._pending_bytes += held
            # What eager would keep in param.grad: the parameter's dtype (a bf16 copy taken
            # before its fp32 cast stands for an fp32 gradient).
            self.stats.consumed_grad_bytes += p.numel() * p.element_size()
            self.stats.peak_pending_grad_bytes = max(self.stats.peak_pending_grad_bytes, self._pending_bytes)

    def _submit(self) -> None:
        batch, layer = self._batch, self._batch_layer
        self._batch, self._batch_layer = [], None
        # Hyperparameters are read now, on the caller's thread: nothing can change them
        # before the step() this update stands for (that is what the bytecode check proved).
        groups: dict[int, list] = {}
        for item in batch:
            groups.setdefault(self._group_of[id(item.param)], []).append(item)
        work = []
        for index, items in groups.items():
            group = self.opt.param_groups[index]
            beta1, beta2 = group["betas"]
            hyper = dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                         weight_decay=float(group["weight_decay"]),
                         decoupled=bool(group.get("decoupled_weight_decay", isinstance(self.opt, torch.optim.AdamW))),
                         maximize=bool(group.get("maximize", False)))
            work.append((items, hyper))
        bucket = None
        on_host = [(i.param, i.grad, i.ready) for items, _ in work for i in items if not i.averaged]
        if self.reducer is not None and on_host:
            # Issued now, in the order layers land (the same on every rank); the bucket adds
            # what earlier micro-batches accumulated, as the update below would.
            bucket = self.reducer.submit(layer, on_host)
        self._futures.append(_pool().submit(self._update, work, layer, bucket))

    def _update(self, work, layer, bucket=None) -> None:
        start = time.perf_counter()
        nbytes = 0
        n = sum(len(items) for items, _ in work)
        averaged = iter(self.reducer.result(bucket)) if bucket is not None else None
        with trace.span("host optimizer", f"adam[{layer}]", layer=layer, tensors=n, overlapped=True):
            for items, hyper in work:
                grads = []
                nbytes += sum(item.held_bytes for item in items)
                for _, g, ready, prior, on_device, _ in items:
                    if averaged is not None and not on_device:
                        grads.append(next(averaged))  # landed, accumulated and averaged already
                        continue
                    # Without data parallel, or averaged on the device: a prior gradient of a
                    # synced backward is every rank's, so prior + average is the average.
                    if g is None:  # reduced to the rank that owns it: this one does not
                        ready()
                        grads.append(None)
                        continue
                    if ready is not None:
                        ready()  # CUDA: the gradient's copy to the host has finished
                    # (contiguous: the kernel's layout; a gradient may land strided like its weight's view)
                    grads.append((g if prior is None else prior + g).contiguous())
                params = [item.param for item in items]
                if self._sharded is not None:  # this rank updates only its own shard
                    mine = [i for i, p in enumerate(params) if self._sharded.owns(p)]
                    params, grads = [params[i] for i in mine], [grads[i] for i in mine]
                if params:
                    self._fused_update(params, grads, hyper)
            if self._sharded is not None:
                # In layer order on every rank (one worker thread): the owners' new values.
                share_updated(self._sharded, [i.param for items, _ in work for i in items], self.device.loads_done)
        with self._lock:
            self._pending_bytes -= nbytes
            self.stats.update_seconds += time.perf_counter() - start
            self.stats.updated_params += sum(len(items) for items, _ in work)
            self._updated.append((layer, sum(len(items) for items, _ in work)))
            self._updated_params.extend(i.param for items, _ in work for i in items)

    def _fused_update(self, params: list[torch.Tensor], grads: list[torch.Tensor], hyper: dict) -> None:
        """One fused update; under bf16 the weights' copies that loads carry are rewritten in
        the same pass (a weight without a current copy is updated in a second call)."""
        copies = self.device.weight_copies.for_update(params)
        # No load still reads what the update rewrites: the weights and their copies.
        self.device.loads_done([*params, *(c for c in copies if c is not None)])
        for with_copy in (True, False):
            index = [i for i, c in enumerate(copies) if (c is not None) == with_copy]
            if not index:
                continue
            ps = [params[i] for i in index]
            states = [self.opt.state[p] for p in ps]
            with torch.no_grad():
                fused_adam_step(ps, [grads[i] for i in index], [s["exp_avg"] for s in states],
                                [s["exp_avg_sq"] for s in states], [s["step"] for s in states],
                                bf16_copies=[copies[i] for i in index] if with_copy else None, **hyper)
            if with_copy:
                self.device.weight_copies.updated(ps)

    def finish(self, failed: bool = False) -> None:
        """Waits for every update (the backward returns only when parameters are current).
        After an error (``failed``) the layer still being collected is not updated, and
        ``param.grad`` is left as it was."""
        self._failed = failed
        if self._batch and not failed:
            self._submit()
        self._batch, self._batch_layer = [], None
        start = time.perf_counter()
        try:
            for f in self._futures:
                if failed:
                    concurrent.futures.wait([f])  # the step's own error is the one to report
                else:
                    f.result()  # re-raises a failed update here, on the backward's thread
        finally:
            self.stats.exposed_seconds = time.perf_counter() - start
            # State made for a parameter no update reached (no gradient, or the step failed
            # first) goes again: eager creates state only where it steps.
            for p in self._created_state:
                state = self.opt.state.get(p)
                if state and float(state["step"]) == 0:
                    del self.opt.state[p]
        if failed:
            return
        if self.reducer is not None:
            self.reducer.group.local_accumulation = False  # the updates used every rank's average
        # Eager's AccumulateGrad would have left these for step(); the update used them.
        for p in self.params.values():
            if p.grad is not None:
                p.grad = None

    def check_whole_gradients(self) -> None:
        """At the end of the whole backward: a parameter updated here whose ``grad`` is set
        again got gradient from outside megatrain's graphs (autograd sums that part with the
        part this backward took, and the update already ran on the latter): raises, and
        leaves such parameters to step() from then on. Parameters read by several graphs of
        the step are left to step() before (``StepRecorder.gradient_parts``)."""
        with self._lock:
            late = [p for p in self._updated_params if p.grad is not None] if not self._failed else []
        if not late:
            return
        for p in late:
            _GRADIENT_FROM_OUTSIDE[p] = True
        shapes = [tuple(p.shape) for p in late]
        raise GradientOutsideGraphsError(
            f"megatrain: {len(late)} parameter(s) (shapes {shapes[:4]}{' ...' if len(shapes) > 4 else ''}) got "
            f"gradient from code outside the compiled graphs (eager code between graph breaks, a "
            f"torch._dynamo.disable function) after the overlapped optimizer had updated them from the graphs' "
            f"part: this step's update of them differs from eager's (restore a checkpoint, or accept it). "
            f"megatrain leaves them to optimizer.step() from now on; overlap_optimizer=False avoids this step's "
            f"error too", shapes)

    def updated_before_failure(self) -> list[tuple[str | None, int]]:
        with self._lock:
            return list(self._updated)


class ParamInputs:
    """The parameter tensors a compiled forward was called with, by input position (weakly)."""

    def __init__(self, param_positions: list[int]) -> None:
        self.positions = param_positions
        self._refs: dict[int, weakref.ref] = {}

    def observe(self, args: list) -> None:
        for pos in self.positions:
            if pos < len(args) and isinstance(args[pos], torch.Tensor):
                ref = self._refs.get(pos)
                if ref is None or ref() is not args[pos]:
                    self._refs[pos] = weakref.ref(args[pos])

    def tensors(self) -> dict[int, torch.Tensor]:
        out = {}
        for pos, ref in self._refs.items():
            t = ref()
            if t is not None:
                out[pos] = t
        return out
