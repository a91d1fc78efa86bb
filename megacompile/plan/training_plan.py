"""What a plan decides for one training graph, and what building it measured."""
from __future__ import annotations

import dataclasses

from megacompile.plan.memory_estimate import MemoryEstimate


@dataclasses.dataclass
class TrainingPlan:
    policy: str = "keep"  # a summary: keep | recompute | offload | per-layer (...)
    # Per-layer decision (keep | offload | recompute); layers not listed use default_policy.
    default_policy: str = "keep"
    layer_policy: dict[str, str] = dataclasses.field(default_factory=dict)
    # Per saved activation: joint node name -> keep | offload | recompute, with the reason the
    # planner gives; overrides ``layer_policy`` for the values it names (every value that
    # shares one storage gets the same decision).
    value_policy: dict[str, str] = dataclasses.field(default_factory=dict)
    value_reason: dict[str, str] = dataclasses.field(default_factory=dict)
    # Parameters (by name) loaded once per step and kept on the device through the backward.
    resident: list[str] = dataclasses.field(default_factory=list)
    # Why each resident parameter is resident (parameter name -> reason).
    resident_reason: dict[str, str] = dataclasses.field(default_factory=dict)
    # Prefetch depth per streamed parameter (parameter name -> layers ahead) and why; the
    # others use ``options.prefetch_depth``.
    prefetch: dict[str, int] = dataclasses.field(default_factory=dict)
    prefetch_reason: dict[str, str] = dataclasses.field(default_factory=dict)
    # The solver's price of each layer's chosen option (bytes freed, seconds added).
    layer_costs: dict[str, dict] = dataclasses.field(default_factory=dict)
    # The cost model's predicted step time of this plan (seconds), when the planner priced it.
    predicted_seconds: float | None = None
    budget: int | None = None
    saved_values: list[str] = dataclasses.field(default_factory=list)
    saved_sym_nodes: list[str] = dataclasses.field(default_factory=list)
    recomputed_ops: list[str] = dataclasses.field(default_factory=list)
    forward: MemoryEstimate | None = None
    backward: MemoryEstimate | None = None
    reason: str = ""
    # Planned on short copies of the step (template_planner): its numbers, else None.
    template: dict | None = None

    @property
    def peak_bytes(self) -> int:
        return max((e.peak_bytes for e in (self.forward, self.backward) if e is not None), default=0)

    @property
    def limiting_layer(self) -> str | None:
        ests = [e for e in (self.forward, self.backward) if e is not None]
        if not ests:
            return None
        return max(ests, key=lambda e: e.peak_bytes).peak_layer
