"""Peer system ``megatrain_reference``: the shared workload trained by MegaTrain's own code.

MegaTrain (arXiv 2604.05091; github.com/DLYuanGod/MegaTrain, Apache-2.0) is the paper whose
design megacompile's backend follows, so its public implementation is the first peer to
measure against. Nothing of it is copied here: its source is exported, uncommitted, into
``<repo>/.peers/MegaTrain`` (the commit hash in ``.peers/MegaTrain/MEGATRAIN_COMMIT``) and
imported from there; this file is only the adapter that drives it on ``Workload``.

How MegaTrain trains an HF model (its ``examples/sft/train.py`` and QUICKSTART's Python API):
``CPUMasterModel(hf_model, CPUMasterConfig)`` keeps every parameter on the host, streams one
decoder layer at a time into two GPU layer templates (double buffered, weights as one pinned
flat buffer per layer), checkpoints the hidden state every ``checkpoint_interval`` layers,
recomputes a block in backward, and sends gradients back through ``num_grad_slabs`` pinned
slabs to a host thread that accumulates them into ``param.grad``. Each step of its loop is
``forward_and_backward(input_ids, attention_mask, labels)`` (loss returned as a float), then
``optimizer.step()`` on the host parameters, ``_sync_params_to_gpu()``, ``zero_grad()``. This
adapter runs exactly that loop, single-GPU path, with MegaTrain's defaults
(checkpoint_interval 4, num_grad_slabs 12, the whole batch in one call).

Where the GPU machine differs from MegaTrain's recommended setup, the adapter takes
MegaTrain's own fallbacks: torch.optim.AdamW instead of DeepSpeedCPUAdam (train.py's fallback
when deepspeed is missing) and standard cross-entropy instead of flash-attn's. Attention is
SDPA (flash-attn is absent). MegaTrain's single-GPU path hands the attention mask it is given
straight to every decoder layer (it is written for flash_attention_2, which takes a 2-D
padding mask); a 2-D mask would break SDPA, so for these unpadded batches the adapter passes a
mask whose ``.to(device)`` is ``None`` (SDPA then runs causal, the kernel FA2 would run), or,
with MEGATRAIN_REF_MASK=4d, MegaTrain's own 4-D causal mask (``_prepare_4d_causal_mask``, the
fallback its multi-GPU workers use for non-FA2 attention). The mask is used nowhere else in
the step (the loss counts labels != -100).

Precision. MegaTrain's examples load the model in bf16 (``torch_dtype=bfloat16``): the host
"master" parameters, gradients and AdamW state are then bf16. Handing it an fp32 model does
not work in this commit (its gradient slabs are in ``config.dtype`` and the host thread
assigns a bf16 ``.grad`` to an fp32 parameter). So:
  MEGATRAIN_REF_PRECISION=bf16 (default): MegaTrain as shipped; the workload's fp32 weights
      are rounded to bf16 once and everything on the host is bf16 from then on.
  MEGATRAIN_REF_PRECISION=fp32_master: MegaTrain still streams and computes in bf16, but
      the adapter keeps fp32 master copies: each step it widens MegaTrain's bf16 gradients,
      runs AdamW on the fp32 masters and rounds them back into MegaTrain's parameters before
      ``_sync_params_to_gpu()`` (the workload's "fp32 master weights, bf16 compute").
In both, the loss MegaTrain reports is its bf16 cross-entropy summed in bf16 over 128-token
chunks, so the logged values are quantised (about 0.4% relative); its gradients are as
accurate as HF's own bf16 backward (checked on the CPU against fp32).
Other knobs (environment): MEGATRAIN_REF_MICRO_BATCH (rows per forward_and_backward call;
default the whole batch, MegaTrain's gradient_accumulation_steps 1; smaller splits the batch
and normalises every split by the whole batch's token count, MegaTrain's own
``global_valid_tokens`` mechanism, so one optimizer step still sees batch x seq tokens),
MEGATRAIN_REF_CHECKPOINT_INTERVAL, MEGATRAIN_REF_GRAD_SLABS, MEGATRAIN_REF_OPTIMIZER
(adamw | deepspeed_adam), MEGATRAIN_REF_CLIP (max grad norm; default 0 = off, as the
workload's AdamW has no clipping, while MegaTrain's train.py clips at 1.0).
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEGATRAIN_DIR = os.path.join(REPO, ".peers", "MegaTrain")


def _import_megatrain():
    """Import MegaTrain's ``infinity`` package from .peers/MegaTrain, or say how to get it."""
    if not os.path.isfile(os.path.join(MEGATRAIN_DIR, "infinity", "model", "cpu_master.py")):
        raise RuntimeError(
            f"MegaTrain's source is not at {MEGATRAIN_DIR}: export github.com/DLYuanGod/MegaTrain "
            "there (source only, never committed) and write its commit hash to "
            ".peers/MegaTrain/MEGATRAIN_COMMIT")
    # On sys.path only for this import: MegaTrain's checkout also has top-level tests/ and
    # examples/ packages that must not shadow ours; its later imports go through infinity's
    # package path.
    sys.path.insert(0, MEGATRAIN_DIR)
    try:
        from infinity.config.training import CPUMasterConfig
        from infinity.model import cpu_master
    finally:
        sys.path.remove(MEGATRAIN_DIR)

    where = os.path.abspath(cpu_master.__file__)
    if not where.startswith(MEGATRAIN_DIR + os.sep):  # another package named "infinity" won
        raise RuntimeError(f"imported 'infinity' from {where}, not from {MEGATRAIN_DIR}")
    return cpu_master, CPUMasterConfig


def _commit() -> str:
    try:
        with open(os.path.join(MEGATRAIN_DIR, "MEGATRAIN_COMMIT")) as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


class _CausalOnly:
    """Stands in for the attention mask: MegaTrain calls ``mask.to(device)`` and hands the
    result to each layer; ``None`` makes HF's SDPA attention use is_causal=True."""

    def to(self, *args, **kwargs):
        return None


def _make_optimizer(kind: str, params, lr: float, eps: float):
    """AdamW as MegaTrain's train.py builds it (weight_decay 0.0 and default betas: the
    workload's). Returns (optimizer, description)."""
    if kind == "deepspeed_adam":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except ImportError as err:  # MegaTrain's own fallback when deepspeed is absent
            note = f"torch.optim.AdamW (deepspeed_adam asked, import failed: {err})"
        else:
            return (DeepSpeedCPUAdam(params, lr=lr, betas=(0.9, 0.999), eps=eps,
                                     weight_decay=0.0, adamw_mode=True), "DeepSpeedCPUAdam")
    else:
        note = "torch.optim.AdamW (MegaTrain's fallback without deepspeed)"
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=0.0), note


def train(workload) -> dict:
    # MegaTrain's train.py sets this before CUDA starts; it only takes effect if CUDA is not
    # initialised yet in this process.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    alloc_conf_effective = not torch.cuda.is_initialized()
    cpu_master, CPUMasterConfig = _import_megatrain()

    precision = os.environ.get("MEGATRAIN_REF_PRECISION", "bf16")
    if precision not in ("bf16", "fp32_master"):
        raise ValueError(f"MEGATRAIN_REF_PRECISION must be bf16 or fp32_master, not {precision!r}")
    mask_mode = os.environ.get("MEGATRAIN_REF_MASK", "causal")
    if mask_mode not in ("causal", "4d"):
        raise ValueError(f"MEGATRAIN_REF_MASK must be causal or 4d, not {mask_mode!r}")
    B, T = workload.batch, workload.seq
    rows = min(_env_int("MEGATRAIN_REF_MICRO_BATCH", B), B)
    clip = float(os.environ.get("MEGATRAIN_REF_CLIP", "0") or 0)

    config = CPUMasterConfig(
        model_name="workload.build_model()",  # unused: the module is handed over directly
        dataset_path="__synthetic__",  # unused (train() feeds workload.batches()); must be set
        device=0,
        dtype=torch.bfloat16,
        attn_implementation="sdpa",
        max_seq_len=T,
        batch_size=B,
        num_steps=workload.steps,
        learning_rate=workload.lr,
        weight_decay=0.0,
        max_grad_norm=clip,
        seed=workload.seed,
        checkpoint_interval=_env_int("MEGATRAIN_REF_CHECKPOINT_INTERVAL", 4),
        num_grad_slabs=_env_int("MEGATRAIN_REF_GRAD_SLABS", 12),
    )

    # The workload's fp32 weights; parameters rounded to bf16 in place as MegaTrain's loaders
    # produce them (buffers, i.e. RoPE's inv_freq, stay fp32 as in a bf16 checkpoint load).
    model = workload.build_model()
    masters = {}  # id(bf16 param) -> its fp32 master (fp32_master only)
    with torch.no_grad():
        for p in model.parameters():
            fp32 = p.data
            p.data = fp32.to(torch.bfloat16)
            if precision == "fp32_master":
                masters[id(p)] = fp32

    mt = cpu_master.CPUMasterModel(model, config)
    del model
    try:
        params = mt.get_parameters()
        if precision == "fp32_master":
            opt_params = [torch.nn.Parameter(masters.pop(id(p))) for p in params]
            for m in opt_params:
                m.grad = torch.zeros_like(m)
            masters.clear()
        else:
            opt_params = params
        optimizer, opt_note = _make_optimizer(
            os.environ.get("MEGATRAIN_REF_OPTIMIZER", "adamw"), opt_params, workload.lr, config.eps)

        device = mt.device
        if mask_mode == "4d":
            mask = cpu_master.CPUMasterModel._prepare_4d_causal_mask(
                torch.ones(1, T, dtype=torch.long), config.dtype, T).to(device)
        else:
            mask = _CausalOnly()
        ctx = mt.gpu_contexts[0]
        total_tokens = B * (T - 1)  # labels = ids: every shifted position is a target

        step_times, losses = [], []
        fwd_bwd, opt_times, fwd_s, bwd_s = [], [], [], []
        for batch in workload.batches():
            assert batch.shape == (B, T), batch.shape
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if rows >= B:  # MegaTrain's default: the whole batch in one call
                loss, _, timing = mt.forward_and_backward(batch, mask, batch)
                fwd_s.append(timing["forward"])
                bwd_s.append(timing["backward"])
            else:  # split rows; each split's loss divided by the whole batch's token count
                loss = 0.0
                for start in range(0, B, rows):
                    part = batch[start:start + rows]
                    part_loss, _, timing, _ = mt._forward_and_backward_single_gpu(
                        ctx, part, mask, part, total_tokens)
                    loss += part_loss * part.shape[0] / B
                    fwd_s.append(timing["forward"])
                    bwd_s.append(timing["backward"])
                mt._accumulate_grads_batch()  # wait for the host thread's gradient adds
            t1 = time.perf_counter()

            if precision == "fp32_master":
                with torch.no_grad():
                    for p, m in zip(params, opt_params):
                        m.grad.copy_(p.grad)
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(opt_params, clip)
            optimizer.step()
            if precision == "fp32_master":
                with torch.no_grad():
                    for p, m in zip(params, opt_params):
                        p.data.copy_(m.data)
            mt._sync_params_to_gpu()
            mt.zero_grad()
            if precision != "fp32_master":
                optimizer.zero_grad()  # as train.py: the next step's grads are fresh tensors
            torch.cuda.synchronize(device)
            t2 = time.perf_counter()

            losses.append(float(loss))
            step_times.append(t2 - t0)
            fwd_bwd.append(t1 - t0)
            opt_times.append(t2 - t1)
    finally:
        mt.cleanup()

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    calls = math.ceil(B / rows)
    notes = (
        f"MegaTrain {_commit()} (github.com/DLYuanGod/MegaTrain, from .peers/MegaTrain): "
        f"infinity.CPUMasterModel single-GPU path driven step by step as its examples/sft/train.py "
        f"does (forward_and_backward -> optimizer.step -> _sync_params_to_gpu -> zero_grad); "
        f"precision={precision} ("
        + ("host params/grads/AdamW state bf16, as MegaTrain ships" if precision == "bf16" else
           "MegaTrain streams/computes bf16, adapter keeps fp32 masters + fp32 AdamW")
        + f"); attn=sdpa, mask={mask_mode}"
        + (" (None to layers: SDPA is_causal)" if mask_mode == "causal" else
           " (MegaTrain's _prepare_4d_causal_mask)")
        + f"; checkpoint_interval={config.checkpoint_interval}, num_grad_slabs={config.num_grad_slabs}; "
        f"{calls} forward_and_backward call(s) of {rows} x {T} per step"
        + ("" if calls == 1 else " (split normalised by the whole batch's tokens)")
        + f"; optimizer: {opt_note}, lr={workload.lr}, wd=0.0, clip={clip or 'off'}; "
        f"loss CE: {'flash-attn' if cpu_master.FLASH_CE_AVAILABLE else 'torch'} (bf16 sums: losses quantised ~0.4%); "
        f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')}"
        + ("" if alloc_conf_effective else " (CUDA was already initialised: not in effect)")
        + f"; mean s/step: fwd+bwd {mean(fwd_bwd):.3f} (MegaTrain events fwd {mean(fwd_s):.3f}, "
        f"bwd {mean(bwd_s):.3f} per call), optimizer+sync {mean(opt_times):.3f}"
    )
    return {"step_times": step_times, "losses": losses, "notes": notes}
