"""A plan for one training graph: the decisions (``PlanSpec``, frozen) and what building them
gave (``TrainingPlan``: saved values, memory estimates, predicted time, the planner's notes).

The planners state a ``PlanSpec``; ``build(spec)`` runs the passes under it and returns the
``TrainingPlan`` the compiler keeps. The spec's fields read through on the plan
(``plan.layer_policy``), so a reader need not know which half a field lives in.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from megacompile.core.enums import Policy
from megacompile.plan.memory_estimate import MemoryEstimate


class FrozenMap(dict):
    """A dict that refuses changes: the mappings of a ``PlanSpec``."""

    def _frozen(self, *args: Any, **kwargs: Any):
        raise TypeError("a PlanSpec is frozen: make a new one with spec.replace(...)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _frozen  # type: ignore

    def __reduce__(self):  # copy / deepcopy / pickle rebuild it whole instead of item by item
        return (FrozenMap, (dict(self),))


def _policies(mapping: Mapping[str, str] | None) -> FrozenMap:
    return FrozenMap((k, Policy(v)) for k, v in (mapping or {}).items())


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """What a planner decides for one graph, before anything is built."""

    # A summary: keep | recompute | offload | per-layer (...) | per-activation (...)
    name: str = "keep"
    # Per layer (keep | offload | recompute); layers not listed use default_policy.
    default_policy: Policy = Policy.KEEP
    layer_policy: Mapping[str, Policy] = dataclasses.field(default_factory=FrozenMap)
    # Per saved activation (joint node name), with the planner's reason; overrides
    # layer_policy for the values it names (every value sharing one storage gets one entry).
    value_policy: Mapping[str, Policy] = dataclasses.field(default_factory=FrozenMap)
    value_reason: Mapping[str, str] = dataclasses.field(default_factory=FrozenMap)
    # Parameters (by name) loaded once per step and kept on the device through the backward.
    resident: tuple[str, ...] = ()
    resident_reason: Mapping[str, str] = dataclasses.field(default_factory=FrozenMap)
    # Layers ahead each streamed parameter is loaded (others: options.prefetch_depth), and why.
    prefetch: Mapping[str, int] = dataclasses.field(default_factory=FrozenMap)
    prefetch_reason: Mapping[str, str] = dataclasses.field(default_factory=FrozenMap)
    # The memory ops inside each layer's run of compute gathered at its ends, so the run is
    # one compiled segment where the program copies (passes/merge_compute_runs.py), and why.
    merged_compute_runs: bool = False
    budget: int | None = None
    # How many calls of the graph run before its backward (options.calls_before_backward).
    calls_before_backward: int = 1

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # normalising a frozen dataclass's own fields
        set_(self, "default_policy", Policy(self.default_policy))
        set_(self, "layer_policy", _policies(self.layer_policy))
        set_(self, "value_policy", _policies(self.value_policy))
        set_(self, "resident", tuple(self.resident))
        for name in ("value_reason", "resident_reason", "prefetch", "prefetch_reason"):
            set_(self, name, FrozenMap(getattr(self, name) or {}))

    def replace(self, **changes: Any) -> "PlanSpec":
        return dataclasses.replace(self, **changes)

    def policy_of_layer(self, layer: str | None) -> Policy:
        return self.layer_policy.get(layer, self.default_policy) if layer is not None else self.default_policy


@dataclasses.dataclass
class TrainingPlan:
    """A built plan: its spec, and what building it under the passes gave."""

    spec: PlanSpec = dataclasses.field(default_factory=PlanSpec)
    # Written by the recompute pass: the forward values saved for the backward (and the sizes
    # it needs), and the forward ops the backward replays.
    saved_values: list[str] = dataclasses.field(default_factory=list)
    saved_sym_nodes: list[str] = dataclasses.field(default_factory=list)
    recomputed_ops: list[str] = dataclasses.field(default_factory=list)
    forward: MemoryEstimate | None = None
    backward: MemoryEstimate | None = None
    # The planner's notes once built: predicted step time (seconds), why it was chosen, the
    # solver's price of each layer's option, and, planned on short copies, their numbers.
    predicted_seconds: float | None = None
    reason: str = ""
    layer_costs: dict[str, dict] = dataclasses.field(default_factory=dict)
    template: dict | None = None

    # The spec's fields, read through.
    policy = property(lambda self: self.spec.name)
    default_policy = property(lambda self: self.spec.default_policy)
    layer_policy = property(lambda self: self.spec.layer_policy)
    value_policy = property(lambda self: self.spec.value_policy)
    value_reason = property(lambda self: self.spec.value_reason)
    resident = property(lambda self: self.spec.resident)
    resident_reason = property(lambda self: self.spec.resident_reason)
    prefetch = property(lambda self: self.spec.prefetch)
    prefetch_reason = property(lambda self: self.spec.prefetch_reason)
    merged_compute_runs = property(lambda self: self.spec.merged_compute_runs)
    budget = property(lambda self: self.spec.budget)

    @property
    def call_peak_bytes(self) -> int:
        """One call's peak: forward or backward, whichever is higher."""
        return max((e.peak_bytes for e in (self.forward, self.backward) if e is not None), default=0)

    @property
    def peak_bytes(self) -> int:
        """What the plan needs of the budget: one call's peak, beside what the graph's other
        calls before the backward hold (``calls_before_backward``; each what the forward leaves)."""
        others = self.spec.calls_before_backward - 1
        held = (others * self.forward.end_bytes
                if others and self.forward is not None and self.backward is not None else 0)
        return self.call_peak_bytes + held

    @property
    def limiting_layer(self) -> str | None:
        ests = [e for e in (self.forward, self.backward) if e is not None]
        if not ests:
            return None
        return max(ests, key=lambda e: e.peak_bytes).peak_layer

    def as_dict(self) -> dict[str, Any]:
        """The spec's fields and the results in one flat dict (inspect's JSON)."""
        data = dataclasses.asdict(self)
        spec = data.pop("spec")
        spec["policy"] = spec.pop("name")
        return {**spec, **data}


