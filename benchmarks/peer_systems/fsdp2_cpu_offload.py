"""FSDP2 on one rank: ``fully_shard`` per decoder layer and at the root, parameters, gradients
and AdamW states on the host (``CPUOffloadPolicy(pin_memory=True)``), bf16 compute with fp32
master weights (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``), and
per-layer activation checkpointing (Hugging Face's, non-reentrant): what torch's own docs
recommend for a model larger than the GPU. The optimizer steps on the host's DTensors."""
from __future__ import annotations

import os

import torch

from .workload import labels_step, single_rank_process_group, timed_steps


def train(workload) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    single_rank_process_group("nccl")
    model = workload.build_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    # torch's fused CPU AdamW is its fastest host path; PEERS_FSDP2_FUSED=0 takes the default.
    fused = os.environ.get("PEERS_FSDP2_FUSED", "1") == "1"
    opt = torch.optim.AdamW(model.parameters(), lr=workload.lr, weight_decay=0.0, fused=fused or None)

    times, losses = timed_steps(labels_step(model, opt), workload.batches())
    return {"step_times": times, "losses": losses,
            "notes": f"torch {torch.__version__} FSDP2 fully_shard x{len(model.model.layers)} layers + root, "
                     f"CPUOffloadPolicy(pin_memory=True), MixedPrecisionPolicy(bf16 params, fp32 reduce), "
                     f"HF gradient checkpointing (non-reentrant), torch.optim.AdamW(fused={fused}) on the host"}
