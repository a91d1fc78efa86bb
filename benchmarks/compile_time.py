"""Compile + plan time against depth: a full-depth megatrain compile vs `megacompile plan`.

Usage:  python benchmarks/compile_time.py [--layers 8,16,32,64] [--seq-len 256] [--no-save] [--template-only]
                                         [--breakdown]

For each depth N of a small Llama config (the llama-3-8b preset scaled down: hidden 256,
MLP 688, 4 heads of 64, 2 KV heads, vocabulary 1024), on the meta device (nothing is
allocated; the numbers are compile and planning time only):

  (a) full compile: `torch.compile(step, backend="megatrain")` of the N-layer model, first call
      (Dynamo + AOTAutograd + passes + planner + lowering, then one step executed on meta
      tensors), and the second call alone (the step, no compiling). "compile" = first - second.
      Run twice: with no memory budget (the planner's first rung fits: one plan built) and
      with a budget of half the keep-everything peak (the planner builds and prices its
      whole candidate ladder, as it does for models that do not fit).
  (b) `plan_model`: traces k=2 layers (every policy, from one trace) and extrapolates to N,
      under the same two budgets.
  (c) the decoder layers marked with `torch.compiler.nested_compile_region` (by
      `megacompile.mark_repeated_layers`, which finds them), beside
      torch.compile's own capture of the same step (backend "eager": Dynamo alone;
      "aot_eager": Dynamo + AOTAutograd), marked and not: what megatrain adds to the capture
      every torch.compile backend pays, and how each grows per layer.
  (d) the Inductor lowering on real CPU tensors: segments compiled once and reused.
  (g) with --template-only: layers marked, a tight budget, plan_repeats='flat' vs 'template'
      (megacompile/plan/template_planner.py): compile time, the chosen plan's predicted step time
      and peak, the template's extrapolated peak, how often the full graph was built.
  (h) with --breakdown (default depths 16 and 64): a marked compile's time by part (Dynamo,
      AOTAutograd, the partition's inlining, passes, snapshots, extraction), beside variants
      that leave the cycle collector on, keep inspect's snapshots, trace the optimizer's step,
      or leave region calls unflattened, and beside torch.compile's own aot_eager backend on
      the same marked step (the capture every backend pays).

Output: a table on stdout, saved to benchmarks/results/compile_time-<date>-cpu-2core.txt.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
import time

import torch

import megacompile
from megacompile.capture import training_compiler as capture
from megacompile.capture.records import recording
from megacompile.cli import presets
from megacompile.cli.plan_command import (
    POLICIES,
    RESIDENT,
    full_depth,
    meta_model,
    planning,
    policy_capture,
    traced_layers,
)
from megacompile.plan.hardware import get_profile

# Every graph megatrain compiles in this run, oldest first (filled by records.recording).
COMPILED: list = []

HERE = os.path.dirname(os.path.abspath(__file__))


def _collect_earlier_garbage() -> None:
    """Collect what earlier compiles left before timing the next one. A compile leaves cyclic
    garbage (its fx graphs) that only a full collection frees; without this, that collection
    lands inside whatever is timed next (table (b) had plan times twice the others right after
    a large full compile)."""
    gc.collect()


def small_llama(layers: int) -> dict:
    cfg = presets.load_model_config("llama-3-8b")
    cfg.update(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=1024, num_hidden_layers=layers, max_position_embeddings=4096)
    return cfg


def _two_calls(model, seq_len: int, budget: int | None = None, backend: str = "megatrain",
               **options) -> tuple[float, float]:
    """(first call s, second call s) of the compiled training step of ``model`` on meta;
    ``options``: more megatrain options."""
    kwargs = {"backend": backend}
    if backend == "megatrain":
        kwargs["options"] = {"device": "cpu", "lowering": "eager", "hardware": "h200", **options}
        if budget is not None:
            kwargs["options"]["memory_budget"] = budget
    compiled = torch.compile(meta_model.make_step(model), **kwargs)
    x = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    _collect_earlier_garbage()
    with meta_model._meta_placement():
        t0 = time.perf_counter()
        compiled(x, x)
        t1 = time.perf_counter()
        compiled(x, x)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def compile_seconds(cfg: dict, seq_len: int, backend: str, marked: bool) -> float:
    """Compile seconds (first call - second call) of the step under ``backend`` (budget none),
    with the decoder layers marked or not."""
    policy_capture._reset_dynamo()
    COMPILED.clear()
    model = meta_model.build_model(cfg, cfg["num_hidden_layers"])
    if marked:
        assert len(megacompile.mark_repeated_layers(model)) == cfg["num_hidden_layers"]
    first, second = _two_calls(model, seq_len, backend=backend)
    policy_capture._reset_dynamo()
    return first - second


def full_compile(cfg: dict, seq_len: int, budget: int | None) -> tuple[float, float, str, int, dict | None]:
    """(first call s, second call s, the planner's plan, its peak, its decoder-layer counts as
    plan_model writes them or None) of a full-depth compile on meta."""
    policy_capture._reset_dynamo()
    COMPILED.clear()
    model = meta_model.build_model(cfg, cfg["num_hidden_layers"])
    first, second = _two_calls(model, seq_len, budget)
    record = next(r for r in COMPILED if r.plan is not None and r.plan.policy != "inference")
    policy_capture._reset_dynamo()
    plan = record.plan
    if plan.layer_policy:  # per-layer: count the decoder layers (glue listed apart when not kept)
        decoder = {k: v for k, v in plan.layer_policy.items() if ".layers." in k}
        glue = sorted({v for k, v in plan.layer_policy.items() if ".layers." not in k})
        counts = {p: sum(1 for v in decoder.values() if v == p) for p in ("keep", "offload", "recompute")}
        policy = "keep {keep}, offload {offload}, recompute {recompute}".format(**counts)
        policy += "" if glue == ["keep"] else f" (glue {'/'.join(glue)})"
        same = counts if glue == ["keep"] and not plan.resident else None
    else:
        policy = plan.policy
        n = cfg["num_hidden_layers"]
        uniform = plan.policy.split(" ")[0]
        same = {RESIDENT: n} if plan.resident else ({uniform: n} if uniform in POLICIES else None)
    return first, second, policy, plan.peak_bytes, same


def marked_tight(cfg: dict, seq_len: int, mode: str, budget: int | None) -> tuple[float, object]:
    """(compile s, the step's plan) of the full-depth step with its layers marked by
    mark_repeated_layers, under ``budget`` (None: no budget), planned with plan_repeats=``mode``."""
    policy_capture._reset_dynamo()
    COMPILED.clear()
    model = meta_model.build_model(cfg, cfg["num_hidden_layers"])
    assert len(megacompile.mark_repeated_layers(model)) == cfg["num_hidden_layers"]
    first, second = _two_calls(model, seq_len, budget, plan_repeats=mode)
    record = next(r for r in COMPILED if r.plan is not None and r.plan.policy != "inference")
    policy_capture._reset_dynamo()
    return first - second, record.plan


def template_table(depths: list[int], seq_len: int) -> list[str]:
    """(g) Layers marked, tight budget (half the keep-everything peak): the flat planner (every
    candidate built over all N layers) vs the template planner (candidates built on 3- and
    4-layer copies, one rung built over all N)."""
    lines = [
        "(g) layers marked by mark_repeated_layers, budget 'tight' (half the keep-everything peak): plan_repeats='flat'",
        "(every candidate built over the full graph) vs 'template' (megacompile/plan/template_planner.py: candidates built",
        "on 3- and 4-layer copies of the step and extrapolated; the chosen rung built over the full graph);",
        "compile s = first call - second call; pred ms = the cost model's step time of the chosen plan (h200 profile)",
        f"{'layers':>6} {'flat: compile s':>16} {'pred ms':>8} {'peak MiB':>9} | {'template: compile s':>20} "
        f"{'pred ms':>8} {'peak MiB':>9} {'extrapolated MiB':>17} {'full builds':>12} {'candidates':>11}  template plan",
    ]
    print("\n".join(lines), flush=True)
    rows = []
    for n in depths:
        cfg = small_llama(n)
        _, generous = marked_tight(cfg, seq_len, "flat", None)
        budget = generous.peak_bytes // 2
        flat_s, flat = marked_tight(cfg, seq_len, "flat", budget)
        tpl_s, tpl = marked_tight(cfg, seq_len, "template", budget)
        t = tpl.template or {}
        row = (f"{n:>6} {flat_s:>16.2f} {flat.predicted_seconds * 1e3:>8.3f} {flat.peak_bytes / 2**20:>9.2f} | "
               f"{tpl_s:>20.2f} {tpl.predicted_seconds * 1e3:>8.3f} {tpl.peak_bytes / 2**20:>9.2f} "
               f"{t.get('extrapolated_peak', float('nan')) / 2**20:>17.2f} {t.get('full_builds', '-'):>12} "
               f"{t.get('candidates', '-'):>11}  {tpl.policy}")
        rows.append((n, flat_s, tpl_s))
        print(row, flush=True)
        lines.append(row)
    if len(rows) > 1:
        span = rows[-1][0] - rows[0][0]
        row = (f"s/layer {(rows[-1][1] - rows[0][1]) / span:>15.3f} {'':>8} {'':>9} | "
               f"{(rows[-1][2] - rows[0][2]) / span:>20.3f}")
        print(row, flush=True)
        lines.append(row)
    return lines


# --- (h) where a marked compile's time goes, and what each capture saving is worth ---------------
_VARIANTS = {
    # name: (optimizer step traced by Dynamo, region call fingerprinted through pytree,
    #        per-pass snapshots kept as under `megacompile inspect`, cycle collector left on)
    "as shipped": (False, False, False, False),
    "collector on": (False, False, False, True),
    "snapshots kept (inspect)": (False, False, True, False),
    "optimizer step traced": (True, False, False, False),
    "call not flattened": (False, True, False, False),
    "all four off (main on 11-23 06:24)": (True, True, True, True),
}
_AOT_EAGER = "torch.compile aot_eager, same capture"


def _timed_compile(cfg: dict, seq_len: int, trace_step: bool, pytree_call: bool,
                   snapshots: bool, collector_on: bool) -> tuple[float, dict]:
    """(compile s, seconds by part) of the marked step (budget none). ``trace_step``: leave the
    optimizer's step to Dynamo (host_optimizer.take_step_out_of_trace switched off);
    ``pytree_call``: marked layers get the plain region call (repeats._flatten_call off);
    ``snapshots``: the option, as `megacompile inspect` sets it; ``collector_on``: Python's
    cycle collector runs while megatrain compiles (collector.cycle_collector_paused off)."""
    import contextlib
    from unittest import mock

    import megacompile.passes as passes
    from megacompile import backend
    from megacompile.capture import inline_regions
    from megacompile.capture import repeated_layers as repeats
    from megacompile.core import torch_compat as compat

    parts: dict[str, float] = {}

    def timing(owner, name, key):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                parts[key] = parts.get(key, 0.0) + time.perf_counter() - t0
        return mock.patch.object(owner, name, timed)

    with contextlib.ExitStack() as stack:
        for owner, name, key in ((compat, "aot_module_simplified", "aot"), (capture.TrainingCompiler, "partition", "partition"),
                                 (capture, "run_passes", "passes"), (passes, "format_graph", "snapshots"),
                                 (compat, "extract_forward_backward", "extract"),
                                 (inline_regions, "inline_partitioned_regions", "inline"),
                                 (capture.TrainingCompiler, "compile_forward", "lowering"),
                                 (capture.TrainingCompiler, "compile_backward", "lowering")):
            stack.enter_context(timing(owner, name, key))
        if trace_step:
            stack.enter_context(mock.patch.object(backend, "take_step_out_of_trace", lambda params: None))
        if pytree_call:
            stack.enter_context(mock.patch.object(repeats, "_flatten_call", lambda args, kwargs: None))
        if collector_on:
            for owner in (backend, capture):
                stack.enter_context(mock.patch.object(owner, "cycle_collector_paused", contextlib.nullcontext))
        policy_capture._reset_dynamo()
        COMPILED.clear()
        repeats._MARKED_CLASSES.clear()  # the marking forward reads _flatten_call at call time
        model = meta_model.build_model(cfg, cfg["num_hidden_layers"])
        assert len(megacompile.mark_repeated_layers(model)) == cfg["num_hidden_layers"]
        first, second = _two_calls(model, seq_len, snapshots=snapshots)
        policy_capture._reset_dynamo()
        repeats._MARKED_CLASSES.clear()
    return first - second, parts


def _aot_eager_compile(cfg: dict, seq_len: int) -> float:
    """Compile s of the same marked step under torch.compile's own ``aot_eager`` backend (Dynamo +
    AOTAutograd, default partitioner, no megatrain), with the optimizer's step kept out of the
    trace the way megatrain keeps it out (``torch.compiler.disable``): the capture any backend pays."""
    policy_capture._reset_dynamo()
    model = meta_model.build_model(cfg, cfg["num_hidden_layers"])
    assert len(megacompile.mark_repeated_layers(model)) == cfg["num_hidden_layers"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    opt.step = torch.compiler.disable(opt.step)

    def step(input_ids, labels):
        loss = meta_model.host_cross_entropy(model(input_ids=input_ids).logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    compiled = torch.compile(step, backend="aot_eager")
    x = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    _collect_earlier_garbage()
    t0 = time.perf_counter()
    compiled(x, x)
    t1 = time.perf_counter()
    compiled(x, x)
    t2 = time.perf_counter()
    policy_capture._reset_dynamo()
    return (t1 - t0) - (t2 - t1)


def breakdown_table(depths: list[int], seq_len: int) -> list[str]:
    lines = [
        "(h) layers marked by mark_repeated_layers, budget 'none'; compile s = first call - second call, each in",
        "a fresh model; the parts are timers around megatrain's pieces (aot = AOTAutograd with megatrain's",
        "partitioner inside it; lowering = building the forward and backward programs, the backward's on the",
        "first loss.backward(); Dynamo = compile - aot - lowering; capture = compile - partition - lowering: Dynamo",
        "and AOTAutograd's own work, which megatrain does not control). Variants switch each saving off again:",
        "'collector on' (Python's cycle collector runs while megatrain compiles), 'snapshots kept' (every graph",
        "formatted and linted after every pass, as under megacompile inspect), 'optimizer step traced' (Dynamo",
        "traces AdamW's step, the backend swaps in the fused kernel) and 'call not flattened' (Dynamo fingerprints",
        "each region call by tracing pytree.tree_flatten over its keywords). The last variant is torch.compile's own",
        "backend='aot_eager' (Dynamo + AOTAutograd, default partitioner) on the same marked step, its optimizer step",
        "kept out of the trace as megatrain keeps it: the capture every torch.compile backend pays.",
        f"{'variant':<38} {'layers':>6} {'compile s':>10} {'Dynamo':>7} {'aot':>6} {'partition':>10} {'inline':>7} "
        f"{'passes':>7} {'(snapshots)':>11} {'extract':>8} {'lowering':>9} {'capture':>8}",
    ]
    print("\n".join(lines), flush=True)
    # One-time imports and caches of each backend, not timed.
    _timed_compile(small_llama(2), seq_len, *_VARIANTS["as shipped"])
    _aot_eager_compile(small_llama(2), seq_len)
    growth = {}
    for name in list(_VARIANTS) + [_AOT_EAGER]:
        for n in depths:
            if name == _AOT_EAGER:
                total, parts = _aot_eager_compile(small_llama(n), seq_len), None
                row = f"{name:<38} {n:>6} {total:>10.2f}" + "".join(f" {'-':>{w}}" for w in (7, 6, 10, 7, 7, 11, 8, 9, 8))
            else:
                total, parts = _timed_compile(small_llama(n), seq_len, *_VARIANTS[name])
                dynamo = total - parts.get("aot", 0.0) - parts.get("lowering", 0.0)
                capture_s = total - parts.get("partition", 0.0) - parts.get("lowering", 0.0)
                row = (f"{name:<38} {n:>6} {total:>10.2f} {dynamo:>7.2f} {parts.get('aot', 0):>6.2f} "
                       f"{parts.get('partition', 0):>10.2f} {parts.get('inline', 0):>7.2f} {parts.get('passes', 0):>7.2f} "
                       f"{parts.get('snapshots', 0):>11.2f} {parts.get('extract', 0):>8.2f} {parts.get('lowering', 0):>9.2f} "
                       f"{capture_s:>8.2f}")
            print(row, flush=True)
            lines.append(row)
            growth.setdefault(name, []).append((n, total, parts))
    skipped = " " * 37  # the inline, passes, snapshots and extract columns
    lines.append(f"{f'per added layer (s), {depths[0]} -> {depths[-1]} layers':<45} {'compile':>10} {'Dynamo':>7} "
                 f"{'aot':>6} {'partition':>10}{skipped} {'lowering':>9} {'capture':>8}")
    for name, rows in growth.items():
        (n0, t0, p0), (n1, t1, p1) = rows[0], rows[-1]
        span = n1 - n0
        row = f"{name:<38} {'':>6} {(t1 - t0) / span:>10.3f}"
        if p0 is not None:
            def grew(key):
                return (p1.get(key, 0.0) - p0.get(key, 0.0)) / span
            row += (f" {(t1 - t0) / span - grew('aot') - grew('lowering'):>7.3f} {grew('aot'):>6.3f} "
                    f"{grew('partition'):>10.3f}{skipped} {grew('lowering'):>9.3f} "
                    f"{(t1 - t0) / span - grew('partition') - grew('lowering'):>8.3f}")
        lines.append(row)
    print("\n".join(lines[-len(growth) - 1:]), flush=True)
    return lines


def planned(cfg: dict, seq_len: int, budget: int | None):
    traced_layers._TRACE_CACHE.clear()
    _collect_earlier_garbage()
    t0 = time.perf_counter()
    r = planning.plan_model(cfg, get_profile("h200"), batch=1, seq_len=seq_len, budget=budget, search=False)
    return time.perf_counter() - t0, r


def inductor_lowering(layers: int, reuse: bool) -> tuple[float, int, int]:
    """(first call s, segments in the programs, segments compiled) of a real (CPU) training step
    of a tiny Llama with ``lowering="inductor"``: Inductor compiles each segment of the
    streamed program on its first call. ``reuse=False`` is the counterfactual without
    ``runtime/segment_cache.py``: every segment compiled (no structure ever matches)."""
    import transformers as T

    from megacompile.runtime import segment_cache

    policy_capture._reset_dynamo()
    COMPILED.clear()
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
                                             max_position_embeddings=64, use_cache=False))
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from reference_models import labels_training_step

    compiled = torch.compile(labels_training_step(model, lr=1e-4), backend="megatrain",
                             options={"device": "cpu", "lowering": "inductor"})
    original = segment_cache.segment_structure
    if not reuse:
        segment_cache.segment_structure = lambda gm: object()  # a key no other segment has
    try:
        x = torch.randint(0, 128, (1, 32))
        _collect_earlier_garbage()
        t0 = time.perf_counter()
        compiled(x)
        first = time.perf_counter() - t0
    finally:
        segment_cache.segment_structure = original
    stats = megacompile.last_report().segments
    policy_capture._reset_dynamo()
    return first, stats["compiled"] + stats["reused"], stats["compiled"]


def _one_table(title: str, suffix: str, table, depths: list[int], args) -> int:
    """Run one of the tables that have a mode of their own; saved as compile_time-<date>-cpu-2core-<suffix>.txt."""
    started = datetime.datetime.now()
    load_before = os.getloadavg()[0]
    head = [f"{title}  {started:%Y-%m-%d %H:%M}  (cpu-2core)",
            f"cpu: {platform.processor() or platform.machine()} x{os.cpu_count()} logical; torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}, python {platform.python_version()}",
            f"model: llama-3-8b preset scaled down (as tables (a)-(c)), batch 1 x seq {args.seq_len}, fp32, meta device", ""]
    print("\n".join(head), flush=True)
    lines = head + table(depths, args.seq_len)
    lines.append(f"1-min load average before/after: {load_before:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} "
                 "logical CPUs")
    if not args.no_save:
        out = os.path.join(HERE, "results", f"compile_time-{started:%Y-%m-%d}-cpu-2core-{suffix}.txt")
        with open(out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {os.path.relpath(out)}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="8,16,32,64")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--inductor-layers", default="2,4,8", help="depths of the Inductor-lowering table (d)")
    p.add_argument("--template-only", action="store_true",
                   help="only table (g), flat vs template planning, saved as compile_time-<date>-cpu-2core-template.txt")
    p.add_argument("--breakdown", action="store_true",
                   help="only table (h), where a marked compile's time goes, saved as compile_time-<date>-cpu-2core-breakdown.txt")
    args = p.parse_args(argv)
    if args.breakdown:
        depths = [int(x) for x in args.layers.split(",") if x] if args.layers != "8,16,32,64" else [16, 64]
        return _one_table("compile time of marked layers, by part", "breakdown", breakdown_table, depths, args)
    if args.template_only:
        return _one_table("compile + plan time vs depth, flat vs template planning", "template", template_table,
                          [int(x) for x in args.layers.split(",") if x], args)
    depths = [int(x) for x in args.layers.split(",") if x]  # --layers "": table (d) only

    load_before = os.getloadavg()[0]
    started = datetime.datetime.now()
    lines = [
        f"compile + plan time vs depth  {started:%Y-%m-%d %H:%M}  (cpu-2core)",
        f"cpu: {platform.processor() or platform.machine()} x{os.cpu_count()} logical; torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, python {platform.python_version()}",
        f"model: llama-3-8b preset scaled down (hidden 256, MLP 688, 4 heads / 2 KV heads, vocab 1024), "
        f"batch 1 x seq {args.seq_len}, fp32, all on the meta device",
        "(a) full: torch.compile(step, backend='megatrain') of all N layers; first call (compile + one step on meta) "
        "and second call (the step alone); compile = first - second",
        "(b) plan: plan_model, k=2 layers traced (every policy from one trace), extrapolated to N",
        "budgets: 'none' (everything fits: the planner's first rung) and 'tight' (half the keep-everything peak: "
        "the planner builds its candidate ladder)",
        "",
        f"{'layers':>6} {'budget':>6} | {'full: compile s':>15} {'step s':>7} {'planner: plan (decoder layers)':<34} "
        f"{'peak MiB':>9} | {'plan s':>7} {'plan_model: plan':<36} {'peak MiB':>9} {'peak err':>8} {'same plan':>9}",
        "-" * 166,
    ]
    print("\n".join(lines), flush=True)
    marked_rows: list[tuple[int, float, float]] = []
    for n in depths:
        cfg = small_llama(n)
        keep_peak = None
        for label in ("none", "tight"):
            if label == "tight":
                budget = keep_peak // 2
            else:
                budget = None
            first, second, policy, peak, same = full_compile(cfg, args.seq_len, budget)
            if label == "none":
                # torch.compile's own capture beside megatrain's, same step: Dynamo alone (the
                # 'eager' backend runs the captured graph as it is) and Dynamo + AOTAutograd
                # with the default partitioner ('aot_eager'), marked and not.
                marked_rows.append((n, compile_seconds(cfg, args.seq_len, "eager", marked=False),
                                    compile_seconds(cfg, args.seq_len, "aot_eager", marked=False),
                                    compile_seconds(cfg, args.seq_len, "aot_eager", marked=True),
                                    first - second, compile_seconds(cfg, args.seq_len, "megatrain", marked=True)))
            plan_s, r = planned(cfg, args.seq_len, budget)
            if label == "none":
                keep_peak = r.device["keep_all_peak_bytes"]
            err = (r.device["peak_bytes"] - peak) / peak
            same_err = "-"
            if same is not None and set(same) <= set(r.trace.policies):
                same_err = f"{(full_depth.evaluate(r.trace, same).peak_bytes - peak) / peak:+.2%}"
            row = (f"{n:>6} {label:>6} | {first - second:>15.2f} {second:>7.2f} {policy[:34]:<34} {peak / 2**20:>9.2f} | "
                   f"{plan_s:>7.2f} {r.device['plan'][:36]:<36} {r.device['peak_bytes'] / 2**20:>9.2f} {err:>+8.2%} "
                   f"{same_err:>9}")
            print(row, flush=True)
            lines.append(row)
    table_c = len(lines)  # where table (c) and the notes start
    lines += [
        "",
        "(c) decoder layers marked with torch.compiler.nested_compile_region by megacompile.mark_repeated_layers",
        "(budget 'none'): Dynamo traces the",
        "layer once and calls it per layer; AOTAutograd traces and partitions the layer once (its schema derived",
        "once: compat.invoke_subgraph_schema_memo); megatrain inlines the partitioned bodies per call",
        "(megacompile/capture/inline_regions.py), so the passes and the planner still see every layer",
        "Beside it, torch.compile's own capture of the same step (compile s, budget 'none'): Dynamo alone",
        "(backend='eager': the captured graphs run as they are; no autograd tracing) and Dynamo + AOTAutograd",
        "with the default partitioner (backend='aot_eager'); the last row is the growth per added layer",
        f"{'layers':>6} {'Dynamo alone':>13} {'aot_eager':>10} {'aot_eager marked':>17} {'megatrain':>10} "
        f"{'megatrain marked':>17} {'marked: megatrain / aot_eager':>30}",
    ] + [f"{n:>6} {d:>13.2f} {a:>10.2f} {am:>17.2f} {u:>10.2f} {m:>17.2f} {m / am:>30.2f}"
         for n, d, a, am, u, m in marked_rows] + ([
        "s/layer " + "".join(f"{(last - first) / (marked_rows[-1][0] - marked_rows[0][0]):>{w}.3f}"
                             for first, last, w in zip(marked_rows[0][1:], marked_rows[-1][1:], (12, 11, 18, 11, 18)))
    ] if len(marked_rows) > 1 else []) + [
        "",
        "peak err: plan_model's extrapolated peak vs the planner's peak for the full-depth compile (same budget).",
        "The two choose independently (the planner from its built candidate ladder, plan_model by enumerating",
        "keep/offload/recompute counts of identical layers under the planner's rules); 'none' picks the",
        "resident rung in both; under 'tight' they may split the layers differently where plans tie in",
        "predicted time. same plan: plan_model's extrapolation (from 2 traced layers) of the planner's own",
        "plan (its decoder counts) vs the planner's peak for all N layers: the extrapolation error alone.",
        f"1-min load average before/after: {load_before:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} logical CPUs "
        "(other processes competing for the cores inflate the times)",
    ]
    print("\n".join(lines[table_c:]), flush=True)
    # (d) The Inductor lowering: real kernels, compiled on the first call; on-disk caches off so
    # every compile is a compile.
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    inductor_config.autotune_local_cache = False
    lines += [
        "",
        "(d) lowering='inductor' (real CPU tensors: tiny Llama, hidden 64, batch 1 x seq 32; Inductor's on-disk",
        "cache off): first call = Dynamo + AOTAutograd + plan + Inductor compiling the program's segments;",
        "repeats share one compiled segment (runtime/segment_cache.py, found without marking) vs every",
        "segment compiled (best of two runs of each, interleaved)",
        f"{'layers':>6} {'segments':>9} {'compiled':>9} {'first call s':>13} {'no reuse: compiled':>19} {'first call s':>13}",
    ]
    print("\n".join(lines[-6:]), flush=True)
    inductor_lowering(1, reuse=True)  # warm-up: Inductor's first compile in a process loads its toolchain
    for n in [int(x) for x in args.inductor_layers.split(",") if x]:
        # Best of two of each, interleaved (a compile's first call varies with the machine).
        runs = [inductor_lowering(n, reuse) for _ in range(2) for reuse in (True, False)]
        shared_s, segments, compiled_n = min(runs[0::2])
        alone_s, _, alone_n = min(runs[1::2])
        row = f"{n:>6} {segments:>9} {compiled_n:>9} {shared_s:>13.2f} {alone_n:>19} {alone_s:>13.2f}"
        print(row, flush=True)
        lines.append(row)
    if not args.no_save:
        out = os.path.join(HERE, "results", f"compile_time-{started:%Y-%m-%d}-cpu-2core.txt")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {os.path.relpath(out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    with recording(into=COMPILED):
        sys.exit(main())
