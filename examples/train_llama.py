"""Train a small Llama-style model on Hamlet with the megatrain torch.compile backend.

The training step is an ordinary PyTorch function (forward, loss, backward, optimizer step);
`torch.compile(step, backend="megatrain")` turns it into a program that keeps parameters,
gradients and AdamW state on the host and streams layers through the device under a memory
budget. The model is a randomly initialised `transformers.LlamaForCausalLM` with a
character-level vocabulary built from the text, so nothing is downloaded.

    python examples/train_llama.py                    # megatrain backend (the default)
    python examples/train_llama.py --backend eager    # plain PyTorch, for comparison
    python examples/train_llama.py --backend aot_eager  # any other torch.compile backend

At the end it prints the first and last loss, megacompile's report of what the last step
planned and did, and a short greedy sample from the trained model.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hamlet.txt")


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="training steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence (default: %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    p.add_argument("--intermediate", type=int, default=None,
                   help="MLP size (default: about 8/3 * hidden, rounded up to a multiple of 8)")
    p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                   help="transformers attention implementation (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--device", default="cuda" if cuda else "cpu",
                   help="device the step computes on (default: %(default)s)")
    p.add_argument("--lowering", choices=["eager", "inductor"], default=None,
                   help="how megatrain compiles compute regions (default: inductor on cuda, eager on cpu)")
    p.add_argument("--budget", default=None,
                   help="device memory budget for megatrain, bytes or e.g. '64MiB' "
                        "(default: 25%% of params + grads + AdamW states)")
    p.add_argument("--backend", default="megatrain",
                   help="torch.compile backend; 'eager' runs the step without torch.compile "
                        "(default: %(default)s)")
    p.add_argument("--text", default=DEFAULT_TEXT, help="training text (default: examples/data/hamlet.txt)")
    p.add_argument("--sample-len", type=int, default=80, help="characters to generate at the end")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.lowering is None:
        args.lowering = "inductor" if str(args.device).startswith("cuda") else "eager"
    if args.intermediate is None:
        args.intermediate = 8 * math.ceil(args.hidden * 8 / 3 / 8)
    return args


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'123', '64MiB', '1.5 GB' -> bytes."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):] or "b"
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"unknown unit in budget {text!r}; use one of {sorted(_UNITS)}")
    return int(float(num) * _UNITS[unit])


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


class CharTokenizer:
    """Vocabulary = the distinct characters of the text, in sorted order."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self):
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in s], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


@torch.no_grad()
def greedy_sample(model, tok, prompt: str, length: int, context: int) -> str:
    """Greedy decoding in eager mode, re-running the full window each step (no KV cache)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = tok.encode(prompt).tolist()
    for _ in range(length):
        window = torch.tensor([ids[-context:]], device=device)
        logits = model(input_ids=window).logits
        ids.append(int(logits[0, -1].argmax()))
    model.train(was_training)
    return tok.decode(ids)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)

    megacompile = None
    if args.backend == "megatrain":
        try:
            import megacompile  # registers nothing new (the entry point does); needed for the report
        except ImportError as e:
            sys.exit(f"--backend megatrain needs the megacompile package ({e}); "
                     f"install it with `pip install -e .`, or run with --backend eager")

    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    tok = CharTokenizer(text)
    data = tok.encode(text)

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
        use_cache=False,
        tie_word_embeddings=False,
        # One scaled_dot_product_attention op per layer; the forward traces with Dynamo in one
        # graph (no breaks inside transformers), and "eager" attention does too.
        attn_implementation=args.attn,
    )
    model = LlamaForCausalLM(config)

    # megatrain keeps the model (and so its grads and optimizer state) in host memory and
    # streams it through `--device` itself; the other backends compute where the model lives.
    model_device = "cpu" if args.backend == "megatrain" else args.device
    model.to(model_device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes = 4 * param_bytes  # params + grads + AdamW exp_avg + exp_avg_sq, all fp32
    budget = parse_bytes(args.budget) if args.budget is not None else state_bytes // 4

    print(f"text: {os.path.relpath(args.text)} ({len(text):,} chars, vocab {len(tok)})")
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"MLP {args.intermediate}: {n_params:,} params, fp32")
    print(f"training state (params + grads + 2 AdamW states): {fmt_bytes(state_bytes)}")
    if args.backend == "megatrain":
        print(f"megatrain: device {args.device}, memory budget {fmt_bytes(budget)} "
              f"({budget / state_bytes:.0%} of the training state), lowering {args.lowering}")
    else:
        print(f"backend: {args.backend} on {args.device}")

    def step(x, y):
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    if args.backend == "megatrain":
        step = torch.compile(step, backend="megatrain", options={
            "device": args.device, "memory_budget": budget, "lowering": args.lowering})
    elif args.backend != "eager":
        step = torch.compile(step, backend=args.backend)

    gen = torch.Generator().manual_seed(args.seed)

    def batch():
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,), generator=gen)
        chunk = torch.stack([data[s:s + args.seq_len + 1] for s in starts.tolist()])
        return chunk[:, :-1].to(model_device), chunk[:, 1:].to(model_device)

    losses, times = [], []
    if args.backend != "eager":
        # The first step compiles (and, on first use, builds megatrain's host AdamW kernel).
        hint = "; TORCH_LOGS=megatrain shows each phase and the plan" if args.backend == "megatrain" else ""
        print(f"compiling the training step with {args.backend} (in the first step{hint})...", flush=True)
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True)
    for _ in bar:
        x, y = batch()
        t0 = time.perf_counter()
        loss = step(x, y).item()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.3f}")
    bar.close()

    print(f"\nloss: first {losses[0]:.4f}, last {losses[-1]:.4f} "
          f"(uniform over the vocabulary would be {math.log(len(tok)):.4f})")
    if len(times) > 1:
        rest = times[1:]
        print(f"time: first step {times[0]:.2f} s (includes compiling), "
              f"then {sum(rest) / len(rest) * 1000:.1f} ms/step")

    if megacompile is not None:
        print("\n" + str(megacompile.last_report()))

    prompt = "Ham.\n"
    sample = greedy_sample(model, tok, prompt, args.sample_len, args.seq_len)
    rule = "-" * 60
    print(f"\nsample ({args.sample_len} characters, greedy, eager mode, prompt {prompt!r}):\n"
          f"{rule}\n{sample}\n{rule}")


if __name__ == "__main__":
    main()
