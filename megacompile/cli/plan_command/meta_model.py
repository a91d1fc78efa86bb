"""The model ``megacompile plan`` traces: a Hugging Face causal LM cut to k decoder layers on
the meta device, and an ordinary training step over it, bridged so that the meta trace is the
program megatrain compiles for host parameters (the attention op and the loss; see the
package docstring)."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from megacompile import backend
from megacompile.cli.presets import build_transformers_config
from megacompile.core.errors import PlacementError

ATTN_IMPLEMENTATION = "megatrain_host_sdpa"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _host_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Hugging Face's ``sdpa`` attention, except on meta tensors: there, the op the host trace has.

    On meta tensors ``F.scaled_dot_product_attention`` takes the math path (bmm + softmax:
    the attention matrix is saved for the backward, O(seq^2) bytes). Traced with parameters
    on the host, as megatrain traces a real step, it is
    ``_scaled_dot_product_flash_attention_for_cpu`` (O(seq) saved bytes: the output and the
    log-sum-exp), which is also what the cost model counts. This mirrors what the sdpa
    front end does on the CPU for a training step (no cache, no dropout): grouped KV heads
    repeated (Hugging Face's ``repeat_kv``), a boolean mask made additive, flash kernel.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward  # lazy: optional dependency

    if query.device.type != "meta":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal
    mask = attention_mask
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=mask.device))
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout, is_causal, attn_mask=mask, scale=scaling)[0]
    out = out.reshape(out.shape[0], -1, q_length, value.shape[-1]).transpose(1, 2).contiguous()
    return out, None


def _register_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface  # lazy: optional dependency
    from transformers.masking_utils import sdpa_mask  # lazy: optional dependency

    AttentionInterface.register(ATTN_IMPLEMENTATION, _host_sdpa)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def host_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), labels)`` (mean, ignore_index -100) in the ops the host
    trace decomposes it into; unlike ``F.cross_entropy`` it keeps its gradient on meta tensors."""

    flat = logits.reshape(-1, logits.size(-1)).float()
    return torch.ops.aten.nll_loss_forward(F.log_softmax(flat, -1), labels.reshape(-1), None, 1, -100)[0]


def build_model(config: dict, num_layers: int, precision: str = "fp32", device: str = "meta"):
    """The Hugging Face causal LM of ``config`` with ``num_layers`` decoder layers (on meta: no memory),
    its weights in ``precision``'s dtype. ``traced_model`` builds what megatrain trains instead."""
    from transformers import AutoModelForCausalLM  # lazy: optional dependency

    _register_attention()
    cfg = dict(config)
    cfg["num_hidden_layers"] = int(num_layers)
    cfg["use_cache"] = False
    cfg.pop("layer_types", None)  # sized by the full depth in some config.json files
    hf = build_transformers_config(cfg)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(hf, attn_implementation=ATTN_IMPLEMENTATION,
                                                     dtype=_DTYPES[precision])
        except ValueError as e:
            if "attention implementation" not in str(e):
                raise
            # A model whose attention sdpa cannot compute (Gemma 2's logit soft-capping): it trains
            # with its own eager attention, which saves the attention matrix (O(seq^2) bytes).
            model = AutoModelForCausalLM.from_config(hf, attn_implementation="eager", dtype=_DTYPES[precision])
    model.train()
    return model


# Where ``traced_model`` puts the model of each precision (see its docstring).
TRACED_DEVICE = {"fp32": "meta", "bf16": "cpu"}


def traced_model(config: dict, num_layers: int, precision: str):
    """The model ``megacompile plan`` traces for ``precision``, and the device of its inputs.

    fp32: on the meta device (nothing allocated). bf16 is fp32 master weights under autocast,
    as megatrain trains it, and autocast casts only tensors of a real device: on meta, the
    program would be an fp32 one, and a model built in bf16 is another program (no casts, bf16
    norms and loss inputs). So bf16 traces fp32 weights on the host, allocated but never written
    (``to_empty``: a 7B model's two traced layers cost page tables, not gigabytes).
    """
    device = TRACED_DEVICE[precision]
    if device == "cpu":
        model = build_model(config, num_layers, "fp32").to_empty(device="cpu")
        model.tie_weights()  # moving off meta gave a tied embedding and lm_head a tensor each
        return model, device
    return build_model(config, num_layers, precision), device


def make_step(model) -> Callable:
    """An ordinary training step: forward, cross-entropy, backward, AdamW step, zero_grad."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step(input_ids, labels):
        logits = model(input_ids=input_ids).logits
        loss = host_cross_entropy(logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


@contextlib.contextmanager
def _meta_placement():
    """Let meta parameters through megatrain's placement check while tracing.

    ``backend.check_placement`` requires parameters on the CPU (so that ``model.cuda()`` is
    caught) and rejects meta ones too. The core fix is one condition there
    (``value.device.type not in ("cpu", "meta")``); until it lands, meta tensors are filtered
    out before the original check runs. Nothing is patched if the check already accepts them.
    """

    original = backend.check_placement
    probe = torch.nn.Parameter(torch.empty(1, device="meta"))
    try:
        original([probe], ["probe"], ["param"])
        needs_patch = False
    except PlacementError:
        needs_patch = True
    if not needs_patch:
        yield
        return

    def check_placement(example_inputs, names, roles):
        rest = [(v, n, r) for v, n, r in zip(example_inputs, names, roles)
                if not (isinstance(v, torch.Tensor) and v.device.type == "meta")]
        return original([v for v, _, _ in rest], [n for _, n, _ in rest], [r for _, _, r in rest])

    backend.check_placement = check_placement
    try:
        yield
    finally:
        backend.check_placement = original
