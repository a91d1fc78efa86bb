"""DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the host, on one GPU.

The peer a user reaches for when a model's training state does not fit the device: ZeRO
stage 3 keeps the bf16 parameters in pinned host memory and gathers each layer onto the
GPU for its forward and backward, the fp32 master weights, gradients and AdamW states live
on the host and DeepSpeedCPUAdam (a C++ op JIT-built with ninja on first use) steps them
there. Run as one rank (world size 1), bf16 compute, per-layer activation checkpointing
through Hugging Face's own ``gradient_checkpointing_enable`` (non-reentrant).

Initial weights: the model is built by ``workload.build_model()`` (fp32 on the host, so its
values are the same as every other system's), its parameters are cast to bf16 on the host
(what DeepSpeed itself does to a plain module when ``bf16`` is on: buffers such as the rotary
frequencies stay fp32), and ``deepspeed.zero.Init(module=model)`` -- DeepSpeed's documented
way to partition an already-built model -- moves them one parameter at a time to the GPU and
back into pinned host partitions. The whole model is therefore never on the GPU at once,
unlike ``deepspeed.initialize`` on a plain module, which copies all of it there first. The
fp32 master copies are made from those bf16 values, as in any DeepSpeed bf16 run.

The ZeRO-3 knobs are those Hugging Face's DeepSpeed integration fills in for ``"auto"``
(reduce bucket hidden^2, prefetch bucket 0.9 hidden^2, persistence threshold 10 hidden) with
DeepSpeed's documented offload example for the rest; ``notes`` states them all.

Environment: DeepSpeed picks its accelerator itself (``DS_ACCELERATOR=cuda`` forces it on
the GPU machine, ``DS_ACCELERATOR=cpu`` runs this on a host without one, with gloo); the
DeepSpeedCPUAdam build goes to ``TORCH_EXTENSIONS_DIR`` (default /tmp/torch_extensions_ds
here, set before import).
"""
from __future__ import annotations

import os
import socket
import time


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _single_rank_env() -> None:
    """One process, one rank: the variables a launcher would set, where none did."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for name in ("RANK", "LOCAL_RANK"):
        os.environ.setdefault(name, "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/torch_extensions_ds")


def ds_config(workload) -> dict:
    hidden = workload.hidden
    return {
        "train_micro_batch_size_per_gpu": workload.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # none, as in the other systems
        "bf16": {"enabled": True},  # bf16 params/compute, fp32 master weights in the optimizer
        "optimizer": {  # with offload_optimizer this becomes DeepSpeedCPUAdam(adamw_mode=True)
            "type": "AdamW",
            "params": {"lr": workload.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": int(1e9),
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
            "stage3_max_live_parameters": int(1e9),
            "stage3_max_reuse_distance": int(1e9),
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def train(workload) -> dict:
    _single_rank_env()
    import logging
    import warnings

    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    deepspeed.utils.logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated")  # once a step
    accel = get_accelerator()
    on_gpu = accel.device_name() == "cuda"
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    config = ds_config(workload)

    t0 = time.perf_counter()
    model = workload.build_model()  # fp32 on the host: the same weights as every system
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with torch.no_grad():  # params only (rotary buffers stay fp32), param by param: no 2nd copy
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    deepspeed.zero.Init(module=model, config_dict_or_path=config)  # partition into pinned host
    built_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    init_s = time.perf_counter() - t0  # includes DeepSpeedCPUAdam's JIT build (cached after)

    device = engine.device
    step_times, losses = [], []
    for x in workload.batches():
        accel.synchronize()
        start = time.perf_counter()
        x = x.to(device, non_blocking=True)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        value = loss.item()  # the loss on the host ends the step
        accel.synchronize()
        step_times.append(time.perf_counter() - start)
        losses.append(value)

    zero = config["zero_optimization"]
    peak = f", device peak {accel.max_memory_allocated() / 2**30:.1f} GiB" if on_gpu else ""
    notes = (
        f"DeepSpeed {deepspeed.__version__} ({accel.device_name()}), world size 1, ZeRO-3 with "
        f"offload_param + offload_optimizer to pinned host memory, bf16 compute with fp32 master "
        f"weights, {type(optimizer).__name__} over {type(optimizer.optimizer).__name__} "
        f"(AdamW lr={workload.lr}, betas (0.9, 0.999), eps 1e-8, weight_decay 0), no clipping, "
        f"micro batch {workload.batch}, no accumulation, HF gradient checkpointing per layer "
        f"(non-reentrant); overlap_comm, contiguous_gradients, sub_group_size 1e9, "
        f"reduce_bucket_size {zero['reduce_bucket_size']}, stage3_prefetch_bucket_size "
        f"{zero['stage3_prefetch_bucket_size']}, stage3_param_persistence_threshold "
        f"{zero['stage3_param_persistence_threshold']} (Hugging Face's 'auto' rules), max live/reuse "
        f"1e9. Weights: workload.build_model() in fp32, params cast to bf16 on the host, partitioned "
        f"by deepspeed.zero.Init(module=model) one param at a time (the whole model never on the "
        f"GPU); fp32 masters made from the bf16 values. Build+partition {built_s:.0f} s, "
        f"deepspeed.initialize {init_s:.0f} s (CPU Adam JIT build included){peak}."
    )
    engine.destroy()
    return {"step_times": step_times, "losses": losses, "notes": notes}
