"""Training loops people write, each run with megatrain and eagerly side by side on one small model.

``model_sweep.py`` varies the architecture under one loop (loss, backward, AdamW). This sweep
holds the model (a 3-layer Hugging Face Llama) and varies the loop: optimizers and their
flags, parameter groups, LR schedulers, clipping, frozen parameters, an EMA of the weights,
losses written by hand, metrics returned from the step, padded batches, evaluation between
steps, the model compiled without its optimizer, and graph breaks in the step (``.item()``,
``print``, numpy). On the CPU stand-in, eager lowering, under a budget of 30% of the training
state (parameters stream, activations are offloaded or recomputed), 4 steps on random tokens. One row per loop: the largest relative
difference of what the step returns (losses, metrics) to eager PyTorch, the largest absolute
parameter difference, the measured peak against the budget, the plan, any megatrain warning
(a fallback, or a step Dynamo compiles again at every call) or the error.

    python benchmarks/training_loop_sweep.py                  # every loop
    python benchmarks/training_loop_sweep.py --cases ema,onecycle --out /tmp/loops.txt
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import megacompile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_model, write_result  # noqa: E402

VOCAB = 128
STEPS = 4
TOLERANCE = 1e-5  # fp32: the same kernels as eager; what differs is the order of a few sums
BUDGET_FRACTION = 30  # percent of the training state (parameters, gradients, AdamW state): the plan trades activations


def _model():
    import transformers  # lazy: the sweep's only model

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                      vocab_size=VOCAB, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).train()


def _decay_groups(m):
    matrices = [p for p in m.parameters() if p.ndim >= 2]
    vectors = [p for p in m.parameters() if p.ndim < 2]
    return [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0, "lr": 3e-3}]


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-3)


def _lm(m, x):
    return m(input_ids=x, labels=x).loss


def _smoothed(m, x):
    """Cross entropy by hand: the first tokens ignored, label smoothing."""
    logits = m(input_ids=x).logits
    y = x.clone()
    y[:, :3] = -100
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), y[:, 1:].reshape(-1), ignore_index=-100,
                           label_smoothing=0.1)


def _with_z_loss(m, x):
    out = m(input_ids=x, labels=x)
    return out.loss + 1e-3 * torch.logsumexp(out.logits, -1).pow(2).mean()


def _padded(m, x):
    mask = torch.ones_like(x)
    mask[0, :5] = 0  # the first sequence left-padded
    return m(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100)).loss


def _step(optimizer=_adamw, loss=_lm, schedule=None, after_update=None, metrics=False, break_with=None):
    """``step_of(model)``: a training step of this kind. ``break_with(loss, log)`` runs between
    the forward and the backward (a graph break there splits the step)."""
    def step_of(m):
        opt = optimizer(m)
        scheduler = schedule(opt) if schedule else None
        state, log = {}, []

        def step(x):
            value = loss(m, x) if not metrics else _loss_and_accuracy(m, x, state)
            if break_with is not None:
                value = break_with(value, log)
            value.backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
            opt.zero_grad()
            if after_update is not None:
                after_update(m, state)
            if metrics:
                return torch.stack([value.detach(), state.pop("accuracy")])
            return value.detach()
        return step
    return step_of


def _loss_and_accuracy(m, x, state):
    out = m(input_ids=x, labels=x)
    state["accuracy"] = (out.logits[:, :-1].argmax(-1) == x[:, 1:]).float().mean().detach()
    return out.loss


def _ema(m, state):
    with torch.no_grad():
        if "ema" not in state:
            state["ema"] = [p.detach().clone() for p in m.parameters()]
        for average, p in zip(state["ema"], m.parameters()):
            average.lerp_(p, 0.1)


def _frozen_embedding(m):
    m.model.embed_tokens.weight.requires_grad_(False)
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)


def _clip_value_keep_grads(m):
    opt = _adamw(m)

    def step(x):
        value = _lm(m, x)
        value.backward()
        torch.nn.utils.clip_grad_value_(m.parameters(), 0.01)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return value.detach()
    return step


def _clip_norm_logged(m):
    opt, norms = _adamw(m), []

    def step(x):
        value = _lm(m, x)
        value.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))  # a graph break after the backward
        opt.step()
        opt.zero_grad()
        return value.detach()
    return step


def _item_branch(value, log):
    return value * 0.5 if value.item() > 100.0 else value


def _printed(value, log):
    print(f"  (the step prints its loss: {value.item():.4f})")
    return value


def _logged(value, log):
    log.append(value.item())
    return value


def _through_numpy(value, log):
    log.append(value.detach().numpy().sum())
    return value


def _nonfinite_guard(value, log):
    if not torch.isfinite(value):
        raise FloatingPointError("the loss is not finite")
    return value


# name -> step_of(model): what each loop exercises is in its name and builder.
STEP_LOOPS = {
    "adam_amsgrad": _step(lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, amsgrad=True)),
    "nadam": _step(lambda m: torch.optim.NAdam(m.parameters(), lr=1e-3)),
    "radam": _step(lambda m: torch.optim.RAdam(m.parameters(), lr=1e-3)),
    "adamax": _step(lambda m: torch.optim.Adamax(m.parameters(), lr=1e-3)),
    "adadelta": _step(lambda m: torch.optim.Adadelta(m.parameters(), lr=1.0)),
    "sgd_nesterov": _step(lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True,
                                                    weight_decay=1e-4)),
    "adamw_param_groups": _step(lambda m: torch.optim.AdamW(_decay_groups(m), lr=1e-3)),
    "adamw_maximize": _step(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, maximize=True)),
    "adamw_fused": _step(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)),
    "adamw_for_loop": _step(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)),
    "adamw_tensor_lr": _step(lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-3))),
    "onecycle_lr": _step(schedule=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10)),
    "warmup_lambda_lr": _step(schedule=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 3))),
    "frozen_embedding": _step(_frozen_embedding),
    "ema_of_weights": _step(after_update=_ema),
    "label_smoothing_by_hand": _step(loss=_smoothed),
    "z_loss": _step(loss=_with_z_loss),
    "padded_batch": _step(loss=_padded),
    "metrics_returned": _step(metrics=True),
    "clip_value_keep_grads": _clip_value_keep_grads,
    "clip_norm_logged": _clip_norm_logged,
    "break_item_branch": _step(break_with=_item_branch),
    "break_print": _step(break_with=_printed),
    "break_log_item": _step(break_with=_logged),
    "break_numpy": _step(break_with=_through_numpy),
    "break_nonfinite_guard": _step(break_with=_nonfinite_guard),
}


def _compiled_model_loop(m, compile, batches, reports, evaluate: bool):
    """The model compiled, its optimizer left eager (the loop of most tutorials); with
    ``evaluate``, a no-grad evaluation forward after each update."""
    forward = compile(m)
    opt = _adamw(m)
    out = []
    for x in batches:
        m.train()
        value = forward(input_ids=x, labels=x).loss
        value.backward()
        opt.step()
        opt.zero_grad()
        out.append(value.detach())
        reports.append(megacompile.last_report())
        if evaluate:
            m.eval()
            with torch.no_grad():
                out.append(forward(input_ids=x, labels=x).loss)
    return out


# name -> run(model, compile, batches, reports): loops whose compiled unit is not the whole step
# (each training step's ``last_report()`` goes to ``reports``).
MODEL_LOOPS = {
    "compiled_model_eager_optimizer": lambda *run: _compiled_model_loop(*run, evaluate=False),
    "evaluation_between_steps": lambda *run: _compiled_model_loop(*run, evaluate=True),
}


def _runner(name: str):
    if name in MODEL_LOOPS:
        return MODEL_LOOPS[name]
    step_of = STEP_LOOPS[name]

    def run(m, compile, batches, reports):
        step, out = compile(step_of(m)), []
        for x in batches:
            out.append(step(x))
            reports.append(megacompile.last_report())
        return out
    return run


def run_loop(name: str) -> tuple[str, str]:
    """(ok | WARN: as eager, with a megatrain warning | MISS | ERROR, the row)."""
    torch.manual_seed(0)
    model = _model()
    reference = copy.deepcopy(model)
    budget = sum(p.numel() * p.element_size() for p in model.parameters()) * 4 * BUDGET_FRACTION // 100
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(STEPS)]
    run = _runner(name)
    started = time.perf_counter()
    options = {"device": "cpu", "lowering": "eager", "memory_budget": budget}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reports: list = []
            got = run(model, lambda f: torch.compile(f, backend="megatrain", options=options), batches, reports)
            want = run(reference, lambda f: f, batches, [])
    except Exception as e:  # noqa: BLE001  (the sweep reports every failure and goes on)
        return "ERROR", f"{name:32s} ERROR {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    finally:
        torch._dynamo.reset()
    worst = max(((a - b).abs() / b.abs().clamp_min(1e-12)).max().item() for a, b in zip(got, want))
    params = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    report = reports[-1]  # the last training step's
    peaks = [r.measured_peak_device_bytes for r in reports if r is not None]
    measured = max(peaks) if peaks and None not in peaks else None
    fallbacks = sorted({str(w.message)[:160] for w in caught if "megatrain" in str(w.message)})
    ok = (worst <= TOLERANCE and params <= TOLERANCE and report is not None
          and measured is not None and measured <= budget and report.h2d_bytes > 0)
    status = "MISS" if not ok else "WARN" if fallbacks else "ok"
    row = (f"{name:32s} {status:4s} returned {worst:8.1e}  params {params:8.1e}  "
           f"peak {measured} of {budget} B  {time.perf_counter() - started:5.1f} s  plan: {report.policy if report else '-'}"
           + (f"  WARNING {fallbacks}" if fallbacks else ""))
    return status, row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated loop names (default: all)")
    parser.add_argument("--out", help="the results file (default: benchmarks/results/training_loop_sweep-<date>-...)")
    args = parser.parse_args(argv)
    names = list(STEP_LOOPS) + list(MODEL_LOOPS)
    chosen = args.cases.split(",") if args.cases else names
    unknown = [n for n in chosen if n not in names]
    if unknown:
        parser.error(f"unknown loop(s) {unknown}; choose from {', '.join(names)}")
    rows, statuses = [], []
    for name in chosen:
        status, row = run_loop(name)
        statuses.append(status)
        rows.append(row)
        print(row, flush=True)
    failed = sum(s in ("MISS", "ERROR") for s in statuses)
    header = (f"# benchmarks/training_loop_sweep.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{cpu_model()}, {platform.python_version()}, torch {torch.__version__}\n"
              f"# {len(chosen) - failed} of {len(chosen)} loops within {TOLERANCE:g} of eager, within the budget, "
              f"streaming; {statuses.count('WARN')} of them with a megatrain warning (WARN: a fallback, or a step "
              f"Dynamo compiles again every call)")
    write_result("\n".join([header, *rows]), "training_loop_sweep-{date}-cpu-{cores}core.txt", args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
