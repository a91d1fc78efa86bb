"""The fused LM head + cross-entropy op: ``megatrain::lm_head_loss`` and its backward.

``lm_head_loss(hidden, weight, bias, labels, ...)`` is ``cross_entropy(hidden @ weight.T + bias,
labels)`` computed over chunks of ``chunk_tokens`` tokens: a chunk's logits are made, reduced
to each token's log-sum-exp and loss, and dropped, so the (tokens x vocabulary) logits never
exist whole. The backward (``lm_head_loss_backward``) makes each chunk's logits again, turns
them into their gradient in place and accumulates the hidden-state, weight and bias gradients
chunk by chunk; all it keeps from the forward is the per-token log-sum-exp (4 bytes a token).

``lm_head_loss_and_grads``, for a differentiated mean or sum loss: the logits' gradient depends
on nothing after the loss but one scalar (the loss's gradient), so each chunk's logits are made
once, turned into the loss and then into their gradient for a loss gradient of 1, and the
hidden-state, weight and bias gradients come out of the forward; the backward only scales them.
Three head matmuls per step instead of four (the unfused count), and the backward does not load
the head's weight. For ``loss.backward()`` the Triton kernels give the two-op form's gradients
bit for bit; the torch ones take the softmax as exponentials over their sum (an ulp apart).

Numerics follow the unfused graph: the logits are rounded to the matmul's dtype (bf16 under
autocast, as eager materialises them), the optional soft cap ``c * tanh(z / c)`` and the
softmax run in fp32, the loss is ``loss_dtype``, and the logits' gradient is rounded to the
matmul's dtype before the two matmuls, as eager's backward rounds it.

The chunk loop is shared; what runs per chunk is a ``ChunkKernels``. ``TORCH_KERNELS`` here
(torch ops, for the CPU stand-in and any device without Triton); ``megacompile.runtime``
registers a CUDA implementation whose chunk kernels are Triton (an online log-sum-exp over
vocabulary tiles). ``workspace_bytes`` is what one call holds beyond its inputs and outputs,
for the memory estimate; the torch kernels report their chunk buffers to
``workspace.observe`` so the stand-in's tracker measures them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from typing import Callable, Optional

import torch
from torch.utils import flop_counter

from megacompile.core import workspace

REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True)
class ChunkKernels:
    """What runs per chunk of tokens.

    ``forward(h, weight, bias, labels, softcap, ignore_index) -> (loss_rows, lse)``, both fp32
    of the chunk's length (an ignored token's loss is 0); ``backward(h, weight, bias, labels,
    lse, row_scale, softcap, ignore_index) -> dlogits`` in the matmul's dtype: row_scale times
    d(loss_row)/d(logits), times the soft cap's derivative; ``forward_backward(h, weight, bias,
    labels, row_scale, softcap, ignore_index) -> (loss_rows, dlogits)``: both from one matmul."""

    forward: Callable
    backward: Callable
    forward_backward: Callable


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    z = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())
    return workspace.tracked(z)


def _fp32_logits(h, weight, bias, softcap: float, slope: bool):
    """A chunk's logits in fp32 (the matmul's dtype given back too), soft-capped where there is
    a cap, and with ``slope`` the cap's derivative (None without a cap)."""
    z = _logits(h, weight, bias)
    dtype = z.dtype
    zf = workspace.tracked(z.float()) if dtype != torch.float32 else z
    del z
    derivative = None
    if softcap:
        zf.div_(softcap).tanh_()
        if slope:
            derivative = workspace.tracked(torch.square(zf)).neg_().add_(1)  # d(c * tanh(z / c)) / dz
        zf.mul_(softcap)
    return zf, derivative, dtype


def _softmax_to_gradient(probs, picked, row_scale) -> None:
    """Turns the softmax ``probs`` into the loss rows' gradient w.r.t. the (capped) logits, in place."""
    probs[torch.arange(probs.shape[0], device=probs.device), picked] -= 1.0  # ignored rows: row_scale is 0
    probs.mul_(row_scale.unsqueeze(1))


def _in_matmul_dtype(grad, dtype):
    return workspace.tracked(grad.to(dtype)) if dtype != torch.float32 else grad


def _torch_forward(h, weight, bias, labels, softcap: float, ignore_index: int):
    zf, _, _ = _fp32_logits(h, weight, bias, softcap, slope=False)
    valid = labels != ignore_index
    target = zf.gather(1, torch.where(valid, labels, 0).unsqueeze(1)).squeeze(1)
    top = zf.amax(1)
    lse = zf.sub_(top.unsqueeze(1)).exp_().sum(1).log_().add_(top)
    return torch.where(valid, lse - target, 0.0), lse


def _torch_backward(h, weight, bias, labels, lse, row_scale, softcap: float, ignore_index: int):
    zf, slope, dtype = _fp32_logits(h, weight, bias, softcap, slope=True)
    probs = zf.sub_(lse.unsqueeze(1)).exp_()
    _softmax_to_gradient(probs, torch.where(labels != ignore_index, labels, 0), row_scale)
    if slope is not None:
        probs.mul_(slope)
        del slope  # before the copy in the matmul's dtype: the working set is planned so
    return _in_matmul_dtype(probs, dtype)


def _torch_forward_backward(h, weight, bias, labels, row_scale, softcap: float, ignore_index: int):
    zf, slope, dtype = _fp32_logits(h, weight, bias, softcap, slope=True)
    valid = labels != ignore_index
    picked = torch.where(valid, labels, 0)
    target = zf.gather(1, picked.unsqueeze(1)).squeeze(1)
    top = zf.amax(1)
    probs = zf.sub_(top.unsqueeze(1)).exp_()
    total = probs.sum(1)
    lse = total.log().add_(top)
    probs.div_(total.unsqueeze(1))  # the softmax, from the same exponentials
    _softmax_to_gradient(probs, picked, row_scale)
    if slope is not None:
        probs.mul_(slope)
        del slope  # before the copy in the matmul's dtype: the working set is planned so
    return torch.where(valid, lse - target, 0.0), _in_matmul_dtype(probs, dtype)


TORCH_KERNELS = ChunkKernels(_torch_forward, _torch_backward, _torch_forward_backward)
_KERNELS: dict[str, ChunkKernels] = {}


def register_chunk_kernels(device_type: str, kernels: ChunkKernels) -> None:
    """Use ``kernels`` for the chunks of calls on ``device_type`` (the runtime's Triton ones on CUDA)."""
    _KERNELS[device_type] = kernels


@contextlib.contextmanager
def using_chunk_kernels(device_type: str, kernels: ChunkKernels):
    """Calls on ``device_type`` run ``kernels`` while active (tests run the Triton kernels on
    the CPU this way, under TRITON_INTERPRET=1)."""
    before = _KERNELS.get(device_type)
    _KERNELS[device_type] = kernels
    try:
        yield
    finally:
        if before is None:
            _KERNELS.pop(device_type, None)
        else:
            _KERNELS[device_type] = before


def kernels_for(device: torch.device) -> ChunkKernels:
    return _KERNELS.get(device.type, TORCH_KERNELS)


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _chunks(n: int, chunk_tokens: int):
    for start in range(0, n, chunk_tokens):
        yield start, min(n, start + chunk_tokens)


_PRODUCT_BLOCK_BYTES = 64 << 20


def _block_rows(h: torch.Tensor) -> int:
    """Vocabulary rows per block of a bf16 weight-gradient product: 64 MiB of it at a time."""
    return max(1, _PRODUCT_BLOCK_BYTES // (h.shape[1] * h.element_size()))


def _check(hidden, weight, bias, labels, chunk_tokens: int, reduction: str) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"megatrain lm_head_loss: hidden (tokens, H) and weight (vocab, H) expected, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"megatrain lm_head_loss: one label per token expected, got labels {tuple(labels.shape)} "
                         f"for {hidden.shape[0]} tokens")
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"megatrain lm_head_loss: hidden, weight and bias must share a dtype, got {hidden.dtype}, "
                         f"{weight.dtype}" + (f", {bias.dtype}" if bias is not None else ""))
    if chunk_tokens < 1 or reduction not in REDUCTIONS:
        raise ValueError(f"megatrain lm_head_loss: chunk_tokens >= 1 and reduction in {REDUCTIONS} expected, got "
                         f"{chunk_tokens} and {reduction!r}")


@torch.library.custom_op("megatrain::lm_head_loss", mutates_args=())
def lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                 chunk_tokens: int, ignore_index: int, reduction: str, softcap: float,
                 loss_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse): the cross-entropy of ``hidden @ weight.T + bias`` against ``labels``, and
    each token's log-sum-exp (fp32) for the backward."""
    _check(hidden, weight, bias, labels, chunk_tokens, reduction)
    kernels = kernels_for(hidden.device)
    n = hidden.shape[0]
    rows = workspace.tracked(torch.empty(n, dtype=torch.float32, device=hidden.device))
    lse = workspace.tracked(torch.empty(n, dtype=torch.float32, device=hidden.device))
    for start, end in _chunks(n, chunk_tokens):
        rows[start:end], lse[start:end] = kernels.forward(hidden[start:end], weight, bias, labels[start:end],
                                                          softcap, ignore_index)
    if reduction == "none":
        return rows.to(loss_dtype), lse
    total = rows.sum()
    if reduction == "mean":
        total = total / (labels != ignore_index).sum()
    return total.to(loss_dtype), lse


@lm_head_loss.register_fake
def _(hidden, weight, bias, labels, chunk_tokens, ignore_index, reduction, softcap, loss_dtype):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=loss_dtype)
    return loss, hidden.new_empty((n,), dtype=torch.float32)


def _row_scale(grad: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """Per token, d(loss)/d(its loss row) times the loss's gradient ``grad`` (a scalar, or one
    per token for "none"); 0 for an ignored token."""
    valid = labels != ignore_index
    grad = grad.float()
    if reduction == "mean":
        grad = grad / valid.sum()
    return torch.where(valid, grad, 0.0)


def _gradients(hidden, weight, bias, chunk_tokens: int, weight_grad: bool, dlogits_of_chunk):
    """(grad_hidden, grad_weight, grad_bias) accumulated chunk by chunk from
    ``dlogits_of_chunk(start, end)``; grad_weight is empty unless ``weight_grad``, grad_bias
    empty where there is no bias."""
    n, vocab = hidden.shape[0], weight.shape[0]
    grad_hidden = workspace.tracked(torch.empty_like(hidden, memory_format=torch.contiguous_format))
    # Weight gradient: accumulated in fp32 (a bf16 running sum would round at every chunk).
    wide = weight.dtype != torch.float32
    grad_weight = None
    if weight_grad:
        grad_weight = workspace.tracked(torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wide
                               else torch.zeros_like(weight, memory_format=torch.contiguous_format))
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=hidden.device) if bias is not None else None
    for start, end in _chunks(n, chunk_tokens):
        h = hidden[start:end]
        dz = dlogits_of_chunk(start, end)
        torch.mm(dz, weight, out=grad_hidden[start:end])
        if grad_weight is not None:
            if wide:  # the product in the matmul's dtype, a block of vocabulary rows at a time
                for v0, v1 in _chunks(vocab, _block_rows(h)):
                    grad_weight[v0:v1].add_(workspace.tracked(torch.mm(dz[:, v0:v1].t(), h)))
            else:
                grad_weight.addmm_(dz.t(), h)
        if grad_bias is not None:
            grad_bias.add_(dz.sum(0, dtype=torch.float32))
        del dz
    empty = hidden.new_empty((0,))
    grad_weight = empty if grad_weight is None else grad_weight.to(weight.dtype)
    grad_bias = empty if grad_bias is None else grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


@torch.library.custom_op("megatrain::lm_head_loss_backward", mutates_args=())
def lm_head_loss_backward(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                          bias: Optional[torch.Tensor], labels: torch.Tensor, lse: torch.Tensor, chunk_tokens: int,
                          ignore_index: int, reduction: str, softcap: float,
                          weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias); grad_weight is empty unless ``weight_grad``,
    grad_bias empty where there is no bias."""
    kernels = kernels_for(hidden.device)
    row_scale = _row_scale(grad_loss, labels, ignore_index, reduction)

    def dlogits(start: int, end: int) -> torch.Tensor:
        return kernels.backward(hidden[start:end], weight, bias, labels[start:end], lse[start:end],
                                row_scale[start:end], softcap, ignore_index)

    return _gradients(hidden, weight, bias, chunk_tokens, weight_grad, dlogits)


@lm_head_loss_backward.register_fake
def _(grad_loss, hidden, weight, bias, labels, lse, chunk_tokens, ignore_index, reduction, softcap, weight_grad):
    empty = hidden.new_empty((0,))
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if weight_grad else empty,
            torch.empty_like(bias) if bias is not None else empty)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, labels, chunk_tokens, ignore_index, reduction, softcap, _loss_dtype = inputs
    ctx.save_for_backward(hidden, weight, bias, labels, output[1])
    ctx.options = (chunk_tokens, ignore_index, reduction, softcap)


def _backward(ctx, grad_loss, _grad_lse):
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    grad_hidden, grad_weight, grad_bias = lm_head_loss_backward(
        grad_loss, hidden, weight, bias, labels, lse, *ctx.options, weight_grad=ctx.needs_input_grad[1])
    return (grad_hidden if ctx.needs_input_grad[0] else None, grad_weight if ctx.needs_input_grad[1] else None,
            grad_bias if bias is not None and ctx.needs_input_grad[2] else None, None, None, None, None, None, None)


lm_head_loss.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("megatrain::lm_head_loss_and_grads", mutates_args=())
def lm_head_loss_and_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           labels: torch.Tensor, chunk_tokens: int, ignore_index: int, reduction: str, softcap: float,
                           loss_dtype: torch.dtype,
                           weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, grad_weight, grad_bias) of a mean or sum cross-entropy: the loss and
    its own gradients (for a loss gradient of 1), made in one pass over each chunk's logits.
    grad_weight is empty unless ``weight_grad``, grad_bias empty where there is no bias."""
    _check(hidden, weight, bias, labels, chunk_tokens, reduction)
    if reduction == "none":
        raise ValueError("megatrain lm_head_loss_and_grads: a per-token loss (reduction 'none') has a gradient per "
                         "token that the forward cannot know; use lm_head_loss")
    kernels = kernels_for(hidden.device)
    rows = workspace.tracked(torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device))
    row_scale = _row_scale(torch.ones((), device=hidden.device), labels, ignore_index, reduction)

    def dlogits(start: int, end: int) -> torch.Tensor:
        rows[start:end], dz = kernels.forward_backward(hidden[start:end], weight, bias, labels[start:end],
                                                       row_scale[start:end], softcap, ignore_index)
        return dz

    grad_hidden, grad_weight, grad_bias = _gradients(hidden, weight, bias, chunk_tokens, weight_grad, dlogits)
    total = rows.sum()
    if reduction == "mean":
        total = total / (labels != ignore_index).sum()
    return total.to(loss_dtype), grad_hidden, grad_weight, grad_bias


@lm_head_loss_and_grads.register_fake
def _(hidden, weight, bias, labels, chunk_tokens, ignore_index, reduction, softcap, loss_dtype, weight_grad):
    empty = hidden.new_empty((0,))
    return (hidden.new_empty((), dtype=loss_dtype), torch.empty_like(hidden, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if weight_grad else empty,
            torch.empty_like(bias) if bias is not None else empty)


def _setup_grads_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*output[1:])
    ctx.has_bias = inputs[2] is not None


def _grads_backward(ctx, grad_loss, _grad_hidden, _grad_weight, _grad_bias):
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    wanted = ctx.needs_input_grad
    return (grad_hidden * grad_loss if wanted[0] else None,
            grad_weight * grad_loss if wanted[1] and grad_weight.numel() else None,
            grad_bias * grad_loss if ctx.has_bias and wanted[2] else None,
            None, None, None, None, None, None, None)


lm_head_loss_and_grads.register_autograd(_grads_backward, setup_context=_setup_grads_context)

FORWARD = torch.ops.megatrain.lm_head_loss.default
BACKWARD = torch.ops.megatrain.lm_head_loss_backward.default
FORWARD_WITH_GRADS = torch.ops.megatrain.lm_head_loss_and_grads.default
OPS = (FORWARD, BACKWARD, FORWARD_WITH_GRADS)


# --- FLOPs and working set ---------------------------------------------------------------
@flop_counter.register_flop_formula(torch.ops.megatrain.lm_head_loss)
def _forward_flops(hidden_shape, weight_shape, *args, **kwargs) -> int:
    return 2 * hidden_shape[0] * hidden_shape[1] * weight_shape[0]


@flop_counter.register_flop_formula(torch.ops.megatrain.lm_head_loss_backward)
def _backward_flops(grad_shape, hidden_shape, weight_shape, *args, **kwargs) -> int:
    # The logits again, then the hidden state's and the weight's gradient.
    return 3 * 2 * hidden_shape[0] * hidden_shape[1] * weight_shape[0]


@flop_counter.register_flop_formula(torch.ops.megatrain.lm_head_loss_and_grads)
def _forward_with_grads_flops(hidden_shape, weight_shape, *args, **kwargs) -> int:
    # The logits, then the hidden state's and the weight's gradient.
    return 3 * 2 * hidden_shape[0] * hidden_shape[1] * weight_shape[0]


def workspace_bytes(target, tokens: int, vocab: int, width: int, itemsize: int, chunk_tokens: int, softcap: float,
                    triton: bool, weight_grad: bool = True) -> int:
    """Bytes one call holds beyond its inputs and outputs at its fullest (a chunk's buffers,
    the fp32 weight-gradient sum), for the chunk kernels it runs with (``triton``: the
    runtime's, which read and overwrite the chunk's logits in place). ``itemsize``: bytes per
    element of the matmul's dtype. ``FORWARD_WITH_GRADS`` holds what the backward holds (its
    chunk's logits become their gradient in the same buffers)."""
    logits = min(tokens, chunk_tokens) * vocab  # elements of one chunk's logits
    wide = itemsize != 4
    if target is FORWARD:
        if triton:
            return logits * itemsize
        return logits * (itemsize + 4) if wide else logits * 4
    if triton:
        chunk = logits * itemsize
    else:
        chunk = max(logits * (itemsize + 4) if wide else logits * 4, logits * 8 if softcap else 0)
    if not weight_grad or not wide:
        return chunk  # (an fp32 weight's gradient is accumulated in place: addmm_)
    # The fp32 sum all along; at a chunk's end its logits' gradient and one block of the product.
    block = min(vocab, max(1, _PRODUCT_BLOCK_BYTES // (width * itemsize)))
    return vocab * width * 4 + max(chunk, logits * itemsize + block * width * itemsize)
