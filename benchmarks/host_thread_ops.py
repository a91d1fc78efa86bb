"""What the host thread runs per training step, with and without merge_compute_runs (issue 17).

Where the program copies between host and device (CUDA; on the CPU stand-in, with the
optimizer overlapped), every memory op ends the compiled segment before it, and the ops
between a weight's wait and its evict run one by one through Python dispatch. The pass
``merge_compute_runs`` gathers each layer's memory ops at the ends of its compute. Two copies
of one HF Llama (sdpa attention) train side by side from the same weights, under the Inductor
lowering, one with the pass and one with it switched off; the runtime trace of the steps
after the first counts the instructions the host thread ran (``op``: one aten op through
dispatch; ``segment``: one compiled segment; memory ops) and its busy time. On the CPU
stand-in the busy fraction means little (the stand-in computes on the host thread); the op
counts are what carries over to a GPU.

    python benchmarks/host_thread_ops.py [--device cpu] [--layers 4] [--hidden 256] [--seq 128]
        [--batch 2] [--budget-fraction 0.6] [--steps 3]
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _machine import cpu_model, write_result  # noqa: E402

import megacompile  # noqa: E402
from megacompile.capture.records import compiled_graphs  # noqa: E402


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64, max_position_embeddings=args.seq,
                         use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _run(model, args, merged: bool, batches, budget_fraction: float):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    options = {"device": args.device, "lowering": "inductor", "overlap_optimizer": True,
               "memory_budget": int(4 * param_bytes * budget_fraction),
               "disable_passes": [] if merged else ["merge_compute_runs"]}
    if args.hardware:
        options["hardware"] = args.hardware
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="megatrain", options=options)
    losses = [compiled(batches[0]).item()]
    with tempfile.TemporaryDirectory() as tmp, megacompile.trace_runtime(os.path.join(tmp, "t.json")) as recorder:
        losses += [compiled(x).item() for x in batches[1:]]
    summary = recorder.host_thread_summary()
    plans = [g.plan for g in compiled_graphs(compiled) if g.plan is not None and g.plan.policy != "inference"]
    return summary, losses, plans[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="traced steps after the first")
    p.add_argument("--budget-fractions", type=float, nargs="+", default=[1.0, 0.45],
                   help="memory_budget as these fractions of parameters + gradients + AdamW states, one run each")
    p.add_argument("--hardware", default=None, help="the cost model's profile (a built-in name or calibrate JSON)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    base = _model(args)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen) for _ in range(args.steps + 1)]
    lines = [
        f"host-thread instructions per step, merge_compute_runs on vs off  {datetime.datetime.now():%Y-%m-%d %H:%M}",
        f"machine: {cpu_model()}, {os.cpu_count()} cores; python {platform.python_version()}; torch {torch.__version__}"
        + (f"; gpu {torch.cuda.get_device_name()}" if args.device == "cuda" else ""),
        f"model: HF Llama, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, sdpa attention; "
        f"batch {args.batch} x {args.seq}; device {args.device}, Inductor lowering, optimizer overlapped "
        f"(programs copy); budget: a fraction of parameters + gradients + AdamW states",
        "command: python benchmarks/host_thread_ops.py " + " ".join(sys.argv[1:]),
    ]
    kinds = ("op", "segment", "load", "wait", "evict", "offload")
    for fraction in args.budget_fractions:
        rows = {merged: _run(copy.deepcopy(base), args, merged, batches, fraction) for merged in (True, False)}
        lines += ["", f"budget {fraction} x training state",
                  f"{'merge_compute_runs':<20}" + "".join(f"{k:>9}" for k in kinds) + f"{'busy %':>8}  plan"]
        for merged, (summary, _, plan) in rows.items():
            per_step = {k: summary["instructions"].get(k, 0) / args.steps for k in kinds}
            lines.append(f"{'on' if merged else 'off':<20}" + "".join(f"{per_step[k]:>9.0f}" for k in kinds)
                         + f"{100 * summary['busy_fraction']:>7.0f}%  {plan.policy}")
            lines.append(f"{'':<20}busy ms per step by kind: " + ", ".join(
                f"{k} {t * 1e3 / args.steps:.1f}" for k, t in sorted(summary["busy_s_by_kind"].items(),
                                                                     key=lambda kv: -kv[1])))
        ops = [rows[m][0]["instructions"].get("op", 0) / args.steps for m in (True, False)]
        same = all(a == b for a, b in zip(rows[True][1], rows[False][1]))
        lines += [f"ops run one by one per step: {ops[0]:.0f} with the pass, {ops[1]:.0f} without; "
                  f"losses {'equal' if same else 'DIFFER'}: {[round(v, 5) for v in rows[True][1]]}",
                  f"plan with the pass: {'merged' if rows[True][2].merged_compute_runs else 'not merged'}; "
                  f"{rows[True][2].reason.split('; ')[-1]}"]
    device = "cpu-{cores}core" if args.device == "cpu" else torch.cuda.get_device_name().lower().replace(" ", "-")
    write_result("\n".join(lines), "host_thread_ops-{date}-" + device + ".txt", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
