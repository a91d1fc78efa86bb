"""Attention on the device for a step traced on the host.

The host trace holds ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which
have no CUDA kernel; ``runtime/placement.py`` runs these two functions in their place. They
keep the host pair's contract: the forward returns ``(output, logsumexp)`` with logsumexp of
shape [batch, heads, queries] in fp32 (what the plan counted), and the backward takes both.

Where the device's flash kernel applies (bf16 or fp16, as many key/value heads as query heads,
as many queries as keys, no mask, head size a multiple of 8 up to 256) the forward runs it and
returns its real logsumexp, and the backward runs the flash backward on it: no attention
forward is repeated. Elsewhere the forward runs ``F.scaled_dot_product_attention`` (torch picks
the kernel, with its mask and grouped-query handling) and the backward runs that forward again
under autograd (one attention forward more per layer, and a transient output-sized buffer the
plan does not count).

The flash pair is checked once per kind of call (dtype, head size, causal or not) in the
process: the first backward also computes the gradients the second way and compares them; if
they differ, or a flash call raises, that kind of call takes the second way from then on.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

_aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class FlashPair:
    """A device's flash attention kernels behind one calling convention."""

    forward: Callable  # (q, k, v, is_causal, scale) -> (out, logsumexp [B, H, L] fp32)
    backward: Callable  # (grad_out, q, k, v, out, logsumexp, is_causal, scale) -> (dq, dk, dv)


def _cuda_forward(q, k, v, is_causal, scale):
    result = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    return result[0], result[1]


def _cuda_backward(grad_out, q, k, v, out, logsumexp, is_causal, scale):
    # Dense (not variable-length) batches: no cumulative sequence lengths. Without dropout the
    # kernel reads no random-number state, so empty seeds stand in for the forward's.
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    return _aten._scaled_dot_product_flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, logsumexp, None, None, q.size(-2), k.size(-2), 0.0, is_causal,
        seed, seed, scale=scale)


def _cpu_forward(q, k, v, is_causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)


def _cpu_backward(grad_out, q, k, v, out, logsumexp, is_causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, logsumexp, 0.0, is_causal, scale=scale)


# By device type. On CPU the host pair itself (the runtime keeps the host ops there; the
# tests run these functions on CPU tensors through it).
FLASH_PAIRS = {"cuda": FlashPair(_cuda_forward, _cuda_backward), "cpu": FlashPair(_cpu_forward, _cpu_backward)}

# Kind of call -> whether its flash pair agreed with the second way (absent: not checked yet).
_VERDICTS: dict[tuple, bool] = {}


def _kind(query: torch.Tensor, is_causal: bool) -> tuple:
    return query.device.type, query.dtype, query.size(-1), bool(is_causal)


def _flash_applies(query, key, value, attn_mask, is_causal) -> bool:
    """The flash pair can run this call, and has not failed its check for this kind of call."""
    return (query.device.type in FLASH_PAIRS and attn_mask is None
            and query.dtype in (torch.bfloat16, torch.float16) and key.dtype == value.dtype == query.dtype
            and key.size(-3) == query.size(-3) and key.size(-2) == query.size(-2)
            and query.size(-1) % 8 == 0 and query.size(-1) <= 256
            and _VERDICTS.get(_kind(query, is_causal), True))


def device_attention_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """The host attention op's contract, ``(output, logsumexp)``, on any device."""
    if _flash_applies(query, key, value, attn_mask, is_causal):
        try:
            return FLASH_PAIRS[query.device.type].forward(query, key, value, is_causal, scale)
        except RuntimeError:
            _VERDICTS[_kind(query, is_causal)] = False
    gqa = key.size(-3) != query.size(-3)
    with torch.no_grad():
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=0.0,
                                             is_causal=is_causal, scale=scale, enable_gqa=gqa)
    # Read by nothing but the backward below, which runs the forward again on this way: an
    # uninitialised buffer with the host kernel's shape, so the plan's bytes still hold.
    logsumexp = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
    return out, logsumexp


def _again_under_autograd(grad_out, query, key, value, is_causal, attn_mask, scale):
    gqa = key.size(-3) != query.size(-3)
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_(True) for t in (query, key, value))
        again = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0,
                                               is_causal=is_causal, scale=scale, enable_gqa=gqa)
        return torch.autograd.grad(again, (q, k, v), grad_out)


def device_attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                              attn_mask=None, scale=None):
    """Gradients of ``device_attention_forward`` for q, k, v."""
    kind = _kind(query, is_causal)
    if not _flash_applies(query, key, value, attn_mask, is_causal):
        return _again_under_autograd(grad_out, query, key, value, is_causal, attn_mask, scale)
    try:
        grads = FLASH_PAIRS[query.device.type].backward(grad_out, query, key, value, out, logsumexp, is_causal,
                                                        scale)
    except RuntimeError:
        _VERDICTS[kind] = False
        return _again_under_autograd(grad_out, query, key, value, is_causal, attn_mask, scale)
    if kind not in _VERDICTS:
        reference = _again_under_autograd(grad_out, query, key, value, is_causal, attn_mask, scale)
        _VERDICTS[kind] = all(_close(g, r) for g, r in zip(grads, reference))
        if not _VERDICTS[kind]:
            return reference
    return tuple(grads)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The same gradient in half precision: kernels that sum in other orders agree to a few
    units in the last place of the largest values."""
    scale = want.float().abs().max().clamp_min(1e-6)
    return got.shape == want.shape and bool(((got.float() - want.float()).abs().max() <= 2e-2 * scale).item())
