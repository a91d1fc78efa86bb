"""Architectures no other test names, each trained side by side with eager under a budget
that makes it stream: the paths a Llama does not take.

- Mixtral: a mixture of experts, tokens routed by data (``grouped_mm``, top-k, scatter);
- Bloom: a custom ``autograd.Function`` (its GeLU), ALiBi, a KV-cache ``cat`` of transposed keys;
- Gemma 2: soft-capped attention (its eager attention), sliding windows, a tied embedding;
- T5: an encoder-decoder with a learned relative position bias (several graphs a step);
- ViT: a convolutional patch embedding and a classification head;
- Qwen3: RMSNorms over each head's queries and keys;
- DeBERTa-v2 (bf16): disentangled relative attention, scores masked with the dtype's least value.

Losses within 1e-5 of eager over two AdamW steps (fp32: the same kernels; the differences are
the order of a few sums). Parameters are not compared: a bias whose true gradient is zero
(attention keys) moves by Adam's normalised noise.
"""
import warnings

import pytest
import torch
from reference_models import train_side_by_side, training_state_bytes

import megacompile

transformers = pytest.importorskip("transformers")

LM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=128,
          max_position_embeddings=64)


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **LM))


def _bloom():
    return transformers.BloomForCausalLM(transformers.BloomConfig(hidden_size=64, n_layer=3, n_head=4,
                                                                  vocab_size=128))


def _gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        num_key_value_heads=2, head_dim=16, sliding_window=8, **LM))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_key_value_heads=2, head_dim=16, **LM))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, dropout_rate=0.0))


def _vit():
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=128, num_labels=10,
        # Unset, transformers sets it on the first loss it computes, and the step compiled again
        # at the second (a guard on the config): the whole compile twice, testing nothing more.
        problem_type="single_label_classification"))


def _loss_with_labels(m, x, y):
    return m(input_ids=x, labels=y).loss


def _tokens(g):
    x = torch.randint(0, 128, (2, 16), generator=g)
    return x, x


MODELS = {
    # name: (model, batch from a generator, the loss of a model on a batch)
    "mixtral": (_mixtral, _tokens, _loss_with_labels),
    "bloom": (_bloom, _tokens, _loss_with_labels),
    "gemma2": (_gemma2, _tokens, _loss_with_labels),
    "qwen3": (_qwen3, _tokens, _loss_with_labels),
    "t5": (_t5, lambda g: (torch.randint(0, 128, (2, 12), generator=g), torch.randint(0, 128, (2, 8), generator=g)),
           _loss_with_labels),
    "vit": (_vit, lambda g: (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)),
            lambda m, x, y: m(pixel_values=x, labels=y).loss),
}


def _step_of(loss_of):
    """``step_of(model)`` for ``train_side_by_side``: ``loss_of(model, x, y)``, then AdamW."""
    def step_of(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

        def step(x, y):
            loss = loss_of(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    return step_of


@pytest.mark.parametrize("name", list(MODELS))
def test_an_architecture_trains_like_eager_while_streaming(name):
    build, batch, loss_of = MODELS[name]
    torch.manual_seed(0)
    model = build()
    model.train()

    g = torch.Generator().manual_seed(1)
    budget = training_state_bytes(model) // 2  # the parameters alone take a quarter of it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pairs, _ = train_side_by_side(model, _step_of(loss_of), [batch(g) for _ in range(2)],
                                      {"memory_budget": budget})
    assert [str(w.message) for w in caught if "megatrain" in str(w.message)] == []
    report = megacompile.last_report()
    assert report.h2d_bytes > 0 and report.measured_peak_device_bytes <= budget
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_deberta_v2_trains_in_bf16_like_eager_autocast():
    """DeBERTa-v2 fills its attention scores with ``torch.finfo(query.dtype).min``: traced before
    the backend adds autocast, that is fp32's, which the bf16 scores cannot hold, and the fill
    raised at run time (``narrow_dtype_extremes`` fills bf16's, as eager autocast does)."""
    torch.manual_seed(0)
    model = transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        relative_attention=True, pos_att_type=["p2c", "c2p"], max_position_embeddings=64, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model.train()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(2, 128, (2, 16), generator=g), torch.randint(0, 3, (2,), generator=g)) for _ in range(2)]
    options = {"memory_budget": training_state_bytes(model) // 2, "precision": "bf16"}
    pairs, _ = train_side_by_side(model, _step_of(_loss_with_labels), batches, options, autocast=True)
    assert megacompile.last_report().h2d_bytes > 0
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=2.0**-12, atol=0)  # the stock bf16 bound (tests/test_bf16.py)
