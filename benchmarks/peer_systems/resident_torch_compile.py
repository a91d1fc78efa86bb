"""The ceiling where the model fits: everything on the GPU, ``torch.compile`` of the model,
bf16 autocast over fp32 weights, fused CUDA AdamW. Per-layer activation checkpointing
(Hugging Face's, non-reentrant) as the offload peers use, unless PEERS_RESIDENT_CHECKPOINT=0."""
from __future__ import annotations

import os

import torch

from .workload import labels_step, timed_steps


def train(workload) -> dict:
    model = workload.build_model().cuda()
    checkpoint = os.environ.get("PEERS_RESIDENT_CHECKPOINT", "1") == "1"
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=workload.lr, weight_decay=0.0, fused=True)

    times, losses = timed_steps(labels_step(compiled, opt, autocast=True), workload.batches())
    return {"step_times": times, "losses": losses,
            "notes": f"torch.compile(model), autocast bf16 over fp32 weights, fused CUDA AdamW, "
                     f"activation checkpointing {'per layer' if checkpoint else 'off'}"}
