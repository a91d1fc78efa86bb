"""The instructions of a ``StreamingProgram``, one type per kind, each running itself.

A program is a list of instructions over numbered value slots (``Call.env``). Every type
names the slots it reads and writes (the program frees a slot after its last reader, and the
runtime trace reports the bytes of what an instruction wrote, or else read) and has a ``run``
that does its part of one call. ``kind`` is the name the runtime trace and tests know it by.

| type | kind | does |
| --- | --- | --- |
| ``Const`` | const | puts a graph constant (placed on the device once, at lowering) in its slot |
| ``ComputeOp`` | op | calls one aten op on device values |
| ``Segment`` | segment | calls a run of ops compiled once by Inductor (on its first call) |
| ``HostOp`` | host_op | calls a host op (a host cast) on host values |
| ``Widen`` | host_op | the host cast that widens a returned gradient's landed bf16 copy, via the sink |
| ``WeightCopy`` | host_op | a parameter's bf16 cast, served from the persistent weight copies |
| ``Load`` | load | copies a host value to the device (or shares it) |
| ``Offload`` | offload | copies a device value to the host (or hands it over); a returned one may go to the sink |
| ``Wait`` | wait | orders the compute after the copy that made a value |
| ``Evict`` | evict | the device copy is dead (its slot is freed after it) |
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import torch
import torch.fx as fx

from megacompile.runtime.device import StreamingDevice
from megacompile.runtime.gradient_sink import GradientSink
from megacompile.runtime.host_arena import ArenaLease, LandingBuffers
from megacompile.runtime.segment_cache import size_class


class Slot:
    """A reference to a value slot inside an op's argument template."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def resolve(template: Any, env) -> Any:
    """The template with every ``Slot`` replaced by its value in ``env`` (a list, or a dict)."""
    if isinstance(template, Slot):
        return env[template.index]
    if isinstance(template, (list, tuple)):
        resolved = [resolve(t, env) for t in template]
        return resolved if isinstance(template, list) else tuple(resolved)
    if isinstance(template, dict):
        return {k: resolve(v, env) for k, v in template.items()}
    return template


def template_slots(template: Any) -> list[int]:
    """The slots a template reads, once per occurrence."""
    found: list[int] = []
    fx.node.map_aggregate(template, lambda a: found.append(a.index) if isinstance(a, Slot) else a)
    return found


@dataclasses.dataclass(eq=False)
class Call:
    """One run of a program: its value slots and what its instructions run against."""

    env: list
    device: StreamingDevice
    sink: GradientSink
    # The eager lowering: every device result is handed to the device's tracker (the
    # stand-in's measured peak).
    track: bool
    # Loads and offloads share host memory instead of copying (StreamingProgram.share_host_memory).
    share: bool
    compile: Callable[..., Callable]  # (segment, inputs, varying sizes or None) -> compiled
    # Where this call's offloaded activations go (runtime/host_arena.py); None: each its own.
    arena: ArenaLease | None = None
    # A backward: where its returned gradients land (runtime/host_arena.LandingBuffers); None:
    # each its own host tensor.
    landing: LandingBuffers | None = None


# Returned by an instruction that did nothing this call: it is not traced, logged or freed after.
SKIPPED = object()


@dataclasses.dataclass(kw_only=True, eq=False)
class Instruction:
    kind: ClassVar[str]
    name: str
    layer: str | None = None
    # Slots whose last reader this instruction is: cleared after it runs.
    frees: list[int] = dataclasses.field(default_factory=list)

    def reads(self) -> list[int]:
        raise NotImplementedError

    def writes(self) -> list[int]:
        raise NotImplementedError

    def traced_slots(self) -> list[int]:
        """The values whose bytes the runtime trace reports for this instruction."""
        return self.writes() or self.reads()

    def run(self, call: Call) -> Any:
        """Runs the instruction; ``SKIPPED`` where it had nothing to do."""
        raise NotImplementedError


@dataclasses.dataclass(kw_only=True, eq=False)
class Const(Instruction):
    kind: ClassVar[str] = "const"
    out: int
    value: Any

    def reads(self) -> list[int]:
        return []

    def writes(self) -> list[int]:
        return [self.out]

    def run(self, call: Call) -> None:
        call.env[self.out] = self.value


@dataclasses.dataclass(kw_only=True, eq=False)
class ComputeOp(Instruction):
    kind: ClassVar[str] = "op"
    out: int
    fn: Callable
    args: tuple  # templates: Slot where the op reads a value
    kwargs: dict

    def reads(self) -> list[int]:
        return template_slots((self.args, self.kwargs))

    def writes(self) -> list[int]:
        return [self.out]

    def run(self, call: Call) -> None:
        value = self.fn(*resolve(self.args, call.env), **resolve(self.kwargs, call.env))
        call.env[self.out] = value
        if call.track:
            call.device.track(value)


@dataclasses.dataclass(kw_only=True, eq=False)
class Segment(Instruction):
    kind: ClassVar[str] = "segment"
    inputs: list[int]
    outs: list[int]
    gm: fx.GraphModule  # the run's ops as a graph of their own (re-traced by Inductor)
    # Flat outputs per slot where a multi-output op leaves the segment (None: one each).
    arity: list | None = None
    compiled: Callable | None = None  # set on the first call
    # Dynamic shapes: which of the inputs' sizes vary between calls (``symbolic_examples``);
    # None: none do, one compiled callable serves every call.
    varying: list | None = None
    by_size_class: dict = dataclasses.field(default_factory=dict)  # ``size_class`` -> compiled

    def reads(self) -> list[int]:
        return list(self.inputs)

    def writes(self) -> list[int]:
        return list(self.outs)

    def run(self, call: Call) -> None:
        env = call.env
        inputs = [env[s] for s in self.inputs]
        if self.varying is None:
            if self.compiled is None:
                self.compiled = call.compile(self.gm, inputs)
            outs = self.compiled(*inputs)
        else:
            # Compiled once per size class: any size where the program's is symbolic, except
            # 0 and 1, which Inductor specialises.
            key = size_class(inputs, self.varying)
            compiled = self.by_size_class.get(key)
            if compiled is None:
                compiled = self.by_size_class[key] = call.compile(self.gm, inputs, self.varying)
            outs = compiled(*inputs)
        if self.arity is not None:
            outs = _regroup(outs, self.arity)
        for s, v in zip(self.outs, outs):
            env[s] = v


def _regroup(flat, arity: list) -> list:
    """A segment's flat outputs back into one value per slot (a tuple for a multi-output op)."""
    out, k = [], 0
    for n in arity:
        if n is None:
            out.append(flat[k])
            k += 1
        else:
            out.append(tuple(flat[k:k + n]))
            k += n
    return out


@dataclasses.dataclass(kw_only=True, eq=False)
class HostOp(Instruction):
    """A host op: runs on the host, never in a device segment; its result is host memory."""

    kind: ClassVar[str] = "host_op"
    out: int
    fn: Callable
    args: tuple
    kwargs: dict
    # A transient host copy (a parameter's bf16 cast on its way to its load): host staging.
    staged: bool = False
    # Its position in the returned tuple where the program returns it once (a gradient).
    returns: int | None = None

    def reads(self) -> list[int]:
        return template_slots((self.args, self.kwargs))

    def writes(self) -> list[int]:
        return [self.out]

    def run(self, call: Call) -> None:
        value = self.fn(*resolve(self.args, call.env), **resolve(self.kwargs, call.env))
        if self.returns is not None and call.sink.owns(self.returns):
            call.sink.take(self.returns, value, self.layer, None)  # made on the host: complete
            return
        _keep(call, self.out, value, self.staged)


@dataclasses.dataclass(kw_only=True, eq=False)
class Widen(HostOp):
    """bf16: the host cast of a returned gradient's offloaded bf16 copy (slot ``source``) to
    the fp32 gradient at ``returns``. The copy's ``Offload`` offers it to the sink as it lands;
    where the sink took it (its slot stays empty) this cast does not run."""

    source: int

    def run(self, call: Call) -> Any:
        narrow = call.env[self.source]
        if narrow is None:
            return SKIPPED
        _keep(call, self.out, call.sink.widen(self.returns, narrow, self.cast, self.layer), self.staged)
        return None

    def cast(self, narrow: torch.Tensor) -> torch.Tensor:
        """The graph's cast applied to ``narrow`` (in place of the copy it reads)."""
        env = {self.source: narrow}
        return self.fn(*resolve(self.args, env), **resolve(self.kwargs, env))


@dataclasses.dataclass(kw_only=True, eq=False)
class WeightCopy(Instruction):
    """A parameter's host cast to a narrower dtype (bf16, before its load), served from the
    device's persistent copies (runtime/weight_copies.py): it casts only if the weight changed
    since its copy was written, and the copy is no transient staging."""

    kind: ClassVar[str] = "host_op"
    source: int
    out: int
    dtype: torch.dtype

    def reads(self) -> list[int]:
        return [self.source]

    def writes(self) -> list[int]:
        return [self.out]

    def run(self, call: Call) -> None:
        call.env[self.out] = call.device.weight_copies.get(call.env[self.source], self.dtype)


def _keep(call: Call, slot: int, value: Any, staged: bool) -> None:
    call.env[slot] = value
    if staged:
        call.device.host_staging.track(value)


@dataclasses.dataclass(kw_only=True, eq=False)
class Load(Instruction):
    kind: ClassVar[str] = "load"
    source: int
    out: int
    tag: str | None  # the copy's name (the op's second argument), for the device's records

    def reads(self) -> list[int]:
        return [self.source]

    def writes(self) -> list[int]:
        return [self.out]

    def run(self, call: Call) -> None:
        host = call.env[self.source]
        if call.share:
            call.env[self.out] = call.device.share(host, self.tag, self.layer)
        else:
            call.env[self.out] = call.device.load(host, self.tag, self.layer, call.track)


@dataclasses.dataclass(kw_only=True, eq=False)
class Offload(Instruction):
    kind: ClassVar[str] = "offload"
    source: int
    out: int
    tag: str | None
    # A transient host copy (a bf16 gradient before its host cast): host staging.
    staged: bool = False
    # The returned position this copy stands for: its own, or that of the ``Widen`` cast of it.
    returns: int | None = None
    # An activation the forward saves for the backward: copied into the call's offload arena.
    to_arena: bool = False
    # Nothing reads the source's memory after this copy (no other value aliases it), so the
    # sink may change it in place first (``GradientSink.before_offload``).
    sole_reader: bool = False

    def reads(self) -> list[int]:
        return [self.source]

    def writes(self) -> list[int]:
        return [self.out]

    def run(self, call: Call) -> None:
        device = call.device
        value = call.env[self.source]
        taken = self.returns is not None and call.sink.owns(self.returns)
        work = call.sink.before_offload(self.returns, value, self.layer) if taken and self.sole_reader else None
        if work is not None and not work.copy:
            call.sink.not_copied(self.returns, self.layer, work.after)  # another rank takes it
            return
        after = work.after if work is not None else None
        if call.share:
            host = device.hand_over(value, self.tag, self.layer, after=after)
        else:
            if self.to_arena:
                into = call.arena.place(value) if call.arena is not None else None
            else:  # a returned gradient: where the sink offers, else a buffer of its size reused every step
                into = call.sink.landing_place(self.returns, value) if taken and work is None else None
                if into is None and self.returns is not None and call.landing is not None:
                    into = call.landing.take(value)
            host = device.offload(value, self.tag, self.layer, into=into, after=after)
        if taken:
            # Taken as soon as it lands: the program returns None for it and keeps no host copy.
            call.sink.take(self.returns, host, self.layer, device.completion(host))
            return
        _keep(call, self.out, host, self.staged)


@dataclasses.dataclass(kw_only=True, eq=False)
class _OrderingOp(Instruction):
    """A memory op that only orders work around one value: reads it, writes nothing."""

    source: int

    def reads(self) -> list[int]:
        return [self.source]

    def writes(self) -> list[int]:
        return []


@dataclasses.dataclass(kw_only=True, eq=False)
class Wait(_OrderingOp):
    kind: ClassVar[str] = "wait"

    def run(self, call: Call) -> None:
        value = call.env[self.source]
        if value is not None:  # None: a gradient the sink took over (it waits on its own)
            call.device.wait(value)


@dataclasses.dataclass(kw_only=True, eq=False)
class Evict(_OrderingOp):
    kind: ClassVar[str] = "evict"

    def run(self, call: Call) -> None:
        call.device.evict(call.env[self.source])
