"""runtime/device_attention.py: attention on the device for a step traced on the host.

On CUDA the flash pair runs where it applies (no attention forward repeated in the backward),
checked once per kind of call against the forward run again under autograd. These tests run
the same functions on CPU tensors, where the flash pair is the host's own
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward)."""
import pytest
import torch
import torch.nn.functional as F

from megacompile.runtime import device_attention
from megacompile.runtime.device_attention import FlashPair, device_attention_backward, device_attention_forward


@pytest.fixture
def fresh_verdicts(monkeypatch):
    verdicts: dict = {}
    monkeypatch.setattr(device_attention, "_VERDICTS", verdicts)
    return verdicts


@pytest.fixture
def replays(monkeypatch):
    """Counts the backwards that ran the forward again under autograd."""
    calls = []
    original = device_attention._again_under_autograd

    def counted(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(device_attention, "_again_under_autograd", counted)
    return calls


def _inputs(dtype=torch.bfloat16, kv_heads=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 16, 32, generator=gen).to(dtype)
    k, v = (torch.randn(2, kv_heads, 16, 32, generator=gen).to(dtype) for _ in range(2))
    grad = torch.randn(2, 4, 16, 32, generator=gen).to(dtype)
    return q, k, v, grad


def _reference_grads(q, k, v, grad, causal):
    """fp32 autograd of plain attention (the key/value heads repeated for grouped queries)."""
    qr, kr, vr = (t.float().requires_grad_(True) for t in (q, k, v))
    groups = q.size(1) // k.size(1)
    out = F.scaled_dot_product_attention(qr, kr.repeat_interleave(groups, 1), vr.repeat_interleave(groups, 1),
                                         is_causal=causal)
    out.backward(grad.float())
    return out.detach(), (qr.grad, kr.grad, vr.grad)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_pair_keeps_its_logsumexp_and_repeats_no_forward(causal, fresh_verdicts, replays):
    """bf16, as many key/value heads as query heads, no mask: the forward's log-sum-exp is the
    flash kernel's (the host pair's values here), the backward reads it; the first backward
    of this kind checks it against the replay once, later ones replay nothing."""
    q, k, v, grad = _inputs()
    want_out, want_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    out, lse = device_attention_forward(q, k, v, 0.0, causal)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    ref_out, ref_grads = _reference_grads(q, k, v, grad, causal)
    for _ in range(2):
        grads = device_attention_backward(grad, q, k, v, out, lse, 0.0, causal)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g.float(), r, rtol=2e-2, atol=2e-2)
    assert len(replays) == 1  # the check, once
    assert fresh_verdicts == {("cpu", torch.bfloat16, 32, causal): True}
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)


def test_a_flash_pair_that_disagrees_is_not_used_again(fresh_verdicts, replays, monkeypatch):
    """A flash backward whose gradients differ from the replay's: the first backward returns
    the replay's, and the kind of call takes the replay from then on, its forward included."""
    good = device_attention.FLASH_PAIRS["cpu"]
    forwards = []

    def counted_forward(*args):
        forwards.append(args)
        return good.forward(*args)

    wrong = FlashPair(counted_forward, lambda *args: tuple(2 * g for g in good.backward(*args)))
    monkeypatch.setitem(device_attention.FLASH_PAIRS, "cpu", wrong)
    q, k, v, grad = _inputs()
    _, ref_grads = _reference_grads(q, k, v, grad, True)
    for _ in range(2):
        out, lse = device_attention_forward(q, k, v, 0.0, True)
        grads = device_attention_backward(grad, q, k, v, out, lse, 0.0, True)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g.float(), r, rtol=2e-2, atol=2e-2)
    assert fresh_verdicts == {("cpu", torch.bfloat16, 32, True): False}
    assert len(forwards) == 1 and len(replays) == 2


def test_a_flash_kernel_that_raises_falls_back(fresh_verdicts, replays, monkeypatch):
    def refuses(*args):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    monkeypatch.setitem(device_attention.FLASH_PAIRS, "cpu", FlashPair(refuses, refuses))
    q, k, v, grad = _inputs()
    out, lse = device_attention_forward(q, k, v, 0.0, True)
    grads = device_attention_backward(grad, q, k, v, out, lse, 0.0, True)
    _, ref_grads = _reference_grads(q, k, v, grad, True)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r, rtol=2e-2, atol=2e-2)
    assert lse.shape == (2, 4, 16) and lse.dtype == torch.float32  # the plan's bytes either way
    assert fresh_verdicts == {("cpu", torch.bfloat16, 32, True): False} and len(replays) == 1


@pytest.mark.parametrize("dtype, kv_heads, masked", [(torch.float32, 4, False), (torch.bfloat16, 2, False),
                                                     (torch.bfloat16, 4, True)])
def test_where_flash_does_not_apply_the_backward_replays(dtype, kv_heads, masked, fresh_verdicts, replays):
    """fp32, grouped-query heads, or a mask: the forward through torch's attention, the
    backward by replaying it; nothing is checked."""
    q, k, v, grad = _inputs(dtype, kv_heads)
    mask = torch.zeros(2, 1, 16, 16, dtype=dtype) if masked else None
    out, lse = device_attention_forward(q, k, v, 0.0, not masked, attn_mask=mask)
    grads = device_attention_backward(grad, q, k, v, out, lse, 0.0, not masked, attn_mask=mask)
    _, ref_grads = _reference_grads(q, k, v, grad, not masked)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r, rtol=tol, atol=tol)
    assert fresh_verdicts == {} and len(replays) == 1
