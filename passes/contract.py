"""What a pass states about itself: the stages it rewrites and the facts it requires, uses and
provides; and the check that an order of passes keeps every contract (see ``manager``)."""
from __future__ import annotations

import dataclasses

# "dynamo": the graph Dynamo captured, before AOTAutograd traces it.
STAGES = ("dynamo", "joint", "forward", "backward", "inference")

# Facts the compiler needs at the end of a stage, whatever was switched off.
STAGE_RESULTS = {"joint": frozenset({"annotated", "recompute_applied"})}


@dataclasses.dataclass(frozen=True)
class PassContract:
    name: str
    stages: tuple[str, ...]
    provides: frozenset[str]
    requires: frozenset[str] = frozenset()
    uses: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = set(self.stages) - set(STAGES)
        if unknown:
            raise ValueError(f"pass {self.name}: unknown stage(s) {sorted(unknown)}; stages are {STAGES}")


class PassOrderError(ValueError):
    """Passes in an order (or a selection) that breaks a contract."""


def check_order(contracts: list[PassContract]) -> None:
    """Raises ``PassOrderError`` unless, on every stage, each pass's ``requires`` is provided
    by a pass before it, no ``uses`` is provided only after it, and the stage ends with its
    ``STAGE_RESULTS``."""
    for stage in STAGES:
        running = [c for c in contracts if stage in c.stages]
        held: dict[str, str] = {}
        for i, c in enumerate(running):
            missing = sorted(c.requires - set(held))
            if missing:
                providers = sorted({p.name for p in running[i + 1:] if p.provides & set(missing)})
                where = f" (provided by {', '.join(providers)}, which runs later)" if providers else ""
                raise PassOrderError(f"{stage} graph: pass '{c.name}' requires {missing}, which no earlier "
                                     f"pass provides{where}")
            late = sorted(f for later in running[i + 1:] for f in c.uses & later.provides)
            if late:
                raise PassOrderError(f"{stage} graph: pass '{c.name}' uses {late}, which a later pass provides")
            for fact in c.provides:
                held.setdefault(fact, c.name)
        missing = sorted(STAGE_RESULTS.get(stage, frozenset()) - set(held))
        if missing:
            raise PassOrderError(f"{stage} graph: the passes that run leave {missing} unprovided")
