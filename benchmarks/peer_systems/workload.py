"""The one workload every system in benchmarks/peers.py trains, built the same way in each process.

A Hugging Face Llama from a config (no hub), fp32 weights drawn on all host cores from a fixed
seed, and the same token batches; the loss is the model's own (``labels=input_ids``). A system
module (one per system beside this file) defines ``train(workload) -> dict`` with
``step_times`` (seconds, one per step, each ending when the loss reached the host),
``losses`` (one float per step) and ``notes`` (a string: what it ran, options that matter);
it may raise, and the driver records the error.
"""
from __future__ import annotations

import dataclasses
import os

import torch

# Where the systems train: "cuda" for the benchmark; "cpu" only to try the driver on a machine
# without a GPU (megatrain's CPU stand-in; the other systems need CUDA).
DEVICE = os.environ.get("PEERS_DEVICE", "cuda")


@dataclasses.dataclass(frozen=True)
class Workload:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    batch: int
    steps: int
    lr: float
    budget_bytes: int
    seed: int = 0
    hardware: str | None = None  # megatrain's cost-model profile (name or calibrate JSON)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq

    def llama_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, max_position_embeddings=max(self.seq, 128),
            use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False,
        )

    def build_model(self):
        """fp32 on the host, Hugging Face's init, the same weights in every process
        (``parallel_initialized_llama``)."""
        return parallel_initialized_llama(self.llama_config(), self.seed)

    def batches(self) -> list[torch.Tensor]:
        """``steps`` batches of token ids [batch, seq] on the host (labels are the ids)."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        return [torch.randint(0, self.vocab, (self.batch, self.seq), generator=gen) for _ in range(self.steps)]

    def num_params(self) -> int:
        h, i, v, n = self.hidden, self.intermediate, self.vocab, self.layers
        kv = h * self.kv_heads // self.heads
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
        return n * per_layer + 2 * v * h + h

    def flops_6nt(self) -> float:
        """MegaTrain's count: 6 x parameters x tokens per step."""
        return 6.0 * self.num_params() * self.tokens_per_step

    def flops_with_attention(self) -> float:
        """6 N T without the embedding lookup, plus causal attention (QK^T and PV, forward and
        backward: 3 x 2 x 2 x b s^2 h per layer, halved for the causal mask)."""
        n = self.num_params() - self.vocab * self.hidden
        attention = 6 * 2 * self.layers * self.batch * self.seq * self.seq * self.hidden / 2
        return 6.0 * n * self.tokens_per_step + attention


def parallel_initialized_llama(config, seed: int = 0):
    """A Llama with Hugging Face's initialization (normal(0, initializer_range) for linear and
    embedding weights, ones for the norms), each tensor drawn from its own seeded generator on
    a pool of threads: transformers draws one tensor at a time on one core, minutes for
    billions of parameters. Built on the meta device, given host storage, then filled; the
    non-persistent buffers (the rotary frequencies) come from a one-layer model built normally."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    small = LlamaForCausalLM(type(config)(**{**config.to_dict(), "num_hidden_layers": 1}))
    small_buffers = dict(small.named_buffers())
    for name, buf in model.named_buffers():
        buf.copy_(small_buffers[name])

    def fill(item):
        index, (name, param) = item
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                gen = torch.Generator().manual_seed(seed * 100_003 + index)
                param.normal_(0.0, config.initializer_range, generator=gen)

    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:  # normal_ releases the GIL
        list(pool.map(fill, enumerate(model.named_parameters())))
    return model


def timed_steps(step, batches) -> tuple[list[float], list[float]]:
    """Run ``step(x)`` on each batch; a step ends when its loss reached the host as a float."""
    import time

    losses, times = [], []
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    for x in batches:
        sync()
        start = time.perf_counter()
        loss = float(step(x))
        sync()
        times.append(time.perf_counter() - start)
        losses.append(loss)
    return times, losses


def labels_step(model, opt, autocast: bool = False):
    """``step(x)``: the batch to the GPU, the model's own loss from ``labels=x`` (under bf16
    autocast if asked), backward, optimizer step, gradients dropped."""
    def step(x):
        x = x.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def single_rank_process_group(backend: str = "nccl") -> None:
    """A world of one, as ``torchrun --nproc-per-node 1`` would set it up."""
    import torch.distributed as dist

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=0, world_size=1)
