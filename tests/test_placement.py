"""Ops that make tensors are retargeted from the host to the runtime's device.

The step is traced on the host, so ``arange`` (GPT's positions, Llama's position ids) names
the CPU in the captured graph. On the CPU stand-in that is harmless; on CUDA the op would
make a host tensor that the next kernel refuses (found on an H100: "index is on cpu,
different from other tensors on cuda:0"). These tests take the real rewritten programs of
the reference models and retarget them to ``meta`` (a device other than the host that
exists on every machine), the way the executor retargets them to ``cuda``.
"""
import copy

import pytest
import torch
from conftest import COMPILED
from reference_models import GPT, REFERENCE_MODELS, LlamaLogits, make_training_step

import megacompile
from megacompile.core.node_info import META_KEY, info
from megacompile.runtime import placement
from megacompile.runtime.device import CpuStandInDevice
from megacompile.runtime.executor import StreamingProgram

META = torch.device("meta")


def _rewritten_programs(name, ctor):
    _, make_batch, loss_fn = REFERENCE_MODELS[name]
    torch.manual_seed(0)
    model = ctor()
    step, _ = make_training_step(model, loss_fn)
    step = torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager"})
    step(*make_batch(torch.Generator().manual_seed(1)))
    (record,) = [r for r in COMPILED if r.backward is not None]
    return record.forward, record.backward


class _MetaBuildDevice(CpuStandInDevice):
    """The stand-in, claiming ``meta`` as its device: only a program's build is exercised
    (the executor retargets to whatever device it runs on)."""

    def __init__(self):
        super().__init__()
        self.torch_device = META


def _device_arguments(node):
    return [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.device)]


@pytest.mark.parametrize("name,ctor", [("gpt", lambda: GPT(layers=1)), ("llama", lambda: LlamaLogits(layers=1))])
def test_factory_ops_of_a_real_program_are_retargeted(name, ctor):
    forward, backward = _rewritten_programs(name, ctor)
    # Both models make their positions with arange in the forward.
    found = placement.host_device_arguments(forward)
    assert found, "expected the traced positions (arange on the host) in the forward"
    assert all(info(n).placement == "device" for n in found)
    for gm in (forward, backward):
        gm = copy.deepcopy(gm)
        before = placement.host_device_arguments(gm)
        assert placement.retarget_factories(gm, META) == len(before)
        assert placement.host_device_arguments(gm) == []
        for node in before:
            assert _device_arguments(node) and all(d == META for d in _device_arguments(node))
        # The generated code is what runs: it must name the new device too.
        if before:
            assert "device(type='meta')" in gm.code


def test_host_ops_keep_the_host_and_the_stand_in_is_untouched():
    forward, _ = _rewritten_programs("gpt", lambda: GPT(layers=1))
    gm = copy.deepcopy(forward)
    everything = len(placement.host_device_arguments(gm))
    # A host op (a host cast's placement) that names the host must keep it.
    factory = placement.host_device_arguments(gm)[0]
    factory.meta[META_KEY] = copy.copy(info(factory))  # a copy may share the original's meta
    info(factory).placement = "host"
    assert len(placement.host_device_arguments(gm)) == everything - 1
    assert placement.retarget_factories(gm, META) == everything - 1
    assert _device_arguments(factory) == [torch.device("cpu")]
    assert placement.host_device_arguments(gm) == []
    # On the CPU stand-in host and device are one torch device: nothing changes.
    gm = copy.deepcopy(forward)
    assert placement.retarget_factories(gm, torch.device("cpu")) == 0
    assert len(placement.host_device_arguments(gm)) == len(placement.host_device_arguments(forward))


def test_constants_read_on_the_device_are_placed_there():
    value = torch.arange(4.0)
    placed = placement.place_constant(value, META)
    assert placed.device == META and placed.shape == value.shape
    assert placement.place_constant(value, torch.device("cpu")) is value
    assert placement.place_constant(3, META) == 3


def test_the_executor_retargets_before_it_lowers():
    forward, _ = _rewritten_programs("gpt", lambda: GPT(layers=1))
    gm = copy.deepcopy(forward)

    StreamingProgram(gm, _MetaBuildDevice(), "eager")
    assert placement.host_device_arguments(gm) == []


class ScaledByALiteral(torch.nn.Module):
    """A forward that builds a tensor from a literal: Dynamo lifts it into a graph constant."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_constants_are_placed_as_real_tensors_even_when_built_under_a_fake_mode():
    # AOTAutograd calls the lowering inside its tracing, where a fake mode can be active: a
    # constant copied to the device there must still be a real tensor.
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    model = ScaledByALiteral()
    step, _ = make_training_step(model, torch.nn.functional.mse_loss)
    step = torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager"})
    step(torch.randn(3, 4), torch.randn(3, 4))
    (record,) = [r for r in COMPILED if r.backward is not None]
    gm = copy.deepcopy(record.forward)
    assert any(n.op == "get_attr" for n in gm.graph.nodes), "expected the literal as a graph constant"

    with FakeTensorMode():
        program = StreamingProgram(gm, _MetaBuildDevice(), "eager")
    constants = [i.value for i in program.instructions if i.kind == "const" and isinstance(i.value, torch.Tensor)]
    assert constants
    assert all(c.device == META and not isinstance(c, FakeTensor) for c in constants)


def _sdpa_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=172, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_host_attention_kernels_are_substituted_for_another_device():
    # Hugging Face's default attention traces to the host-only flash kernel; on CUDA it failed
    # with "Could not run '_scaled_dot_product_flash_attention_for_cpu' ... 'CUDA' backend".
    from reference_models import labels_training_step

    step = torch.compile(labels_training_step(_sdpa_llama()), backend="megatrain",
                         options={"device": "cpu", "lowering": "eager"})
    step(torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0)))
    (record,) = [r for r in COMPILED if r.backward is not None]
    host_ops = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
                placement.device_attention_forward,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
                placement.device_attention_backward}
    for gm in (record.forward, record.backward):
        gm = copy.deepcopy(gm)
        before = [n for n in gm.graph.nodes if n.target in host_ops]
        assert len(before) == 1
        wanted = host_ops[before[0].target]
        assert placement.substitute_host_kernels(gm, torch.device("cpu")) == 0  # the stand-in keeps them
        assert placement.substitute_host_kernels(gm, META) == 1
        assert [n.target for n in gm.graph.nodes if n in before] == [wanted]
        assert not any(n.target in host_ops for n in gm.graph.nodes)
        # Dropout cannot be replayed on the device: a clear error, not a silent change.
        gm = copy.deepcopy(gm)
        node = next(n for n in gm.graph.nodes if n.target is wanted)
        index = 3 if wanted is placement.device_attention_forward else 6
        node.target = next(k for k, v in host_ops.items() if v is wanted)
        args = list(node.args) + [0.0] * (index + 1 - len(node.args))
        args[index] = 0.1
        node.args = tuple(args)
        with pytest.raises(megacompile.MegacompileError, match="attention_dropout"):
            placement.substitute_host_kernels(gm, META)


# The host kernel takes a mask or causal masking, not both.
@pytest.mark.parametrize("causal,masked", [(False, False), (True, False), (False, True)])
def test_device_attention_matches_the_host_kernels(causal, masked):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=gen, dtype=torch.float64).float() for _ in range(3))
    mask = torch.randn(2, 1, 8, 8, generator=gen) if masked else None
    grad = torch.randn(2, 4, 8, 16, generator=gen)
    want_out, want_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=None)
    want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, want_out, want_lse, 0.0, causal, attn_mask=mask, scale=None)
    out, lse = placement.device_attention_forward(q, k, v, 0.0, causal, attn_mask=mask, scale=None)
    got = placement.device_attention_backward(grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=None)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    assert lse.shape == want_lse.shape and lse.dtype == want_lse.dtype  # the plan's bytes
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_device_attention_with_fewer_key_value_heads():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, 16, generator=gen)
    k, v = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(2))
    grad = torch.randn(1, 4, 8, 16, generator=gen)
    out, lse = placement.device_attention_forward(q, k, v, 0.0, True)
    got = placement.device_attention_backward(grad, q, k, v, out, lse, 0.0, True)
    # Reference: the key/value heads repeated, as grouped-query attention means.
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qr, kr.repeat_interleave(2, dim=1), vr.repeat_interleave(2, dim=1), is_causal=True)
    ref.backward(grad)
    torch.testing.assert_close(out, ref.detach())
    for g, w in zip(got, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(g, w)
        assert g.shape == w.shape
