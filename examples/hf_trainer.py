"""Fine-tune a Hugging Face causal LM with `transformers.Trainer` through megatrain.

The Trainer runs its usual loop (data loading, loss scaling for gradient accumulation,
`loss.backward()`, gradient clipping, `optimizer.step()`, the LR scheduler); megatrain compiles
the model's forward and loss (`model.compile(backend="megatrain")`), so its backward streams
through the device too, while the parameters, their gradients and the AdamW state stay in host
memory. From the Trainer's side everything is on the host: it is built with
`TrainingArguments(use_cpu=True)`, so it neither moves the model (nor does accelerate) nor the
batches, and the loss comes back to the host; megatrain's own `device` option is where the
step computes (`"cuda"`, or `"cpu"` for the CPU stand-in). The Trainer's AdamW step runs as
megatrain's fused host kernel (megatrain finds the optimizer behind accelerate's wrapper when
the model's graph compiles); gradient clipping and accumulation work on the host gradients.
Leave `TrainingArguments.torch_compile` off: accelerate's dynamo plugin accepts only the
backends it lists, and it could not pass megatrain's options.

    python examples/hf_trainer.py                          # a small Llama on Hamlet, megatrain
    python examples/hf_trainer.py --device cpu             # the CPU stand-in device
    python examples/hf_trainer.py --backend none           # the same run with a plain Trainer
    python examples/hf_trainer.py --model PATH --text FILE  # a pretrained model and its tokenizer

Without `--model`, the model is a randomly initialised `LlamaForCausalLM` over a character
vocabulary built from the text, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import torch
from transformers import Trainer, TrainingArguments

DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hamlet.txt")


class MegatrainTrainer(Trainer):
    """A `Trainer` over a model compiled with the megatrain backend and kept in host memory.

    ``args`` must keep the Trainer on the host (``TrainingArguments(use_cpu=True)``);
    ``megatrain_options`` are the backend's options (``device``: default ``"cuda"`` where
    available; ``memory_budget``, ``lowering``, ...: see the README).
    """

    def __init__(self, model: torch.nn.Module, args: TrainingArguments, megatrain_options: dict | None = None,
                 **kwargs) -> None:
        if args.device.type != "cpu":
            raise ValueError(f"the Trainer would move the model and the batches to {args.device}; megatrain keeps the "
                             f"model in host memory and streams it to its own device: build the arguments with "
                             f"TrainingArguments(..., use_cpu=True) and pass megatrain_options={{'device': "
                             f"'{args.device.type}'}}")
        if args.torch_compile:
            raise ValueError("leave TrainingArguments.torch_compile off: MegatrainTrainer compiles the model with "
                             "the megatrain backend itself (accelerate's dynamo plugin knows no such backend)")
        for name, p in model.named_parameters():
            if p.device.type != "cpu":
                raise ValueError(f"parameter {name!r} is on {p.device}; megatrain keeps the model in host memory "
                                 f"and streams it to the device itself: do not move the model (remove model.to(...))")
        options = dict(megatrain_options or {})
        options.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        model.compile(backend="megatrain", options=options)
        super().__init__(model=model, args=args, **kwargs)


# --- the command-line example -----------------------------------------------------------
class CharTokenizer:
    """Vocabulary = the distinct characters of the text, in sorted order."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        return [self.index[c] for c in s]


class TokenWindows(torch.utils.data.Dataset):
    """Fixed-length windows of a token stream; each is its own causal LM target."""

    def __init__(self, ids: list[int], seq_len: int, count: int, seed: int) -> None:
        if len(ids) <= seq_len:
            raise ValueError(f"the text has {len(ids)} tokens, fewer than --seq-len {seq_len} + 1")
        gen = torch.Generator().manual_seed(seed)
        data = torch.tensor(ids, dtype=torch.long)
        starts = torch.randint(0, len(ids) - seq_len, (count,), generator=gen)
        self.windows = [data[s:s + seq_len] for s in starts.tolist()]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="a pretrained causal LM (hub name or local path) loaded with its tokenizer; default: a "
                        "randomly initialised Llama over the text's characters")
    p.add_argument("--text", default=DEFAULT_TEXT, help="training text (default: examples/data/hamlet.txt)")
    p.add_argument("--backend", choices=["megatrain", "none"], default="megatrain",
                   help="'none' trains with a plain Trainer on --device, for comparison (default: %(default)s)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu",
                   help="where the step computes (default: %(default)s)")
    p.add_argument("--budget", default=None,
                   help="megatrain's device memory budget, e.g. '64MiB' (default: the whole device)")
    p.add_argument("--lowering", choices=["eager", "inductor"], default=None,
                   help="how megatrain compiles compute (default: inductor on cuda, eager on cpu)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch (default: %(default)s)")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=5, help="linear LR warmup (default: %(default)s)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (default: %(default)s)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="the Trainer's activation checkpointing (under megatrain its plan decides the recompute)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the default model (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size of the default model (default: %(default)s)")
    p.add_argument("--output-dir", default=None, help="Trainer output directory (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.lowering is None:
        args.lowering = "inductor" if args.device == "cuda" else "eager"
    if args.device == "cuda" and not cuda:
        p.error("--device cuda: no CUDA device here; use --device cpu")
    return args


def build_model_and_data(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    torch.manual_seed(args.seed)
    if args.model is None:
        tok = CharTokenizer(text)
        ids = tok.encode(text)
        config = LlamaConfig(
            vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=8 * math.ceil(args.hidden / 3),
            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=args.seq_len, use_cache=False, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        ids = tokenizer(text)["input_ids"]
        model = AutoModelForCausalLM.from_pretrained(args.model).float()  # fp32 training state
        model.config.use_cache = False
    count = args.steps * args.batch * args.grad_accum
    return model, TokenWindows(ids, args.seq_len, count, args.seed)


def training_arguments(args, megatrain: bool) -> TrainingArguments:
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="hf_trainer_")
    return TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, warmup_steps=args.warmup_steps,
        max_grad_norm=args.max_grad_norm, weight_decay=0.0, lr_scheduler_type="linear",
        gradient_checkpointing=args.gradient_checkpointing,
        # megatrain: the Trainer's tensors stay on the host; plain: the Trainer computes on --device.
        use_cpu=megatrain or args.device == "cpu",
        seed=args.seed, logging_steps=max(1, args.steps // 10), save_strategy="no", report_to=[],
        dataloader_num_workers=0)


def main(argv=None):
    args = parse_args(argv)
    model, dataset = build_model_and_data(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {type(model).__name__}, {n_params:,} parameters, fp32; {len(dataset)} sequences of {args.seq_len}")
    if args.backend == "megatrain":
        try:
            import megacompile
        except ImportError as e:
            sys.exit(f"--backend megatrain needs the megacompile package ({e}): pip install -e .")
        options = {"device": args.device, "lowering": args.lowering}
        if args.budget is not None:
            options["memory_budget"] = args.budget
        print(f"megatrain: {options}; the first step compiles (TORCH_LOGS=megatrain shows the plan)", flush=True)
        trainer = MegatrainTrainer(model, training_arguments(args, megatrain=True), options, train_dataset=dataset)
    else:
        trainer = Trainer(model=model, args=training_arguments(args, megatrain=False), train_dataset=dataset)
    result = trainer.train()
    print(f"trained {result.global_step} steps, mean loss {result.training_loss:.4f}")
    if args.backend == "megatrain":
        print(megacompile.last_report())


if __name__ == "__main__":
    main()
