"""Every long-context mechanism in one training step, equal to eager (issue 19).

An unmodified HF Llama (sdpa attention, its own shifted loss) at the smallest budget it fits
with its layers token-chunked: the causal mask transformers builds is proven causal and
elided, the LM head and its loss run fused in chunks, each layer's per-token runs are chunked,
some layers are replayed from inputs kept on the host (the streamed rung), and their inputs
land in the forward's offload arena. Losses and parameters equal eager within 1e-5; the
measured peak is the planned one.
"""
import pytest
import torch
from conftest import COMPILED
from reference_models import labels_training_step, train_side_by_side

import megacompile
from megacompile.core import fused_head, token_chunks
from megacompile.core.node_info import has_info, info

SEQ = 512


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=172, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         use_cache=False, tie_word_embeddings=False)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def _step_of(model):
    return labels_training_step(model, eps=1e-6)  # eps: see test_fused_head


def test_mask_elided_head_fused_layers_chunked_and_streamed_train_like_eager():
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 96, (1, SEQ), generator=gen),) for _ in range(2)]
    options = {"head_chunk_tokens": 128}
    with pytest.raises(megacompile.BudgetError) as e:
        train_side_by_side(_llama(), _step_of, batches[:1], {**options, "memory_budget": 1024})
    budget = e.value.token_chunked_minimum
    assert budget is not None and budget < e.value.minimum_budget
    torch._dynamo.reset()
    COMPILED.clear()

    model = _llama()
    pairs, reference = train_side_by_side(model, _step_of, batches, {**options, "memory_budget": budget})
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)

    record = next(r for r in COMPILED if r.backward is not None)
    forward = list(record.forward.graph.nodes)
    masks = [info(n).attention_mask for n in forward if has_info(n) and info(n).attention_mask]
    assert masks and all(m.startswith("causal:") for m in masks), masks
    values = [n.meta.get("val") for n in forward]
    assert not any(isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[-2:]) == (SEQ, SEQ)
                   for v in values)  # no (tokens x tokens) tensor is made any more
    assert any(n.target is fused_head.FORWARD_WITH_GRADS for n in forward)
    assert any(n.target is token_chunks.FORWARD for n in forward)
    report = megacompile.last_report()
    assert "streamed" in record.plan.reason and report.offload_arena_bytes > 0, record.plan.reason
    assert report.measured_peak_device_bytes == report.planned_peak_device_bytes <= budget
