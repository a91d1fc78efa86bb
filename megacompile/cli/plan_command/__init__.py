"""``megacompile plan MODEL --hardware NAME``: will a training step fit, and how fast will it run.

The numbers come from the real megatrain pipeline, not from a formula of the model's shape:

1. **Trace a few layers on the meta device.** The Hugging Face model is built from the
   preset's config with ``num_hidden_layers`` cut to ``k`` (2 by default) under
   ``torch.device("meta")`` (nothing is allocated), and an ordinary training step (forward,
   cross-entropy, backward, AdamW step, zero_grad) is compiled with
   ``torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager"})``
   and called once on meta ``input_ids`` of shape (batch, seq). Dynamo, AOTAutograd and the
   megatrain partitioner run as for a real step; inside the planner, the one joint graph is
   built under each uniform policy the planner's candidates are made of (the same ``build``
   the planner uses: passes, split, rewrite, liveness estimate): *keep*, *keep with the
   parameters resident*, and, unless keeping everything fits at full depth, *offload*,
   *recompute* and four two-policy "pair" plans; compilation stops there: planning needs no
   execution (``test_plan_cmd`` also runs a whole step on meta tensors to show the runtime
   itself works on them).
2. **Check the repeat.** The ``k`` decoder layers must have identical per-layer numbers
   (parameter bytes, saved activation bytes under each policy, FLOPs forward and backward,
   bytes loaded and offloaded, compute time); otherwise the extrapolation is refused.
3. **Extrapolate to the full depth N** (repeated layers are compiled and planned once):
   per-layer quantities x N plus the embedding, final norm and head once
   (``full_depth.evaluate``); the device peak as explained in ``full_depth.full_depth_peak``; time with the cost model
   (``cost_model.step_time`` of the traced program plus N-k steady-state layers).
4. **Choose the plan the planner would choose** for N identical layers (``full_depth.choose_plan``): its
   first rung (parameters resident) or keep everything if that fits, otherwise the fastest
   count of keep / offload / recompute layers whose extrapolated peak fits the budget and
   whose offloaded activations fit the host, the smallest peak among equally fast ones.
   The embedding, final norm, head and loss follow the policy of the layers next to them;
   megatrain's planner can also choose for them alone, so under a tight budget it may find
   a somewhat smaller peak than the smallest plan reported here.

What runs on the meta device differs from a host trace in two places, both bridged here so
that the traced program is exactly the one megatrain compiles for host-resident parameters
(``test_plan_cmd::test_meta_trace_matches_host_trace`` compares them op for op and byte for
byte):
- PyTorch picks the math (O(seq^2) memory) attention kernel for meta tensors, where the
  host trace has ``_scaled_dot_product_flash_attention_for_cpu``; the attention function
  registered by ``meta_model`` (``ATTN_IMPLEMENTATION``) calls that op directly on meta tensors and is
  Hugging Face's ``sdpa`` otherwise.
- ``F.cross_entropy`` on meta fake tensors loses its autograd (PyTorch's Python meta kernel
  for ``aten::nll_loss`` shadows its CompositeImplicitAutograd kernel), which would leave
  the backward empty; the loss is written as the host trace decomposes it
  (``log_softmax`` + ``nll_loss_forward``).
And megatrain's placement check rejects parameters that are not on the CPU, meta ones
included; while tracing, meta parameters are exempted from it (see ``meta_model._meta_placement``).

The modules, in the order a plan runs through them: ``meta_model`` (the model and its step
on meta tensors), ``policy_capture`` (one compile, the planner's uniform policies built and
kept), ``digest`` (what one traced program says per layer), ``traced_layers`` (a checked, cached
trace of k layers), ``full_depth`` (extrapolation to N layers and the plan chosen there),
``search`` (the largest batch or sequence length that fits), ``host_memory`` (the host's
share), ``planning`` (``plan_model``: all of it, the ``PlanResult``), ``text_report`` (the
table) and ``command`` (the arguments and the entry point). What they all share is here.
"""
from __future__ import annotations

import re

POLICIES = ("keep", "offload", "recompute")
# The planner's first rung, all or nothing: keep every activation, and keep the parameters both
# passes read on the device for the whole step (loaded once instead of twice). Extrapolated
# like a policy whose saved bytes per layer include the layer's resident parameters.
RESIDENT = "resident"
# Adjacent (earlier, later) layer policies a full-depth plan can have: the planner's solvers
# upgrade the earliest layers first, so keep layers come last.
PAIRS = (("offload", "keep"), ("recompute", "keep"), ("offload", "recompute"), ("recompute", "offload"))
PRECISIONS = ("fp32", "bf16")
DEFAULT_TRACED_LAYERS = 2
DEVICE_PARAM_BYTES = {"fp32": 4, "bf16": 2}

DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


class PlanError(ValueError):
    """The model cannot be planned this way (e.g. its decoder layers are not identical)."""
