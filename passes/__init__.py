"""The graph passes, in the order they run, and what the compiler asks of them.

Every pass is a module with ``CONTRACT`` (a ``manager.PassContract``: stages, and the facts
it requires, uses and provides) and ``run(gm, ctx)``, which rewrites ``gm`` in place. The
manager (``passes/manager.py``) checks the order against the contracts, runs the passes that
apply to a stage, stamps provenance, checks the invariants (``passes/invariants.py``) and keeps
a printed snapshot after each pass for ``megacompile inspect``.
"""
from __future__ import annotations

import torch.fx as fx

from megacompile.passes import (
    annotate,
    canonical_operators,
    chunk_tokens,
    elide_causal_mask,
    fuse_lm_head,
    host_casts,
    merge_compute_runs,
    narrow_dtype_extremes,
    offload_gradients,
    recompute,
    resident_parameters,
    stream_parameters,
)
from megacompile.passes.contract import PassContract, PassOrderError, check_order
from megacompile.passes.manager import GraphSnapshot, PassContext, run_pipeline

PASS_ORDER = (canonical_operators, elide_causal_mask, fuse_lm_head, chunk_tokens, annotate, narrow_dtype_extremes,
              host_casts, resident_parameters, recompute, stream_parameters, offload_gradients, merge_compute_runs)
check_order([p.CONTRACT for p in PASS_ORDER])

__all__ = [
    "PASS_ORDER", "GraphSnapshot", "PassContext", "PassContract", "PassOrderError", "facts_after",
    "known_pass_names", "optional_pass_names", "run_passes",
]


def known_pass_names() -> list[str]:
    return [p.CONTRACT.name for p in PASS_ORDER]


def optional_pass_names() -> list[str]:
    """Passes ``disable_passes`` may switch off: those whose facts no other pass requires."""
    optional = []
    for p in PASS_ORDER:
        try:
            check_order([q.CONTRACT for q in PASS_ORDER if q is not p])
        except PassOrderError:
            continue
        optional.append(p.CONTRACT.name)
    return optional


def facts_after(stage: str, disabled: tuple[str, ...] | list[str] = ()) -> frozenset[str]:
    """The facts that hold on a ``stage`` graph once the passes not in ``disabled`` ran."""
    return frozenset(f for p in PASS_ORDER if stage in p.CONTRACT.stages and p.CONTRACT.name not in disabled
                     for f in p.CONTRACT.provides)


def run_passes(gm: fx.GraphModule, ctx: PassContext, keep_snapshots: bool = True) -> fx.GraphModule:
    return run_pipeline(gm, ctx, PASS_ORDER, keep_snapshots)
