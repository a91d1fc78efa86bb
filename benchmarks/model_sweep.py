"""Architectures and training loops no test names, each trained with megatrain and eagerly side by side.

On the CPU stand-in (eager lowering unless --lowering), under a memory budget that is a
fraction of the model's training state, a few AdamW steps on random data. Prints one row per
(case, precision): the largest relative loss difference to eager PyTorch (bf16: eager under
CPU autocast; the eager AdamW step is megatrain's host kernel, whose sqrt is correctly rounded
where MKL's is 1 ulp off for some elements, which bf16 would amplify), the largest absolute parameter difference, the plan, and any megatrain warning
(a warning means the step fell back to plain eager or Inductor) or the error.

    python benchmarks/model_sweep.py                     # every case, fp32 and bf16
    python benchmarks/model_sweep.py --cases mixtral,t5 --precision bf16 --token-chunks 2
    python benchmarks/model_sweep.py --precision bf16 --autocast-in-step   # the step's own autocast region
    python benchmarks/model_sweep.py --at-minimum        # each at the smallest budget its planner accepts
    python benchmarks/model_sweep.py --at-minimum --cases dbrx --calls-before-backward 8
    python benchmarks/model_sweep.py --precision fp32 --overlap-optimizer   # updates overlapped with the backward
    python benchmarks/model_sweep.py --layers 10 --mark-layers   # marked layers, planned on the template

Parameters can differ by Adam's normalised noise where a true gradient is zero (attention key
biases), so losses are the comparison; a fallback or an error is what the sweep looks for.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import platform
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import megacompile
from megacompile.capture.records import recording

VOCAB = 128
LM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=VOCAB,
          max_position_embeddings=64)


# --layers: the depth of the cases whose config names num_hidden_layers (None: as written).
LAYERS: int | None = None


def _hf(config_class: str, model_class: str, **config):
    def build():
        import transformers  # lazy: only the Hugging Face cases need it

        depth = {"num_hidden_layers": LAYERS} if LAYERS and "num_hidden_layers" in config else {}
        return getattr(transformers, model_class)(getattr(transformers, config_class)(**{**config, **depth}))
    return build


def _tokens(g):
    x = torch.randint(0, VOCAB, (2, 16), generator=g)
    return x, x


def _lm_loss(m, x, y):
    return m(input_ids=x, labels=y).loss


class WeightNormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.utils.parametrizations.weight_norm(nn.Linear(32, 32)) for _ in range(4))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


class TorchEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32, padding_idx=0)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


class ConvUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down1, self.norm1 = nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16)
        self.down2, self.norm2 = nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(4, 32)
        self.up, self.norm3 = nn.ConvTranspose2d(32, 16, 2, stride=2), nn.GroupNorm(4, 16)
        self.out = nn.Conv2d(32, 3, 1)

    def forward(self, x):
        a = F.silu(self.norm1(self.down1(x)))
        b = F.silu(self.norm2(self.down2(a)))
        return self.out(torch.cat([a, F.silu(self.norm3(self.up(b)))], 1))


class LSTMLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.rnn, self.head = nn.Embedding(64, 32), nn.LSTM(32, 32, 2, batch_first=True), nn.Linear(32, 64)

    def forward(self, x):
        return self.head(self.rnn(self.embed(x))[0])


def _mse(m, x, y):
    return ((m(x) - y) ** 2).mean()


def _images(g):
    return torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 3, (2,), generator=g)


def _pixels_loss(m, x, y):
    return m(pixel_values=x, labels=y).loss


def _sentences(g):
    return torch.randint(2, VOCAB, (2, 16), generator=g), torch.randint(0, 3, (2,), generator=g)


def _source_target(g):
    return torch.randint(2, VOCAB, (2, 12), generator=g), torch.randint(2, VOCAB, (2, 8), generator=g)


def _speech(g):
    return torch.randn(2, 1600, generator=g), torch.randint(1, 30, (2, 4), generator=g)


def _unrelated_labels(g):
    # Funnel's decoder adds the embeddings back: labels equal to the inputs give a loss near 1e-6.
    return torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g)


def _whisper_batch(g):
    return torch.randn(2, 16, 64, generator=g), torch.randint(3, VOCAB, (2, 8), generator=g)


def _clip_batch(g):
    return torch.randint(0, VOCAB, (4, 10), generator=g), torch.randn(4, 3, 32, 32, generator=g)


def _mae_batch(g):
    # The noise that orders the patches for masking is an input: both sides mask the same patches.
    return torch.randn(2, 3, 32, 32, generator=g), torch.rand(2, 16, generator=g)


IMAGE_TOKEN = VOCAB - 1


def _llava_batch(g):
    # 16 image tokens (a 32x32 image in 8x8 patches) that the model replaces with projected image features.
    ids = torch.randint(2, VOCAB - 1, (2, 24), generator=g)
    ids[:, 1:17] = IMAGE_TOKEN
    labels = ids.clone()
    labels[:, 1:17] = -100
    return ids, torch.randn(2, 3, 32, 32, generator=g), labels


def _patchtst_batch(g):
    return torch.randn(4, 32, 3, generator=g), torch.randn(4, 8, 3, generator=g)


TINY_VISION = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4)


# name: (build, batch from a generator, loss of a model on a batch, budget as a fraction of the training state)
CASES = {
    "mistral": (_hf("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, sliding_window=8, **LM),
                _tokens, _lm_loss, 0.3),
    "qwen2": (_hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **LM), _tokens, _lm_loss, 0.3),
    "qwen3": (_hf("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=16, **LM), _tokens, _lm_loss, 0.3),
    "phi3": (_hf("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=4, pad_token_id=0, **LM), _tokens, _lm_loss, 0.3),
    "gemma": (_hf("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=1, head_dim=16, **LM), _tokens, _lm_loss, 0.3),
    "gemma2": (_hf("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2, head_dim=16, sliding_window=8, **LM),
               _tokens, _lm_loss, 0.5),
    "gpt_neox": (_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **LM), _tokens, _lm_loss, 0.3),
    "falcon": (_hf("FalconConfig", "FalconForCausalLM", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                   vocab_size=VOCAB), _tokens, _lm_loss, 0.3),
    "bloom": (_hf("BloomConfig", "BloomForCausalLM", hidden_size=64, n_layer=3, n_head=4, vocab_size=VOCAB),
              _tokens, _lm_loss, 0.3),
    "gptj": (_hf("GPTJConfig", "GPTJForCausalLM", n_embd=64, n_layer=3, n_head=4, vocab_size=VOCAB, rotary_dim=8,
                 n_positions=64), _tokens, _lm_loss, 0.3),
    "mixtral": (_hf("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, **LM), _tokens, _lm_loss, 0.3),
    "qwen2_moe": (_hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, **LM),
                  _tokens, _lm_loss, 0.3),
    "phi": (_hf("PhiConfig", "PhiForCausalLM", **LM), _tokens, _lm_loss, 0.3),
    "olmo": (_hf("OlmoConfig", "OlmoForCausalLM", num_key_value_heads=4, **LM), _tokens, _lm_loss, 0.3),
    "starcoder2": (_hf("Starcoder2Config", "Starcoder2ForCausalLM", num_key_value_heads=2, **LM),
                   _tokens, _lm_loss, 0.3),
    "cohere": (_hf("CohereConfig", "CohereForCausalLM", num_key_value_heads=2, **LM), _tokens, _lm_loss, 0.3),
    "t5": (_hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128,
               num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, dropout_rate=0.0),
           lambda g: (torch.randint(0, VOCAB, (2, 12), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g)),
           _lm_loss, 0.3),
    "bert_mlm": (_hf("BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
                     num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0), _tokens, _lm_loss, 0.3),
    "vit": (_hf("ViTConfig", "ViTForImageClassification", image_size=32, patch_size=8, num_channels=3,
                hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, num_labels=10),
            lambda g: (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)),
            lambda m, x, y: m(pixel_values=x, labels=y).loss, 0.3),
    "resnet": (_hf("ResNetConfig", "ResNetForImageClassification", num_channels=3, embedding_size=16,
                   hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10),
               lambda g: (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)),
               lambda m, x, y: m(pixel_values=x, labels=y).loss, 0.8),
    "weight_norm": (WeightNormMLP, lambda g: (torch.randn(8, 32, generator=g), torch.randn(8, 1, generator=g)),
                    _mse, 0.4),
    "torch_encoder": (TorchEncoder, lambda g: (torch.randint(0, 64, (4, 10), generator=g),
                                               torch.randn(4, 1, generator=g)), _mse, 0.4),
    "conv_unet": (ConvUNet, lambda g: (torch.randn(2, 3, 16, 16, generator=g), torch.randn(2, 3, 16, 16, generator=g)),
                  _mse, 3.0),
    "lstm": (LSTMLanguageModel, lambda g: (lambda x: (x, x))(torch.randint(0, 64, (2, 10), generator=g)),
             lambda m, x, y: F.cross_entropy(m(x).flatten(0, 1), y.flatten()), 0.4),
    # Added on 2026-11-26 (second sweep): state-space and hybrid models, MLA, more MoE, encoders,
    # vision and speech. Dropouts and drop paths off where the config has them on (each side draws
    # its own random numbers: the comparison would measure the draws).
    "mamba": (_hf("MambaConfig", "MambaForCausalLM", vocab_size=VOCAB, hidden_size=64, state_size=8,
                  num_hidden_layers=3, use_mambapy=False), _tokens, _lm_loss, 1.5),
    "mamba2": (_hf("Mamba2Config", "Mamba2ForCausalLM", vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16,
                   state_size=16, n_groups=1, num_hidden_layers=3, chunk_size=8), _tokens, _lm_loss, 0.6),
    "jamba": (_hf("JambaConfig", "JambaForCausalLM", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                  attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                  num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
              _tokens, _lm_loss, 0.6),
    "falcon_h1": (_hf("FalconH1Config", "FalconH1ForCausalLM", num_key_value_heads=2, mamba_d_ssm=64,
                      mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8, **LM),
                  _tokens, _lm_loss, 0.3),
    "qwen3_next": (_hf("Qwen3NextConfig", "Qwen3NextForCausalLM", num_key_value_heads=2, head_dim=16,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, full_attention_interval=2,
                       **{**LM, "num_hidden_layers": 4}), _tokens, _lm_loss, 0.6),
    "lfm2": (_hf("Lfm2Config", "Lfm2ForCausalLM", num_key_value_heads=2, full_attn_idxs=[1], **LM),
             _tokens, _lm_loss, 0.3),
    "rwkv": (_hf("RwkvConfig", "RwkvForCausalLM", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
                 attention_hidden_size=64, intermediate_size=128, context_length=32), _tokens, _lm_loss, 0.3),
    "deepseek_v3": (_hf("DeepseekV3Config", "DeepseekV3ForCausalLM", moe_intermediate_size=32, first_k_dense_replace=1,
                        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16,
                        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        num_key_value_heads=4, **LM), _tokens, _lm_loss, 0.3),
    "gpt_oss": (_hf("GptOssConfig", "GptOssForCausalLM", head_dim=16, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=8, **{**LM, "intermediate_size": 64}),
                _tokens, _lm_loss, 0.6),
    "llama4": (_hf("Llama4TextConfig", "Llama4ForCausalLM", num_key_value_heads=2, head_dim=16,
                   intermediate_size_mlp=128, num_local_experts=2, attention_chunk_size=8,
                   **{**LM, "intermediate_size": 64}), _tokens, _lm_loss, 0.3),
    "dbrx": (_hf("DbrxConfig", "DbrxForCausalLM", d_model=64, n_heads=4, n_layers=2, max_seq_len=64,
                 vocab_size=VOCAB, attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}), _tokens, _lm_loss, 0.3),
    "gemma3": (_hf("Gemma3TextConfig", "Gemma3ForCausalLM", num_key_value_heads=2, head_dim=16, sliding_window=8,
                   **LM), _tokens, _lm_loss, 0.3),
    "olmo2": (_hf("Olmo2Config", "Olmo2ForCausalLM", num_key_value_heads=2, **LM), _tokens, _lm_loss, 0.3),
    "bart": (_hf("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=64, encoder_layers=2,
                 decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                 decoder_ffn_dim=128, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0),
             _source_target, _lm_loss, 0.3),
    "deberta_v2": (_hf("DebertaV2Config", "DebertaV2ForSequenceClassification", vocab_size=VOCAB, hidden_size=64,
                       num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, relative_attention=True,
                       pos_att_type=["p2c", "c2p"], max_position_embeddings=64, num_labels=3,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                   _sentences, _lm_loss, 0.3),
    "modernbert": (_hf("ModernBertConfig", "ModernBertForMaskedLM", vocab_size=VOCAB, hidden_size=64,
                       num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, local_attention=8,
                       global_attn_every_n_layers=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, cls_token_id=1, sep_token_id=2), _tokens, _lm_loss, 0.3),
    "swin": (_hf("SwinConfig", "SwinForImageClassification", image_size=32, patch_size=4, embed_dim=16,
                 depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3, drop_path_rate=0.0),
             _images, _pixels_loss, 1.0),
    "convnext": (_hf("ConvNextConfig", "ConvNextForImageClassification", num_channels=3, hidden_sizes=[16, 32],
                     depths=[1, 1], num_stages=2, num_labels=3), _images, _pixels_loss, 0.8),
    "segformer": (_hf("SegformerConfig", "SegformerForSemanticSegmentation", num_channels=3, num_encoder_blocks=2,
                      depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                      patch_sizes=[7, 3], strides=[4, 2], decoder_hidden_size=32, num_labels=3, drop_path_rate=0.0,
                      classifier_dropout_prob=0.0),
                  lambda g: (torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 3, (2, 32, 32), generator=g)),
                  _pixels_loss, 0.8),
    "wav2vec2_ctc": (_hf("Wav2Vec2Config", "Wav2Vec2ForCTC", vocab_size=32, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=128, conv_dim=(16, 16), conv_stride=(5, 4),
                         conv_kernel=(10, 4), num_feat_extract_layers=2, hidden_dropout=0.0, attention_dropout=0.0,
                         activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, mask_time_prob=0.0,
                         layerdrop=0.0, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                         ctc_loss_reduction="mean"),
                     _speech, lambda m, x, y: m(input_values=x, labels=y).loss, 1.0),
    # Added on 2026-11-26 (third sweep): multimodal (contrastive towers, LLaVA's image tokens
    # merged into the text), masked autoencoding with given noise, shared weights across layers
    # (ALBERT, Zamba2's shared blocks), reversible layers (Reformer's custom autograd), local and
    # sliding-chunk attention, a pooling encoder, a recurrent LM, a time-series model.
    "whisper": (_hf("WhisperConfig", "WhisperForConditionalGeneration", vocab_size=VOCAB, num_mel_bins=16, encoder_layers=2,
                    decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, d_model=64, encoder_ffn_dim=128,
                    decoder_ffn_dim=128, max_source_positions=32, max_target_positions=32, dropout=0.0, pad_token_id=0,
                    bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
                _whisper_batch, lambda m, x, y: m(input_features=x, labels=y).loss, 0.3),
    "clip": (_hf("CLIPConfig", "CLIPModel", text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32), vision_config=TINY_VISION,
                 projection_dim=16), _clip_batch, lambda m, t, x: m(input_ids=t, pixel_values=x, return_loss=True).loss, 0.4),
    "siglip": (_hf("SiglipConfig", "SiglipModel", text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32), vision_config=TINY_VISION),
               _clip_batch, lambda m, t, x: m(input_ids=t, pixel_values=x, return_loss=True).loss, 0.4),
    "vit_mae": (_hf("ViTMAEConfig", "ViTMAEForPreTraining", image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=128, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                    decoder_num_attention_heads=4, decoder_intermediate_size=64, mask_ratio=0.5),
                _mae_batch, lambda m, x, n: m(pixel_values=x, noise=n).loss, 0.4),
    "llava": (_hf("LlavaConfig", "LlavaForConditionalGeneration", vision_config={"model_type": "clip_vision_model", **TINY_VISION},
                  text_config={"model_type": "llama", **LM}, image_token_index=IMAGE_TOKEN, projector_hidden_act="gelu",
                  vision_feature_select_strategy="default", vision_feature_layer=-1),
              _llava_batch, lambda m, ids, px, y: m(input_ids=ids, pixel_values=px, labels=y).loss, 0.6),
    "gpt_bigcode": (_hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_embd=64, n_layer=3, n_head=4, vocab_size=VOCAB,
                        n_positions=64, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), _tokens, _lm_loss, 0.3),
    "reformer": (_hf("ReformerConfig", "ReformerModelWithLMHead", attn_layers=["local", "local"], hidden_size=64,
                     feed_forward_size=128, num_attention_heads=4, attention_head_size=16, vocab_size=VOCAB,
                     axial_pos_embds=False, max_position_embeddings=64, local_attn_chunk_length=8, is_decoder=True,
                     hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0,
                     pad_token_id=0), _tokens, _lm_loss, 0.3),
    "esm": (_hf("EsmConfig", "EsmForMaskedLM", vocab_size=33, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                intermediate_size=128, position_embedding_type="rotary", pad_token_id=1, mask_token_id=32,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
            lambda g: (lambda x: (x, x))(torch.randint(4, 30, (2, 16), generator=g)), _lm_loss, 0.3),
    "dinov2": (_hf("Dinov2Config", "Dinov2ForImageClassification", image_size=32, patch_size=8, hidden_size=64,
                   num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, num_labels=3, drop_path_rate=0.0),
               _images, _pixels_loss, 0.4),
    "olmoe": (_hf("OlmoeConfig", "OlmoeForCausalLM", num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, **LM),
              _tokens, _lm_loss, 0.3),
    "recurrent_gemma": (_hf("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", num_hidden_layers=3, vocab_size=VOCAB,
                            hidden_size=64, intermediate_size=128, num_attention_heads=4, lru_width=64,
                            attention_window_size=8, block_types=["recurrent", "attention"], head_dim=16,
                            num_key_value_heads=1), _tokens, _lm_loss, 0.6),
    "mpt": (_hf("MptConfig", "MptForCausalLM", d_model=64, n_heads=4, n_layers=3, vocab_size=VOCAB, max_seq_len=64),
            _tokens, _lm_loss, 0.3),
    "albert": (_hf("AlbertConfig", "AlbertForMaskedLM", vocab_size=VOCAB, embedding_size=32, hidden_size=64,
                   num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0), _tokens, _lm_loss, 1.0),
    "funnel": (_hf("FunnelConfig", "FunnelForMaskedLM", vocab_size=VOCAB, block_sizes=[1, 1], num_decoder_layers=1,
                   d_model=64, n_head=4, d_head=16, d_inner=128, hidden_dropout=0.0, attention_dropout=0.0,
                   activation_dropout=0.0), _unrelated_labels, _lm_loss, 0.4),
    "longformer": (_hf("LongformerConfig", "LongformerForMaskedLM", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128, attention_window=[4, 4], max_position_embeddings=80,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0), _tokens, _lm_loss, 0.3),
    "patchtst": (_hf("PatchTSTConfig", "PatchTSTForPrediction", num_input_channels=3, context_length=32, patch_length=8,
                     patch_stride=8, prediction_length=8, d_model=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64,
                     dropout=0.0, attention_dropout=0.0, ff_dropout=0.0, head_dropout=0.0, path_dropout=0.0,
                     positional_dropout=0.0, do_mask_input=False),
                 _patchtst_batch, lambda m, x, y: m(past_values=x, future_values=y).loss, 0.7),
    "zamba2": (_hf("Zamba2Config", "Zamba2ForCausalLM", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
                   layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8, mamba_headdim=16,
                   n_mamba_heads=8, num_attention_heads=4, num_key_value_heads=4, attention_head_dim=32,
                   intermediate_size=128, num_mem_blocks=1, use_shared_attention_adapter=False, use_mem_rope=False,
                   chunk_size=8, max_position_embeddings=64), _tokens, _lm_loss, 0.6),
}


def _step_of(loss_of, gradient_checkpointing: bool, autocast_in_step: bool = False):
    def make(model):
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(*batch):
            with torch.autocast("cpu", dtype=torch.bfloat16) if autocast_in_step else contextlib.nullcontext():
                loss = loss_of(model, *batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        step.optimizer = opt
        return step
    return make


def _megatrain_arithmetic(opt: torch.optim.Optimizer) -> None:
    """The eager side's AdamW step as megatrain's host kernel computes it (a correctly rounded
    sqrt, where MKL's is 1 ulp off for some elements): bf16 turns such ulps into lr-sized
    differences a step later, which would hide what the sweep looks for."""
    from megacompile.optimizer.host_step import fused_update  # lazy: megacompile's internals, eager side only
    from megacompile.runtime.host_adam import host_adam_available  # lazy: as above

    if host_adam_available():
        opt.step = lambda *args, **kwargs: fused_update(opt)


# What a user of the case sets after megatrain's warning: Reformer's reversible layers call
# backward(retain_graph=True) inside their own backward (capture/retained_graph.py).
CASE_OPTIONS = {"reformer": {"retain_graph": True}}


def run_case(name: str, precision: str, args) -> str:
    build, batch_of, loss_of, fraction = CASES[name]
    torch.manual_seed(0)
    model = build()
    model.train()
    reference = copy.deepcopy(model)
    if args.mark_layers:
        megacompile.mark_repeated_layers(model)  # the eager twin keeps plain layers
    budget = int(sum(p.numel() * 16 for p in model.parameters()) * (args.fraction or fraction))
    options = {"device": "cpu", "lowering": args.lowering, "memory_budget": budget, "precision": precision}
    if args.token_chunks:
        options["token_chunks"] = args.token_chunks
    if args.calls_before_backward > 1:
        options["calls_before_backward"] = args.calls_before_backward
    if args.overlap_optimizer:
        options["overlap_optimizer"] = True
    options.update(CASE_OPTIONS.get(name, {}))
    make = _step_of(loss_of, args.gradient_checkpointing and getattr(model, "supports_gradient_checkpointing", False),
                    args.autocast_in_step and precision == "bf16")
    started = time.perf_counter()
    if args.at_minimum:
        try:
            options["memory_budget"] = _smallest_budget(name, make, options, args.steps)
        except Exception as e:  # noqa: BLE001
            return f"{name:14s} {precision:5s} ERROR finding the smallest budget: {type(e).__name__}: " \
                   f"{str(e).splitlines()[0][:300]}"
    g = torch.Generator().manual_seed(1)
    records: list = []
    try:
        with warnings.catch_warnings(record=True) as caught, recording(into=records):
            warnings.simplefilter("always")
            compiled = torch.compile(make(model), backend="megatrain", options=options)
            eager = make(reference)
            _megatrain_arithmetic(eager.optimizer)
            worst = 0.0
            for _ in range(args.steps):
                batch = batch_of(g)
                got = compiled(*batch)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    want = eager(*batch)
                worst = max(worst, abs(got.item() - want.item()) / abs(want.item()))
    except Exception as e:  # noqa: BLE001  (the sweep reports every failure and goes on)
        return f"{name:14s} {precision:5s} ERROR{_eager_fails_too(name, precision)} {type(e).__name__}: " \
               f"{str(e).splitlines()[0][:300]}"
    finally:
        torch._dynamo.reset()
    params = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    report = megacompile.last_report()
    fallbacks = sorted({str(w.message)[:160] for w in caught if "megatrain" in str(w.message)})
    at = ""
    if args.at_minimum:
        measured = report.measured_peak_device_bytes  # None: Inductor's segments allocate out of the tracker's sight
        over = measured is not None and measured > options["memory_budget"]
        at = (f"  at {options['memory_budget']} B, peak "
              f"{'not measured' if measured is None else f'{measured} B'}{' OVER' if over else ''}")
    overlap = ""
    if args.overlap_optimizer and report is not None and report.optimizer is not None:
        o = report.optimizer
        landed = o.get("landed_in_weight_copies", 0)
        overlap = (f"  overlapped: {o['updated_params']} params, {o.get('left_to_step', 0)} left to step()"
                   + (f", {landed} gradients landed in their bf16 copies" if landed else "")
                   if o["overlapped"] else f"  not overlapped: {o['reason'][:80]}")
    return (f"{name:14s} {precision:5s} loss {worst:8.1e}  params {params:8.1e}  "
            f"{time.perf_counter() - started:5.1f} s{at}{overlap}  plan: {report.policy if report else '-'}"
            + (" (template planner)" if any(r.plan is not None and r.plan.template for r in records) else "")
            + (f"  WARNING {fallbacks}" if fallbacks else ""))


TRIES = 12


def _smallest_budget(name: str, make, options: dict, steps: int) -> int:
    """The smallest budget the planner accepts for the case's ``steps`` steps, from
    ``BudgetError.minimum_budget`` (a step of several graphs may need a few tries: each graph
    states its own minimum; where one graph runs several times before its backward, each try
    names what the calls so far need, and the plan at that budget keeps more: DBRX finds none in
    12 tries unless the planner is told the calls, --calls-before-backward 8; and its routing
    sends other token counts to each expert in each step: every step is tried)."""
    build, batch_of, _, _ = CASES[name]
    budget = 1
    for _ in range(TRIES):
        torch.manual_seed(0)
        probe = build().train()
        g = torch.Generator().manual_seed(1)
        try:
            step = torch.compile(make(probe), backend="megatrain", options={**options, "memory_budget": budget})
            for _ in range(steps):
                step(*batch_of(g))
            return budget
        except megacompile.BudgetError as e:
            budget = max(budget + 1, e.minimum_budget)
        finally:
            torch._dynamo.reset()
    raise RuntimeError(f"no budget found in {TRIES} tries (last {budget})")


def _eager_fails_too(name: str, precision: str) -> str:
    """" (eager too)" where the model's own step fails eagerly on the first batch (a model bug)."""
    build, batch_of, loss_of, _ = CASES[name]
    torch.manual_seed(0)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss_of(build().train(), *batch_of(torch.Generator().manual_seed(1))).backward()
    except Exception:  # noqa: BLE001
        return " (eager too)"
    return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated (default: all)")
    p.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    p.add_argument("--lowering", choices=["eager", "inductor"], default="eager")
    p.add_argument("--token-chunks", type=int, default=None, help="every layer's per-token runs in N chunks")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="the Hugging Face models that support it: their own activation checkpointing")
    p.add_argument("--autocast-in-step", action="store_true",
                   help="bf16: the step opens its own torch.autocast region (Dynamo traces the model under it)")
    p.add_argument("--calls-before-backward", type=int, default=1,
                   help="option calls_before_backward (DBRX: its per-expert graph runs 8 times before the backward)")
    p.add_argument("--overlap-optimizer", action="store_true",
                   help="option overlap_optimizer=True: the host AdamW updates each layer as its gradients land")
    p.add_argument("--layers", type=int, default=None,
                   help="depth of the cases whose config sets num_hidden_layers (the Hugging Face LMs)")
    p.add_argument("--mark-layers", action="store_true",
                   help="megacompile.mark_repeated_layers(model) first (from 8 chained layers: the template planner)")
    p.add_argument("--fraction", type=float, default=None,
                   help="budget as this fraction of the training state (16 B/param) for every case, not the case's own")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--at-minimum", action="store_true",
                   help="train at the smallest budget the planner accepts (from BudgetError), not at the case's fraction")
    args = p.parse_args()
    global LAYERS
    LAYERS = args.layers
    print(f"# {' '.join(sys.argv)}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {platform.processor() or platform.machine()}  "
          f"torch {torch.__version__}; loss: largest |megatrain - eager| / eager over {args.steps} steps; "
          f"params: largest absolute difference after them")
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    for name in args.cases.split(","):
        for precision in precisions:
            print(run_case(name, precision, args), flush=True)


if __name__ == "__main__":
    main()
