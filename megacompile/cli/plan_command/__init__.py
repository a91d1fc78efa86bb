"""``megacompile plan MODEL --hardware NAME``: will a training step fit, and how fast will it run.

The numbers come from the real megatrain pipeline on the meta device: a few decoder layers are
traced and planned, checked to be identical, and extrapolated to the full depth; the steps, the
two places a meta trace differs from a host trace and the order of the modules are in
docs/architecture.md ("How `megacompile plan` works"). What the modules share is here.
"""
from __future__ import annotations

import re

from megacompile.plan.streamed_layers import STREAMED

# ``STREAMED``, the runtime planner's last rung per layer (plan/streamed_layers.py): the layer is
# replayed in the backward from its boundary input, and that input itself is offloaded in the
# forward and loaded back before the layer's backward, so nothing of the layer stays on the
# device and the host holds one input a layer (where "offload" holds every value).

# The per-layer policies a full-depth plan mixes; the first three are uniform plans the
# planner builds with ``default_policy``, the last one is built from the recompute plan.
POLICIES = ("keep", "offload", "recompute", STREAMED)
BASIC_POLICIES = POLICIES[:3]
# The planner's first rung, all or nothing: keep every activation, and keep the parameters both
# passes read on the device for the whole step (loaded once instead of twice). Extrapolated
# like a policy whose saved bytes per layer include the layer's resident parameters.
RESIDENT = "resident"
# Adjacent (earlier, later) layer policies a full-depth plan can have: the planner's solvers
# upgrade the earliest layers first, so keep layers come last.
PAIRS = (("offload", "keep"), ("recompute", "keep"), ("offload", "recompute"), ("recompute", "offload"),
         (STREAMED, "keep"), (STREAMED, "offload"), (STREAMED, "recompute"), ("offload", STREAMED),
         ("recompute", STREAMED))
PRECISIONS = ("fp32", "bf16")
DEFAULT_TRACED_LAYERS = 2
DEVICE_PARAM_BYTES = {"fp32": 4, "bf16": 2}

DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


class PlanError(ValueError):
    """The model cannot be planned this way (e.g. its decoder layers are not identical)."""
