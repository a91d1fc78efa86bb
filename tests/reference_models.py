"""The reference models of the golden-graph and parity tests.

Small enough for a 2-core CPU, shaped like the real thing: an MLP, a GPT written here, and a
Llama from Hugging Face transformers built from a config with random weights (no hub access).
Parameters are large compared with activations, so a budget of 25% of the training state
forces streaming (and, for the deeper ones, recompute).
"""
from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6, out: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        # No qkv bias: the key bias has a mathematically zero gradient (softmax ignores a
        # shift shared by all keys), so Adam would turn rounding noise into lr-sized updates
        # and no two correct implementations would agree to 1e-5.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 96, dim: int = 64, heads: int = 4, layers: int = 3, context: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tiny_llama(layers: int = 6, vocab: int = 96):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=172, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, attn_implementation="eager", tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


class LlamaLogits(nn.Module):
    """Wraps the HF model so every reference model maps a tensor to a tensor."""

    def __init__(self, layers: int = 6, vocab: int = 96) -> None:
        super().__init__()
        self.model = tiny_llama(layers, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


def training_state_bytes(model: nn.Module, optimizer_states: int = 2) -> int:
    """Parameters + gradients + optimizer states (AdamW: 2) in bytes."""
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return param_bytes * (2 + optimizer_states)


# name -> (constructor, batch maker, loss)
def _regression_batch(gen: torch.Generator):
    return torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)


def _token_batch(gen: torch.Generator, vocab: int = 96, batch: int = 2, seq: int = 16):
    x = torch.randint(0, vocab, (batch, seq), generator=gen)
    y = torch.randint(0, vocab, (batch, seq), generator=gen)
    return x, y


def _mse(out, y):
    return F.mse_loss(out, y)


def _xent(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


REFERENCE_MODELS = {
    "mlp": (MLP, _regression_batch, _mse),
    "gpt": (GPT, _token_batch, _xent),
    "llama": (LlamaLogits, _token_batch, _xent),
}


def make_training_step(model: nn.Module, loss_fn, lr: float = 1e-3, weight_decay: float = 0.01,
                       autocast: str | None = None):
    """``step(x, y)``: AdamW after the backward. ``autocast``: the forward and loss inside the
    step's own ``torch.autocast(autocast, dtype=torch.bfloat16)`` region (a GPU loop's)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def step(x, y):
        with torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step, opt


def labels_training_step(model: nn.Module, lr: float = 1e-3, wrap_optimizer=None, eps: float = 1e-8):
    """``step(x)`` for a Hugging Face causal LM trained from ``labels=x`` (its own shifted
    cross entropy: the loss graph users get from ``transformers``), AdamW (passed through
    ``wrap_optimizer`` if given, e.g. to give an eager reference megatrain's arithmetic)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
    if wrap_optimizer is not None:
        wrap_optimizer(opt)

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def train_side_by_side(model: nn.Module, step_of, batches, options: dict, autocast: bool = False):
    """Trains ``model`` compiled with megatrain (CPU stand-in, eager lowering, plus ``options``)
    and a deep copy eagerly (under bf16 autocast if ``autocast``), ``step_of(m)`` making each
    one's step, on the same batches. Returns ([(compiled loss, eager loss), ...], the copy)."""
    reference = copy.deepcopy(model)
    compiled = torch.compile(step_of(model), backend="megatrain",
                             options={"device": "cpu", "lowering": "eager", **options})
    eager = step_of(reference)
    pairs = []
    for batch in batches:
        got = compiled(*batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            pairs.append((got, eager(*batch)))
    return pairs, reference
