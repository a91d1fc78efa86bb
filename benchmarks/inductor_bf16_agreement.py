"""How far the Inductor lowering's bf16 numbers are from eager, next to plain torch.compile's.

Usage:  python benchmarks/inductor_bf16_agreement.py [--steps 3] [--no-save]

Three copies of one 3-layer Hugging Face Llama (hidden 64, random weights) train the same
batches with AdamW, the loss from ``labels``, under bf16 autocast with fp32 weights:
  eager     - eager PyTorch under torch.autocast("cpu", bfloat16)
  inductor  - plain torch.compile (Inductor) of the autocast forward + loss
  megatrain - torch.compile(step, backend="megatrain", lowering="inductor", precision="bf16")
and prints the largest parameter difference between each pair after the last step, and
each step's losses. Inductor computes fused bf16 pointwise chains in fp32 and rounds once,
where eager rounds after every op, so both compiled variants differ from eager by about the
same amount; megatrain against plain Inductor shows what the streaming adds on top.
Output: stdout, saved to benchmarks/results/inductor_bf16_agreement-<date>-<machine>.txt.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import transformers as T

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_model, write_result  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from reference_models import labels_training_step  # noqa: E402


def _model():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                                            max_position_embeddings=64, use_cache=False))


def _step(model, variant: str):

    def loss_under_autocast(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=x, labels=x).loss

    if variant == "megatrain":
        return torch.compile(labels_training_step(model), backend="megatrain",
                             options={"device": "cpu", "lowering": "inductor", "precision": "bf16"})
    forward = torch.compile(loss_under_autocast) if variant == "inductor" else loss_under_autocast
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x):
        loss = forward(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    variants = ("eager", "inductor", "megatrain")
    models = {v: _model() for v in variants}
    models = {v: (m if v == "eager" else copy.deepcopy(models["eager"])) for v, m in models.items()}
    steps = {v: _step(m, v) for v, m in models.items()}
    import datetime

    lines = [
        f"# inductor_bf16_agreement: {datetime.date.today()} on {cpu_model()} ({os.cpu_count()} cores), "
        f"torch {torch.__version__}",
        "3-layer HF Llama (hidden 64), batch 2 x seq 16, AdamW lr 1e-3, bf16 autocast with fp32 weights",
        f"{'step':>4} " + " ".join(f"{v + ' loss':>16}" for v in variants),
    ]
    gen = torch.Generator().manual_seed(1)
    for i in range(args.steps):
        x = torch.randint(0, 96, (2, 16), generator=gen)
        losses = [float(steps[v](x)) for v in variants]
        lines.append(f"{i:>4} " + " ".join(f"{loss:>16.8f}" for loss in losses))
        print(lines[-1], flush=True)

    def diff(a: str, b: str) -> float:
        return max((p - q).abs().max().item() for p, q in zip(models[a].parameters(), models[b].parameters()))

    lines += ["", f"largest parameter difference after {args.steps} steps:"]
    for a, b in (("inductor", "eager"), ("megatrain", "eager"), ("megatrain", "inductor")):
        lines.append(f"  {a:>9} vs {b:<9} {diff(a, b):.3e}")
    if args.no_save:
        print("\n".join(lines))
    else:
        print(write_result("\n".join(lines), "inductor_bf16_agreement-{date}-cpu-{cores}core.txt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
