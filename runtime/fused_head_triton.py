"""Triton chunk kernels of the fused LM head + loss (``megacompile.core.fused_head``).

Per chunk of tokens the matmul to the vocabulary stays cuBLAS (``torch.mm``); these kernels do
what the logits are needed for, one program per token, walking its row of logits in tiles of
``BLOCK`` entries:

- ``forward``: an online log-sum-exp (a running maximum and a sum of exponentials rescaled
  whenever the maximum grows), with the optional soft cap applied on the fly; it writes the
  token's log-sum-exp and loss (0 for an ignored label). No second buffer: the logits are only
  read.
- ``backward``: the logits' gradient, ``row_scale * (softmax - onehot(label))`` times the soft
  cap's derivative, written over the logits in their dtype (in place: the chunk's logits are
  the only chunk-sized buffer).
- ``forward_backward`` (``lm_head_loss_and_grads``): the two, one after the other, on one
  matmul's logits.

``TRITON_INTERPRET=1`` runs them on CPU tensors (how the tests check them); the kernels are
made on first use so that the variable is read then, not at import.
"""
from __future__ import annotations

import functools

import torch

from megacompile.core import fused_head

try:  # an optional dependency (the `triton` extra); the kernels below are made only where it is installed
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover (then CUDA runs the torch chunk kernels)
    triton = tl = None


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """The jitted kernels (``interpret``: the cache key; Triton reads TRITON_INTERPRET when
    ``triton.jit`` runs). The kernels name ``tl`` as a module global: the interpreter swaps
    the module's ``tl`` for its own while a kernel runs."""

    @triton.jit
    def forward_kernel(z_ptr, labels_ptr, lse_ptr, loss_ptr, vocab, stride, softcap, ignore_index,
                       HAS_CAP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        label = tl.load(labels_ptr + row)
        cols = tl.arange(0, BLOCK)
        top = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            mask = start + cols < vocab
            z = tl.load(base + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
            if HAS_CAP:  # c * tanh(z / c), tanh from exp(-2|x|): no overflow
                e = tl.exp(-2.0 * tl.abs(z / softcap))
                z = tl.where(z < 0, -softcap, softcap) * (1.0 - e) / (1.0 + e)
            z = tl.where(mask, z, float("-inf"))
            new_top = tl.maximum(top, tl.max(z, 0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(z - new_top), 0)
            top = new_top
        lse = top + tl.log(total)
        valid = label != ignore_index
        target = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
        if HAS_CAP:
            e = tl.exp(-2.0 * tl.abs(target / softcap))
            target = tl.where(target < 0, -softcap, softcap) * (1.0 - e) / (1.0 + e)
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))

    @triton.jit
    def backward_kernel(z_ptr, labels_ptr, lse_ptr, scale_ptr, vocab, stride, softcap, ignore_index,
                        HAS_CAP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        label = tl.load(labels_ptr + row)
        lse = tl.load(lse_ptr + row)
        scale = tl.load(scale_ptr + row)
        target = tl.where(label != ignore_index, label, -1)
        cols = tl.arange(0, BLOCK)
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            mask = idx < vocab
            raw = tl.load(base + idx, mask=mask, other=0.0)
            z = raw.to(tl.float32)
            if HAS_CAP:
                e = tl.exp(-2.0 * tl.abs(z / softcap))
                ratio = tl.where(z < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)  # tanh(z / c)
                z = softcap * ratio
            grad = (tl.exp(z - lse) - tl.where(idx == target, 1.0, 0.0)) * scale
            if HAS_CAP:
                grad = grad * (1.0 - ratio * ratio)
            tl.store(base + idx, grad.to(raw.dtype), mask=mask)

    return forward_kernel, backward_kernel


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _block(vocab: int) -> int:
    return min(4096, 1 << max(4, (vocab - 1).bit_length()))


def _logits_and_loss(h, weight, bias, labels, softcap: float, ignore_index: int):
    """A chunk's logits (cuBLAS) and, from them, each token's log-sum-exp and loss (the forward kernel)."""
    forward_kernel, _ = _kernels(_interpreting())
    z = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())
    rows = z.shape[0]
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    loss = torch.empty(rows, dtype=torch.float32, device=z.device)
    if rows:
        forward_kernel[(rows,)](z, labels.contiguous(), lse, loss, z.shape[1], z.stride(0), float(softcap or 1.0),
                                ignore_index, HAS_CAP=bool(softcap), BLOCK=_block(z.shape[1]))
    return z, lse, loss


def _triton_forward(h, weight, bias, labels, softcap: float, ignore_index: int):
    _, lse, loss = _logits_and_loss(h, weight, bias, labels, softcap, ignore_index)
    return loss, lse


def _gradient_in_place(z, labels, lse, row_scale, softcap: float, ignore_index: int):
    """The backward kernel: the chunk's logits ``z`` become their gradient."""
    _, backward_kernel = _kernels(_interpreting())
    if z.shape[0]:
        backward_kernel[(z.shape[0],)](z, labels.contiguous(), lse.contiguous(), row_scale.contiguous(), z.shape[1],
                                       z.stride(0), float(softcap or 1.0), ignore_index, HAS_CAP=bool(softcap),
                                       BLOCK=_block(z.shape[1]))
    return z


def _triton_backward(h, weight, bias, labels, lse, row_scale, softcap: float, ignore_index: int):
    z = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())
    return _gradient_in_place(z, labels, lse, row_scale, softcap, ignore_index)


def _triton_forward_backward(h, weight, bias, labels, row_scale, softcap: float, ignore_index: int):
    """The loss and the logits' gradient from one matmul: the forward kernel reads the logits,
    the backward kernel then overwrites them with their gradient."""
    z, lse, loss = _logits_and_loss(h, weight, bias, labels, softcap, ignore_index)
    return loss, _gradient_in_place(z, labels, lse, row_scale, softcap, ignore_index)


TRITON_KERNELS = fused_head.ChunkKernels(_triton_forward, _triton_backward, _triton_forward_backward)


def register_for_cuda() -> bool:
    """Chunks of calls on CUDA run the Triton kernels; False where Triton is not installed
    (the torch kernels run there instead)."""
    if triton is None:
        return False
    fused_head.register_chunk_kernels("cuda", TRITON_KERNELS)
    return True
