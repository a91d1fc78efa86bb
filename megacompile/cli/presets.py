"""Model presets for `megacompile plan`, and an analytic parameter count.

A preset is the Hugging Face config.json of a public model (the fields that shape
the weights; tokenizer ids and the like are left out). `plan` can also take a path
to the config.json of any causal LM transformers can build. Parameters are counted from the
config alone, so planning a 72B or 120B model needs no weights and no memory: analytically
for llama, mistral, qwen2 and qwen3 (decoder-only, RMSNorm, gated SiLU MLP, RoPE, optional
GQA), and for any other architecture (Gemma, Mixtral, Phi-3, ...) from the model built on the
meta device, where parameters have shapes but no storage.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

# Values from each model's config.json on the Hugging Face Hub (base models).
# rms_norm_eps and max_position_embeddings do not affect parameter counts or memory.
_PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3-8B: 8.03B params.
    "llama-3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    },
    # Qwen/Qwen2.5-7B: 7.62B params. Qwen2 has biases on q/k/v (not on o_proj).
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
    # Qwen/Qwen2.5-14B: 14.7B params.
    "qwen2.5-14b": {
        "model_type": "qwen2",
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
    # Qwen/Qwen2.5-32B: 32.8B params.
    "qwen2.5-32b": {
        "model_type": "qwen2",
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
    # Qwen/Qwen2.5-72B: 72.7B params.
    "qwen2.5-72b": {
        "model_type": "qwen2",
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
    # Not a released model: a Llama-architecture dense model of 121.53B params, the
    # scale MegaTrain targets on one GPU. Hidden 12288 with 96 layers (GPT-3 175B's
    # width and depth), 96 heads of 128, GQA with 8 KV heads, MLP 2x hidden, Llama 3
    # vocabulary. Per layer: attention 327.2M + MLP 905.97M + norms = 1.2332B;
    # x96 = 118.38B, plus 2 x 1.576B for untied embeddings and lm_head = 121,534,427,136.
    "dense-120b": {
        "model_type": "llama",
        "hidden_size": 12288,
        "intermediate_size": 24576,
        "num_hidden_layers": 96,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    },
}

_SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def known_presets() -> list[str]:
    return list(_PRESETS)


def load_model_config(name_or_path: str) -> dict[str, Any]:
    """A preset by name, or the contents of a Hugging Face config.json by path.

    Returns a fresh dict the caller may modify.
    """
    if name_or_path in _PRESETS:
        return copy.deepcopy(_PRESETS[name_or_path])
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):  # a model directory: its config.json
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError(f"{path} does not look like a Hugging Face config.json (no 'model_type')")
        return config
    raise ValueError(
        f"unknown model preset {name_or_path!r} and no such file. Known presets: {', '.join(known_presets())}; "
        "a path to a Hugging Face config.json (or a directory holding one) is also accepted."
    )


def _require(config: dict[str, Any], key: str) -> int:
    if key not in config or config[key] is None:
        raise ValueError(f"model config lacks {key!r}, needed to count parameters")
    return int(config[key])


def count_parameters(config: dict[str, Any]) -> int:
    """Number of trainable parameters, computed from the config alone.

    Matches `sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())`,
    where a tied lm_head shares the embedding and so is counted once.
    """
    model_type = config.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        return _count_on_meta(config)
    hidden = _require(config, "hidden_size")
    intermediate = _require(config, "intermediate_size")
    layers = _require(config, "num_hidden_layers")
    heads = _require(config, "num_attention_heads")
    vocab = _require(config, "vocab_size")
    # Where a key is absent, transformers falls back to a per-family default. Llama's
    # are the natural ones (num_key_value_heads = heads, head_dim = hidden // heads),
    # but Mistral/Qwen2/Qwen3 default num_key_value_heads to a fixed number and Qwen3
    # defaults head_dim to 128. Real config.json files spell these keys out, so rather
    # than mirror one transformers version's defaults, insist on them there.
    if model_type != "llama":
        _require(config, "num_key_value_heads")
    if model_type == "qwen3":
        _require(config, "head_dim")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    q_width = heads * head_dim
    kv_width = kv_heads * head_dim

    # Which projections carry a bias differs by family: Qwen2 always biases q/k/v and
    # never o_proj; Llama's and Qwen3's `attention_bias` flag covers all four.
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    elif model_type in ("llama", "qwen3"):
        qkv_bias = o_bias = bool(config.get("attention_bias", False))
    else:  # mistral: no biases
        qkv_bias = o_bias = False
    mlp_bias = model_type == "llama" and bool(config.get("mlp_bias", False))

    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
    if qkv_bias:
        attention += q_width + 2 * kv_width
    if o_bias:
        attention += hidden
    if model_type == "qwen3":
        attention += 2 * head_dim  # RMSNorm over each head's q and k
    mlp = 3 * hidden * intermediate  # gate, up, down
    if mlp_bias:
        mlp += 2 * intermediate + hidden
    norms = 2 * hidden  # input_layernorm + post_attention_layernorm (weights only)
    per_layer = attention + mlp + norms

    embedding = vocab * hidden
    lm_head = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    final_norm = hidden
    return embedding + layers * per_layer + final_norm + lm_head


def _count_on_meta(config: dict[str, Any]) -> int:
    """The parameters of the causal LM transformers builds for ``config``, on the meta device
    (shapes, no storage; a tied lm_head counted once)."""
    import torch  # lazy: only this count needs it here
    from transformers import AutoModelForCausalLM  # lazy: an optional dependency (pip install ".[hf]")

    cfg = dict(config)
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) != cfg.get("num_hidden_layers"):
        cfg.pop("layer_types")  # sized by the full depth; a per-layer attention kind holds no weights
    hf = build_transformers_config(cfg)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
    except ValueError as e:
        raise ValueError(f"cannot count parameters of model_type {config.get('model_type')!r}: transformers "
                         f"builds no causal LM for it ({e})") from e
    return sum(p.numel() for p in model.parameters())


def build_transformers_config(config_dict: dict[str, Any]):
    """A transformers PretrainedConfig for the dict, built locally (no Hub access).

    transformers is imported here rather than at module level: it is a test/optional
    dependency and slow to import, and nothing else in this module needs it.
    """
    import transformers  # lazy: an optional dependency (pip install ".[hf]")

    rest = dict(config_dict)
    model_type = rest.pop("model_type", None)
    if not model_type:
        raise ValueError("model config lacks 'model_type'")
    # Keys that describe the file rather than the model; for_model rejects none of
    # them but they would be misleading on a freshly built config.
    for key in ("architectures", "transformers_version", "_name_or_path"):
        rest.pop(key, None)
    try:
        return transformers.AutoConfig.for_model(model_type, **rest)
    except ValueError as e:
        raise ValueError(f"transformers {transformers.__version__} cannot build a config for "
                         f"{model_type!r}: {e}") from e
