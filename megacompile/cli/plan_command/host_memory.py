"""Host memory of the training state (weights, gradients, AdamW moments), pinned and pageable,
as the runtime lays it out for each precision."""
from __future__ import annotations

# Host bytes per parameter, (pinned, pageable), and what they are.
# fp32: fp32 weights (pinned: streamed to the device) + fp32 gradients (pinned: they land
#   there from the device) | AdamW exp_avg + exp_avg_sq (pageable: only the host optimizer
#   touches them) = 4 + 4 | 8 = 16 B/param.
# bf16: the same fp32 state (pageable: no copy engine reads it) + a persistent bf16 copy of each
#   weight (pinned: it is what the loads carry; the host optimizer rewrites it with its update,
#   runtime/weight_copies.py) = 4 + 4 + 8 + 2 = 18 B/param.
# Either precision: 4 B/param less when the optimizer step overlaps the backward (each gradient
#   consumed as it lands, no gradient buffer kept; ``overlap_optimizer``): 12 and 14.
HOST_BYTES_PER_PARAM = {
    "fp32": {"weights": (4, "pinned"), "gradients": (4, "pinned"), "optimizer_states": (8, "pageable")},
    "bf16": {"weights": (4, "pageable"), "gradients": (4, "pageable"), "optimizer_states": (8, "pageable"),
             "bf16_weight_copies": (2, "pinned")},
}
OVERLAPPED_HOST_BYTES_PER_PARAM = {"fp32": 12, "bf16": 14}


def host_bytes(num_params: int, precision: str, offloaded_activation_bytes: int = 0, *,
               overlapped: bool = False) -> dict:
    """Host memory of the training state, split into what the runtime pins and what it does not.

    ``overlapped``: the optimizer step overlaps the backward (the runtime's default on a GPU), so
    no gradient buffer is kept (``OVERLAPPED_HOST_BYTES_PER_PARAM``).

    Pinned: the weights the device streams in and the gradient buffers it streams back into
    (and the host copies of offloaded activations). Pageable: what no copy engine reads
    (AdamW's two moments; in bf16 the fp32 weights and gradients too, since what crosses is
    the bf16 weight copies and transient bf16 gradients). See
    ``HOST_BYTES_PER_PARAM`` for the bytes per parameter.
    """
    layout = {name: part for name, part in HOST_BYTES_PER_PARAM[precision].items()
              if not (overlapped and name == "gradients")}
    parts = {name: (num_params * nbytes, kind) for name, (nbytes, kind) in layout.items()}
    if offloaded_activation_bytes:
        parts["offloaded_activations"] = (int(offloaded_activation_bytes), "pinned")
    pinned = sum(n for n, kind in parts.values() if kind == "pinned")
    pageable = sum(n for n, kind in parts.values() if kind == "pageable")
    return {
        "parts": {name: n for name, (n, _) in parts.items()},
        "pinned_bytes": pinned, "pageable_bytes": pageable, "total_bytes": pinned + pageable,
        "bytes_per_param": sum(nbytes for nbytes, _ in layout.values()),
        "overlapped": overlapped,
        "overlapped_bytes_per_param": OVERLAPPED_HOST_BYTES_PER_PARAM[precision],
    }
