"""The linear depth model the template planner and `megacompile plan` both extrapolate with
(megacompile/plan/depth_extrapolation.py)."""
from __future__ import annotations

from megacompile.plan.depth_extrapolation import extend_to_depth, per_layer_from_two_depths


def test_two_depths_give_what_one_layer_adds():
    # 10 bytes of glue plus 3 per layer, measured on 3- and 4-layer copies, carried to 32 layers.
    values = (10 + 3 * 3, 10 + 3 * 4)
    per_layer = per_layer_from_two_depths(values, (3, 4))
    assert per_layer == 3
    assert extend_to_depth(values[-1], [(32 - 4, per_layer)]) == 10 + 3 * 32


def test_a_quantity_that_shrinks_with_depth_is_held():
    assert per_layer_from_two_depths((5.0, 4.0), (3, 4)) == 0.0
    assert extend_to_depth(4.0, [(28, 0.0)]) == 4.0


def test_each_kind_of_added_layer_counts():
    # A 2-layer keep program (100), then 3 more keep layers (7 each) and 5 offload layers (2 each).
    assert extend_to_depth(100, [(3, 7), (5, 2)]) == 100 + 3 * 7 + 5 * 2
    assert extend_to_depth(100, []) == 100
