"""The CUDA path: parity and peak memory against the plan on a real GPU.

Skipped on CPU-only machines (CI here has no GPU); benchmarks/gpu_smoke.py runs the same
check and records the numbers under benchmarks/results/.
"""
import copy

import pytest
import torch

import megacompile
from reference_models import REFERENCE_MODELS, make_training_step, training_state_bytes

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama"])
@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_cuda_parity_and_peak(name, lowering):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ctor, make_batch, loss_fn = REFERENCE_MODELS[name]
    torch.manual_seed(0)
    model = ctor()
    reference = copy.deepcopy(model).cuda()
    budget = training_state_bytes(model) // 4
    step, _ = make_training_step(model, loss_fn)
    eager_step, _ = make_training_step(reference, loss_fn)
    step = torch.compile(step, backend="megatrain",
                         options={"device": "cuda", "lowering": lowering, "memory_budget": budget})
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = make_batch(gen)
        torch.testing.assert_close(step(x, y), eager_step(x.cuda(), y.cuda()).cpu(), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q.cpu(), rtol=0, atol=1e-5)
    report = megacompile.last_report()
    assert report.measured_peak_device_bytes is not None
    assert report.measured_peak_device_bytes <= budget


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_cuda_hugging_face_llama_with_sdpa_attention(lowering):
    # Hugging Face's default attention: the host trace holds the CPU flash kernel, which the
    # runtime replaces by the device's attention (runtime/placement.py).
    from transformers import LlamaConfig, LlamaForCausalLM

    from reference_models import labels_training_step

    torch.backends.cuda.matmul.allow_tf32 = False
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    reference = copy.deepcopy(model).cuda()
    budget = training_state_bytes(model) // 2
    step = torch.compile(labels_training_step(model), backend="megatrain",
                         options={"device": "cuda", "lowering": lowering, "memory_budget": budget})
    eager_step = labels_training_step(reference)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 96, (2, 16), generator=gen)
        torch.testing.assert_close(step(x), eager_step(x.cuda()).cpu(), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q.cpu(), rtol=0, atol=2e-5)
    report = megacompile.last_report()
    assert report.measured_peak_device_bytes <= budget
