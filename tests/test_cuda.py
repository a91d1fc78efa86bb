"""The CUDA path: parity and peak memory against the plan on a real GPU.

Skipped on CPU-only machines (CI here has no GPU); benchmarks/gpu_smoke.py runs the same
check and records the numbers under benchmarks/results/.
"""
import copy
import dataclasses

import pytest
import torch
from conftest import COMPILED
from reference_models import REFERENCE_MODELS, make_training_step, training_state_bytes

import megacompile
from megacompile.runtime.device import get_device

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _gpt_compiled_and_eager(options: dict):
    """The reference GPT, TF32 off: (model, its megatrain step under ``options``, an eager
    copy on the GPU, that copy's step, the batch maker)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ctor, make_batch, loss_fn = REFERENCE_MODELS["gpt"]
    torch.manual_seed(0)
    model = ctor()
    reference = copy.deepcopy(model).cuda()
    step, _ = make_training_step(model, loss_fn)
    eager_step, _ = make_training_step(reference, loss_fn)
    step = torch.compile(step, backend="megatrain", options={"device": "cuda", **options})
    return model, step, reference, eager_step, make_batch


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama"])
@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_cuda_parity_and_peak(name, lowering):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ctor, make_batch, loss_fn = REFERENCE_MODELS[name]
    torch.manual_seed(0)
    model = ctor()
    reference = copy.deepcopy(model).cuda()
    budget = training_state_bytes(model) // 4
    step, _ = make_training_step(model, loss_fn)
    eager_step, _ = make_training_step(reference, loss_fn)
    step = torch.compile(step, backend="megatrain",
                         options={"device": "cuda", "lowering": lowering, "memory_budget": budget})
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = make_batch(gen)
        torch.testing.assert_close(step(x, y), eager_step(x.cuda(), y.cuda()).cpu(), rtol=1e-5, atol=0)
    # Under Inductor, GEMM epilogues and fused reductions sum in another order; AdamW turns a
    # tiny difference in a near-zero gradient into an update difference of up to about lr, so
    # a few weights may differ by more than 1e-5 after 5 steps (the same bound as the HF Llama
    # test below; on the H100, 1.6e-5 in 1 of 11,008 weights of the Llama).
    atol = 1e-5 if lowering == "eager" else 2e-5
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q.cpu(), rtol=0, atol=atol)
    report = megacompile.last_report()
    assert report.measured_peak_device_bytes is not None
    assert report.measured_peak_device_bytes <= budget
    # What the allocator reserved is reported beside it (issue 17 asks for <= 1.05x the budget;
    # not met yet at scale, so only stated here: reserved covers what tensors held).
    assert report.measured_reserved_device_bytes >= report.measured_peak_device_bytes
    planned = report.planned_peak_device_bytes
    assert abs(report.measured_peak_device_bytes - planned) <= 0.05 * report.measured_peak_device_bytes


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_cuda_hugging_face_llama_with_sdpa_attention(lowering):
    # Hugging Face's default attention: the host trace holds the CPU flash kernel, which the
    # runtime replaces by the device's attention (runtime/placement.py).
    from reference_models import labels_training_step
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    reference = copy.deepcopy(model).cuda()
    budget = training_state_bytes(model) // 2
    step = torch.compile(labels_training_step(model), backend="megatrain",
                         options={"device": "cuda", "lowering": lowering, "memory_budget": budget})
    eager_step = labels_training_step(reference)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 96, (2, 16), generator=gen)
        torch.testing.assert_close(step(x), eager_step(x.cuda()).cpu(), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q.cpu(), rtol=0, atol=2e-5)
    report = megacompile.last_report()
    assert report.measured_peak_device_bytes <= budget


@pytest.mark.parametrize("name, budget_fraction", [("mlp", None), ("gpt", None), ("llama", None),
                                                   ("mlp", 0.09), ("gpt", 0.15)])
def test_cuda_bf16_trains_like_cuda_autocast(name, budget_fraction):
    """precision="bf16" on the GPU: bf16 compute and bf16 over the link, fp32 master weights,
    gradients and AdamW states on the host. On CUDA the step is traced with CUDA autocast's op
    lists (core/autocast_lists.py), so the reference is the same fp32 model resident on the
    GPU under torch.autocast("cuda"). Under CPU's lists (what megatrain traced with before)
    the first losses were 0, 4.5e-4 and 1.9e-4 apart for mlp, gpt, llama on an H100
    (benchmarks/bf16_autocast_policy.py); same lists and the same GPU kernels should agree to
    2e-5 (and not be the fp32 loss). After that the host AdamW (fp32, correctly rounded sqrt)
    and torch's on the GPU let the runs drift apart at bf16's noise level, far below what a
    misplaced cast does (about 1e-3). The tight budgets make the planner recompute or offload
    in bf16."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ctor, make_batch, loss_fn = REFERENCE_MODELS[name]
    torch.manual_seed(0)
    model = ctor()
    reference = copy.deepcopy(model).cuda()
    fp32_model = copy.deepcopy(model).cuda()
    budget = int(training_state_bytes(model) * (budget_fraction or 0.25))
    step, _ = make_training_step(model, loss_fn)
    eager_step, _ = make_training_step(reference, loss_fn)
    step = torch.compile(step, backend="megatrain", options={
        "device": "cuda", "lowering": "eager", "precision": "bf16", "memory_budget": budget})
    gen = torch.Generator().manual_seed(1)
    copies = get_device("cuda").weight_copies
    for k in range(4):
        x, y = make_batch(gen)
        if k == 0:
            with torch.no_grad():
                fp32 = loss_fn(fp32_model(x.cuda()), y.cuda()).item()
        before = dataclasses.replace(copies.stats)
        got = step(x, y).item()
        if k >= 2:  # steady state: the overlapped update wrote every copy, no load recast one
            assert copies.stats.made == before.made and copies.stats.recast == before.recast, (before, copies.stats)
            assert copies.stats.written_by_optimizer > before.written_by_optimizer
            # Each copied weight's bf16 gradient landed in its copy (the copy's loads waited for first).
            assert copies.stats.lent - before.lent == copies.stats.written_by_optimizer - before.written_by_optimizer
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want = eager_step(x.cuda(), y.cuda()).item()
        print(f"{name} step {k}: megatrain {got:.8f} cuda autocast {want:.8f} rel {abs(got - want) / abs(want):.2e}")
        if k == 0:
            assert abs(got - want) <= 2e-5 * abs(want), (got, want)
            assert abs(got - fp32) > 5e-6 * abs(fp32), (got, fp32)  # bf16 compute really ran
        else:
            assert abs(got - want) <= 5e-4 * abs(want), (k, got, want)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    # The copies the loads carry are page-locked in place (cudaHostRegister), exactly their size.
    held = [copies.get(p, torch.bfloat16) for p in model.parameters() if p.dim() == 2]
    assert held and all(c.is_pinned() for c in held)
    report = megacompile.last_report()
    assert report.precision == "bf16"
    if budget_fraction:
        assert not report.policy.startswith("keep"), report.policy
    assert 0 < report.measured_peak_device_bytes <= budget
    planned = report.planned_peak_device_bytes
    assert abs(report.measured_peak_device_bytes - planned) <= 0.05 * report.measured_peak_device_bytes


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_cuda_optimizer_overlaps_the_backward(lowering):
    """overlap_optimizer="auto" is on for CUDA: from the second call on, each layer's AdamW
    update runs on the host worker while the backward goes on, and training equals eager."""
    torch.manual_seed(0)
    budget = training_state_bytes(REFERENCE_MODELS["gpt"][0]()) // 4
    model, step, reference, eager_step, make_batch = _gpt_compiled_and_eager(
        {"lowering": lowering, "memory_budget": budget})
    gen = torch.Generator().manual_seed(1)
    modes = []
    for _ in range(4):
        x, y = make_batch(gen)
        torch.testing.assert_close(step(x, y), eager_step(x.cuda(), y.cuda()).cpu(), rtol=1e-5, atol=0)
        modes.append(megacompile.last_report().optimizer)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q.cpu(), rtol=0, atol=1e-5)
    assert all(m["overlapped"] for m in modes[1:]), [m.get("reason") for m in modes]
    n_params = len(list(model.parameters()))
    assert modes[-1]["updated_params"] == n_params
    assert modes[-1]["consumed_grad_bytes"] > 0


def test_cuda_host_lead_bounds_the_layers_enqueued_ahead_and_trains_like_eager(tmp_path):
    """``host_lead_layers=1``: before the host enqueues a layer's compute it waits for the GPU
    to reach the layer before; training still equals eager, at most one layer's mark stays
    outstanding, and a trace splits the thread's time into work, blocked and throttled."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    budget = training_state_bytes(REFERENCE_MODELS["gpt"][0]()) // 4
    model, step, reference, eager_step, make_batch = _gpt_compiled_and_eager(
        {"lowering": "inductor", "memory_budget": budget, "host_lead_layers": 1})
    device = get_device("cuda")
    gen = torch.Generator().manual_seed(1)
    x, y = make_batch(gen)
    torch.testing.assert_close(step(x, y), eager_step(x.cuda(), y.cuda()).cpu(), rtol=1e-5, atol=0)
    with megacompile.trace_runtime(tmp_path / "lead.json") as recorder:
        for _ in range(3):
            x, y = make_batch(gen)
            torch.testing.assert_close(step(x, y), eager_step(x.cuda(), y.cuda()).cpu(), rtol=1e-5, atol=0)
            assert device.lead.outstanding <= 1
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q.cpu(), rtol=0, atol=1e-5)
    summary = recorder.host_thread_summary()
    assert summary["working_s"] + summary["blocked_s"] == pytest.approx(summary["busy_s"])
    assert 0 < summary["working_fraction"] <= summary["busy_fraction"] <= 1
    assert summary["throttled_s"] >= 0
    lead = megacompile.last_report().host_lead
    assert lead is not None and lead["throttles"] >= 0 and lead["throttled_seconds"] >= 0


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_cuda_template_plan_of_marked_llama_layers(lowering):
    """Eight marked HF Llama layers under a budget keeping every activation exceeds: planned
    on short copies of the step (template_planner), the plan trains like eager on the GPU and
    its measured peak is within the budget and within 5% of the planned one."""
    from reference_models import labels_training_step, tiny_llama

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = tiny_llama(8)
    reference = copy.deepcopy(model).cuda()
    assert len(megacompile.mark_repeated_layers(model)) == 8
    budget = training_state_bytes(model) // 4
    step = torch.compile(labels_training_step(model), backend="megatrain",
                         options={"device": "cuda", "lowering": lowering, "memory_budget": budget,
                                  "plan_repeats": "template"})
    eager_step = labels_training_step(reference)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 96, (4, 32), generator=gen)
        torch.testing.assert_close(step(x), eager_step(x.cuda()).cpu(), rtol=1e-5, atol=0)
    # Inductor's reductions sum in another order than eager's kernels; AdamW turns that into
    # weight differences up to about lr in a few near-zero-gradient weights (on the H100:
    # 2.1e-5 in 1 of 11,008 after 3 steps with this model). The loss check above is exact.
    atol = 2e-5 if lowering == "eager" else 5e-5
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q.cpu(), rtol=0, atol=atol)

    plan = next(r for r in reversed(COMPILED) if r.plan is not None and r.plan.policy != "inference").plan
    assert plan.template is not None, plan.reason
    report = megacompile.last_report()
    assert report.measured_peak_device_bytes <= budget
    assert abs(report.measured_peak_device_bytes - plan.peak_bytes) <= 0.05 * report.measured_peak_device_bytes


def test_cuda_pinned_host_memory_cap_keeps_tensors_pageable_and_results_equal():
    """``pinned_host_memory=0``: nothing is page-locked (copies from pageable memory are
    synchronous), and the step still trains exactly like eager."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ctor, make_batch, loss_fn = REFERENCE_MODELS["mlp"]
    torch.manual_seed(0)
    model = ctor()
    reference = copy.deepcopy(model).cuda()
    step, _ = make_training_step(model, loss_fn)
    eager_step, _ = make_training_step(reference, loss_fn)
    device = get_device("cuda")
    pinned_before, refused_before = device.pinned.pinned, device.pinned.refused
    try:
        step = torch.compile(step, backend="megatrain", options={
            "device": "cuda", "lowering": "eager", "memory_budget": training_state_bytes(model) // 4,
            "pinned_host_memory": 0})
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = make_batch(gen)
            torch.testing.assert_close(step(x, y), eager_step(x.cuda(), y.cuda()).cpu(), rtol=1e-5, atol=0)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q.cpu(), rtol=0, atol=1e-5)
            assert not p.is_pinned()
        assert device.pinned.pinned <= pinned_before and device.pinned.refused > refused_before
        assert megacompile.last_report().pinned_host_cap == 0
    finally:
        device.pinned.cap = None


def test_cuda_offloaded_activations_land_in_one_page_locked_arena(monkeypatch):
    """At the minimum budget with recompute off, the forward's offloads go to one exact-size,
    page-locked host buffer reused every step (no pinned caching-allocator block per value),
    and training equals eager."""
    from conftest import record_programs

    torch.backends.cuda.matmul.allow_tf32 = False
    ctor, make_batch, loss_fn = REFERENCE_MODELS["mlp"]
    options = {"device": "cuda", "lowering": "eager", "recompute": "never"}
    torch.manual_seed(0)
    with pytest.raises(megacompile.BudgetError) as e:
        torch.compile(make_training_step(ctor(), loss_fn)[0], backend="megatrain",
                      options={**options, "memory_budget": 1024})(*make_batch(torch.Generator().manual_seed(1)))
    torch._dynamo.reset()
    programs = record_programs(monkeypatch)
    torch.manual_seed(0)
    model = ctor()
    reference = copy.deepcopy(model).cuda()
    step = torch.compile(make_training_step(model, loss_fn)[0], backend="megatrain",
                         options={**options, "memory_budget": e.value.minimum_budget})
    eager_step, _ = make_training_step(reference, loss_fn)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = make_batch(gen)
        torch.testing.assert_close(step(x, y), eager_step(x.cuda(), y.cuda()).cpu(), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q.cpu(), rtol=0, atol=1e-5)
    (program,) = [p for p in programs if p.arena_pool is not None]
    stats = program.arena_pool.stats
    assert stats.arenas_made == 1 and stats.spilled == 0 and stats.placed > 0
    (arena,) = program.arena_pool._arenas
    assert arena.buffer.is_pinned()  # registered in place, so its copies are true DMAs
    assert megacompile.last_report().offload_arena_bytes >= arena.capacity


def test_cuda_loads_allocate_in_the_compute_streams_pool():
    """Loads allocate their device copies on the compute stream, so the caching allocator keeps
    one pool: no memory segment belongs to the copy streams (a pool per stream reserves each
    pool's own peak; the h2d stream's pool was the likely cause of a 1.28x reserve). The copy
    program trains like eager with the merged runs of merge_compute_runs taken."""
    model, step, reference, eager_step, make_batch = _gpt_compiled_and_eager({"lowering": "inductor"})
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = make_batch(gen)
        torch.testing.assert_close(step(x, y), eager_step(x.cuda(), y.cuda()).cpu(), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q.cpu(), rtol=0, atol=2e-5)
    assert "merged runs" in megacompile.last_report().policy
    device = get_device("cuda")
    copy_streams = {device.h2d_stream.cuda_stream, device.d2h_stream.cuda_stream}
    segments = torch.cuda.memory_snapshot()
    assert segments and not [s for s in segments if s["stream"] in copy_streams], segments


def test_cuda_bf16_llama_attention_runs_the_flash_pair_without_a_second_forward():
    """bf16 HF Llama with sdpa attention and its causal mask elided: the device's flash kernel
    runs forward and backward on its own log-sum-exp (runtime/device_attention.py), its one
    check against the replay passes, and the losses follow the resident model's under
    torch.autocast("cuda")."""
    from reference_models import labels_training_step
    from transformers import LlamaConfig, LlamaForCausalLM

    from megacompile.runtime import device_attention

    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    reference = copy.deepcopy(model).cuda()
    step = torch.compile(labels_training_step(model), backend="megatrain",
                         options={"device": "cuda", "precision": "bf16"})
    eager_step = labels_training_step(reference)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 96, (2, 32), generator=gen)
        got = step(x).item()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want = eager_step(x.cuda()).item()
        assert abs(got - want) <= 2e-3 * abs(want), (got, want)
    assert device_attention._VERDICTS.get(("cuda", torch.bfloat16, 32, True)) is True, device_attention._VERDICTS


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")
@pytest.mark.parametrize("reduce_on", ["device", "host"])
def test_two_gpus_average_gradients_with_nccl_or_gloo_like_the_global_batch(reduce_on):
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "examples/train_data_parallel.py", "--device", "cuda", "--check", "--steps", "3", "--overlap",
           "--reduce-gradients-on", reduce_on]
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, env=dict(os.environ),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "parity with eager on the global batch" in done.stdout
    # The report of the last step says where the gradients were averaged.
    assert f"reduced on the {reduce_on}" in done.stdout, done.stdout[-3000:]


def test_cuda_a_steps_own_cuda_autocast_region_runs_in_bf16():
    """A GPU training loop's own ``with torch.autocast("cuda", dtype=torch.bfloat16):``, precision
    left at fp32: the step computes what the resident model computes under that autocast (the
    region is traced as CPU autocast following CUDA's lists), not the fp32 step."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ctor, make_batch, loss_fn = REFERENCE_MODELS["gpt"]
    torch.manual_seed(0)
    model = ctor()
    reference, fp32 = copy.deepcopy(model).cuda(), copy.deepcopy(model).cuda()
    step, _ = make_training_step(model, loss_fn, autocast="cuda")
    compiled = torch.compile(step, backend="megatrain", options={"device": "cuda", "lowering": "eager"})
    x, y = make_batch(torch.Generator().manual_seed(1))
    got = compiled(x, y).item()
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want = loss_fn(reference(x.cuda()), y.cuda()).item()
        full = loss_fn(fp32(x.cuda()), y.cuda()).item()
    assert abs(got - want) <= 2e-5 * abs(want), (got, want)
    assert abs(got - full) > 5e-6 * abs(full), (got, full)


def test_cuda_a_model_called_inside_cuda_autocast_runs_in_bf16():
    """``with torch.autocast("cuda"): loss = loss_fn(compiled_model(x), y)``: the model's
    program computes what the resident model computes under that autocast, and the backward
    gives its gradients (the program runs with autocast off: its casts are explicit)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ctor, make_batch, loss_fn = REFERENCE_MODELS["gpt"]
    torch.manual_seed(0)
    model = ctor()
    reference = copy.deepcopy(model).cuda()
    compiled = torch.compile(model, backend="megatrain", options={"device": "cuda", "lowering": "eager"})
    x, y = make_batch(torch.Generator().manual_seed(1))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = compiled(x)
        ref_logits = reference(x.cuda())
    assert logits.dtype == ref_logits.dtype == torch.bfloat16
    loss, ref_loss = loss_fn(logits.float(), y), loss_fn(ref_logits.float(), y.cuda())
    assert abs(loss.item() - ref_loss.item()) <= 2e-5 * abs(ref_loss.item()), (loss.item(), ref_loss.item())
    loss.backward()
    ref_loss.backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad.cpu(), rtol=2e-2, atol=2e-3)
