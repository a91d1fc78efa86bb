"""A short program's numbers carried to N layers, linearly in the layer count.

Both ways of planning a deep model on a short one use it: the template planner learns what
one more layer adds from two short copies of the step (``per_layer_from_two_depths``), and
``megacompile plan`` (``cli/plan_command/full_depth.py``) measures it per policy on one traced
layer's stretch of the program, so that any count of keep / offload / recompute layers is
priced from one trace.
"""
from __future__ import annotations

from typing import Iterable, Sequence


def per_layer_from_two_depths(values: Sequence[float], depths: Sequence[int]) -> float:
    """What one more layer adds to a quantity measured at two depths (k1 < k2); never negative."""
    (k1, k2), (v1, v2) = depths, values
    return max(0.0, (v2 - v1) / (k2 - k1))


def extend_to_depth(at_k: float, added: Iterable[tuple[float, float]]) -> float:
    """A quantity of a k-layer program with more layers added: ``at_k`` plus, for each
    (count, per_layer) in ``added``, count x what one such layer adds."""
    return at_k + sum(count * per_layer for count, per_layer in added)
