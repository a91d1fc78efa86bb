"""Train a Llama at long context under megatrain and record what the plan said against what ran.

Usage:  python benchmarks/long_context.py [--device cuda] [--layers 32 --hidden 4096
            --intermediate 11008 --heads 32 --kv-heads 32 --vocab 32000] [--seq 131072]
            [--budget 60GiB] [--steps 3] [--precision bf16] [--head-chunk-tokens N] [--compare-unfused]
            [--mark-layers] [--compare-mask-kept] [--out FILE]

One Hugging Face Llama (sdpa attention, labels=input_ids: the model's own shifted loss),
batch 1, AdamW on the host, the step compiled with ``backend="megatrain"``. For each variant
(the fused LM head, and with ``--compare-unfused`` the head left unfused, side by side in one
run) it prints the plan, the planned and measured device peak (and the allocator's reserved
peak on CUDA), the step time (median after the first step, which compiles), losses, whether
the causal mask was elided, and how many layers were token-chunked. A variant whose plan does
not fit the budget is listed with the BudgetError's message, not dropped. ``--mark-layers``
marks the decoder layers (``megacompile.mark_repeated_layers``: one traced body, the mask an
input of it); ``--compare-mask-kept`` also trains with ``elide_causal_mask`` switched off, the
mask built and read as the model wrote it.
The defaults are Llama-2-7B's shape at 128k tokens (issue 19's H100 run); on the CPU stand-in
use a small shape, e.g. ``--device cpu --layers 2 --hidden 128 --intermediate 344 --heads 4
--kv-heads 4 --vocab 2048 --seq 8192 --budget 256MiB --head-chunk-tokens 1024`` (eager lowering
there, so the peak is measured).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

import torch  # noqa: E402
from _machine import cpu_model  # noqa: E402
from reference_models import labels_training_step  # noqa: E402


def _parse_bytes(text: str) -> int:
    from megacompile.core.units import parse_bytes

    return parse_bytes(text)


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def _decisions(records) -> dict:
    """From the training graph's programs: attention masks elided or kept, chunked runs."""
    from megacompile.core import token_chunks
    from megacompile.core.node_info import has_info, info

    record = next(r for r in records if r.backward is not None)
    notes = [info(n).attention_mask for n in record.forward.graph.nodes
             if has_info(n) and getattr(info(n), "attention_mask", None)]
    chunked = [n for n in record.forward.graph.nodes if n.target is token_chunks.FORWARD]
    return {"attention_masks": sorted(set(notes)), "chunked_runs": len(chunked)}


def run_variant(args, fuse_head: bool, elide_mask: bool = True) -> dict:
    import megacompile
    from megacompile.capture.records import recording

    torch._dynamo.reset()
    model = _model(args)
    if args.mark_layers:
        megacompile.mark_repeated_layers(model)
    step = labels_training_step(model, lr=1e-4)

    # The CPU stand-in measures its device peak only under the eager lowering.
    options = {"device": args.device, "precision": args.precision, "memory_budget": _parse_bytes(args.budget),
               "lowering": "eager" if args.device == "cpu" else "inductor"}
    options["disable_passes"] = ([] if fuse_head else ["fuse_lm_head"]) + ([] if elide_mask else ["elide_causal_mask"])
    if fuse_head and args.head_chunk_tokens != "auto":
        options["head_chunk_tokens"] = int(args.head_chunk_tokens)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (1, args.seq), generator=gen) for _ in range(args.steps)]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    records: list = []
    variant = ("fused head" if fuse_head else "unfused head") + ("" if elide_mask else ", mask kept (pass off)")
    result: dict = {"variant": variant, "error": None}
    try:
        with recording(into=records):
            compiled = torch.compile(step, backend="megatrain", options=options)
            times, losses = [], []
            for x in batches:
                sync()
                start = time.perf_counter()
                losses.append(float(compiled(x)))
                sync()
                times.append(time.perf_counter() - start)
    except megacompile.BudgetError as e:
        result["error"] = str(e).splitlines()[0]
        return result
    report = megacompile.last_report()
    result.update(
        plan=report.policy, budget=report.memory_budget, planned_peak=report.planned_peak_device_bytes,
        measured_peak=report.measured_peak_device_bytes, reserved_peak=report.measured_reserved_device_bytes,
        step_s=statistics.median(times[1:]) if len(times) > 1 else times[0], first_step_s=times[0],
        losses=losses, offload_arena_bytes=report.offload_arena_bytes, **_decisions(records))
    return result


def _table(args, results: list[dict]) -> str:
    from megacompile.core.units import format_bytes

    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU stand-in ({cpu_model()})"
    lines = [
        f"# benchmarks/long_context.py, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {device}, "
        f"torch {torch.__version__}",
        f"# command: python benchmarks/long_context.py {' '.join(sys.argv[1:])}",
        f"# Llama: {args.layers} layers, hidden {args.hidden}, MLP {args.intermediate}, {args.heads} heads "
        f"({args.kv_heads} kv), vocab {args.vocab}; batch 1 x {args.seq:,} tokens; {args.precision}; "
        f"budget {args.budget}; {args.steps} steps (step time: median after the first)"
        + ("; decoder layers marked (mark_repeated_layers)" if args.mark_layers else ""),
    ]
    for r in results:
        lines.append("")
        lines.append(f"## {r['variant']}")
        if r["error"]:
            lines.append(f"  does not fit: {r['error']}")
            continue
        measured = r["measured_peak"]
        ratio = f" ({measured / r['planned_peak']:.3f}x planned)" if measured else ""
        lines += [
            f"  plan             {r['plan']}",
            f"  device peak      planned {format_bytes(r['planned_peak'])}, measured "
            f"{format_bytes(measured) if measured else 'not measured'}{ratio}"
            + (f", reserved {format_bytes(r['reserved_peak'])}" if r["reserved_peak"] else ""),
            f"  step             {r['step_s']:.3f} s (first step, with compiling: {r['first_step_s']:.1f} s)",
            f"  losses           {', '.join(f'{v:.4f}' for v in r['losses'])}",
            f"  attention masks  {'; '.join(r['attention_masks']) or 'none recorded'}",
            f"  chunked runs     {r['chunked_runs']}; offload arenas {format_bytes(r['offload_arena_bytes'])}",
        ]
    fused = next((r for r in results if r["variant"] == "fused head" and not r["error"]), None)
    unfused = next((r for r in results if r["variant"] == "unfused head" and not r["error"]), None)
    if fused and unfused:
        lines += ["", f"fused / unfused step time: {fused['step_s'] / unfused['step_s']:.3f}x "
                      f"(peaks {format_bytes(fused['planned_peak'])} / {format_bytes(unfused['planned_peak'])})"]
    kept = next((r for r in results if r["variant"].endswith("mask kept (pass off)")), None)
    if fused and kept and not kept["error"]:
        lines += ["", f"mask elided / kept: planned peak {format_bytes(fused['planned_peak'])} / "
                      f"{format_bytes(kept['planned_peak'])}, step time {fused['step_s'] / kept['step_s']:.3f}x"]
    elif fused and kept:
        lines += ["", f"mask elided / kept: fits at {format_bytes(fused['planned_peak'])} / does not fit the budget"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--budget", default="60GiB")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--head-chunk-tokens", default="auto",
                   help="tokens per chunk of the fused head ('auto' leaves a head whose logits fit one chunk unfused)")
    p.add_argument("--compare-unfused", action="store_true", help="also train with the head unfused, in this run")
    p.add_argument("--mark-layers", action="store_true", help="mark the decoder layers (mark_repeated_layers)")
    p.add_argument("--compare-mask-kept", action="store_true",
                   help="also train with elide_causal_mask switched off (the mask built), in this run")
    p.add_argument("--out", help="write the table here (default: benchmarks/results/long_context-<date>-<device>.txt)")
    args = p.parse_args()
    results = [run_variant(args, fuse_head=True)]
    if args.compare_unfused:
        results.append(run_variant(args, fuse_head=False))
    if args.compare_mask_kept:
        results.append(run_variant(args, fuse_head=True, elide_mask=False))
    text = _table(args, results)
    print(text)
    name = torch.cuda.get_device_name().lower().replace(" ", "-") if args.device == "cuda" else \
        f"cpu-{os.cpu_count()}core"
    out = args.out or os.path.join(HERE, "results", f"long_context-{datetime.date.today()}-{name}.txt")
    with open(out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
