"""Offloaded activations land in exact-size host buffers reused every step (issue 17, item 1).

The arena's rules on their own (offsets, fits, reuse only when nothing holds a value), then a
training step at the minimum budget that offloads: one buffer for the whole run, exactly the
offloaded bytes (each rounded up to 64), every saved value a view of it, and training equal to
eager; two forwards before their backwards get two buffers and still train like eager.
"""
import copy
import gc

import pytest
import torch
from conftest import record_programs
from reference_models import MLP, REFERENCE_MODELS, make_training_step

import megacompile
from megacompile.runtime.device import get_device
from megacompile.runtime.host_arena import (
    ALIGN,
    ArenaLease,
    ArenaPool,
    LandingBuffers,
    OffloadArena,
    arena_bytes,
    storage_span_bytes,
)


def _pool(size=0):
    made = []

    def allocate(n):
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    return ArenaPool(allocate, lambda: None, size=size), made


def test_views_are_aligned_disjoint_and_shaped_like_the_values():
    values = [torch.randn(3, 5), torch.randn(7, dtype=torch.float64), torch.randn(4, 6).t(),
              torch.ones(2, 3, dtype=torch.bfloat16)]
    lease = ArenaLease(OffloadArena(arena_bytes(values), lambda n: torch.empty(n, dtype=torch.uint8)))
    base = lease.arena.buffer.data_ptr()
    spans = []
    for v in values:
        view = lease.place(v)
        assert view.shape == v.shape and view.stride() == v.stride() and view.dtype == v.dtype
        view.copy_(v)
        start = view.data_ptr() - base
        assert start % ALIGN == 0
        spans.append((start, start + storage_span_bytes(v.shape, v.stride(), v.dtype)))
        assert view.untyped_storage().data_ptr() == base  # in the one buffer
        torch.testing.assert_close(view, v, rtol=0, atol=0)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= lease.arena.capacity == lease.needed
    assert lease.placed == len(values) and lease.spilled == 0


def test_an_expanded_or_gapped_value_gets_dense_strides():
    expanded = torch.randn(3, 1).expand(3, 4)  # stride 0: copy_ into such a view would overlap
    gapped = torch.randn(4, 6)[:, ::2]
    lease = ArenaLease(OffloadArena(arena_bytes([expanded, gapped]), lambda n: torch.empty(n, dtype=torch.uint8)))
    assert lease.arena.capacity == 2 * ALIGN  # 48 bytes each, dense
    for v in (expanded, gapped):
        view = lease.place(v)
        assert view.is_contiguous() and view.shape == v.shape
        torch.testing.assert_close(view.copy_(v), v, rtol=0, atol=0)


def test_a_value_that_does_not_fit_spills_and_the_next_arena_is_large_enough():
    pool, made = _pool(size=ALIGN)
    lease = pool.lease()
    assert lease.place(torch.zeros(8)) is not None  # 32 bytes: fits
    assert lease.place(torch.zeros(8)) is None  # the arena is full: allocated on its own
    assert lease.place(torch.zeros(0)) is None  # nothing to place
    assert lease.place(torch.zeros(4, device="meta")) is None  # a plan on meta tensors
    pool.finished(lease)
    del lease
    gc.collect()
    assert pool.lease().arena.capacity == 2 * ALIGN and made == [ALIGN, 2 * ALIGN]


def test_an_arena_is_reused_only_once_nothing_holds_its_values():
    pool, made = _pool()
    first = pool.lease()
    assert first.arena is None  # no size known yet (symbolic shapes): this call allocates
    first.place(torch.zeros(16))
    pool.finished(first)
    a = pool.lease()
    kept = a.place(torch.zeros(16))
    pool.finished(a)
    b = pool.lease()  # a's value is still held (its backward has not run): another buffer
    assert b.arena is not a.arena and len(made) == 2
    pool.finished(b)
    alias = kept[2:]  # any view or alias keeps the memory taken
    del kept
    assert pool.lease().arena is b.arena
    del alias
    c = pool.lease()
    assert c.arena in (a.arena, b.arena) and len(made) == 2 and pool.stats.arenas_made == 2


def _train(model, budget, batches, reference=None, **options):
    ctor_loss = REFERENCE_MODELS["mlp"][2]
    step, _ = make_training_step(model, ctor_loss)
    compiled = torch.compile(step, backend="megatrain", options={
        "device": "cpu", "lowering": "eager", "memory_budget": budget, "recompute": "never", **options})
    eager = make_training_step(reference, ctor_loss)[0] if reference is not None else None
    for x, y in batches:
        got = compiled(x, y)
        if eager is not None:
            torch.testing.assert_close(got, eager(x, y), rtol=1e-5, atol=0)


def _with_arena(programs):
    return [p for p in programs if p.arena_pool is not None]


def test_a_step_that_offloads_writes_one_exact_buffer_and_trains_like_eager(monkeypatch):
    _, make_batch, _ = REFERENCE_MODELS["mlp"]
    gen = torch.Generator().manual_seed(1)
    batches = [make_batch(gen) for _ in range(4)]
    torch.manual_seed(0)
    with pytest.raises(megacompile.BudgetError) as e:
        _train(MLP(), 1024, batches[:1])
    torch._dynamo.reset()
    programs = record_programs(monkeypatch)
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    _train(model, e.value.minimum_budget, batches, reference)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)

    (program,) = _with_arena(programs)
    offloads = [i for i in program.instructions if getattr(i, "to_arena", False)]
    assert offloads, "the minimum budget offloads activations"
    stats = program.arena_pool.stats
    assert stats.arenas_made == 1 and stats.spilled == 0 and stats.placed == len(offloads) * len(batches)
    # Exactly the offloaded bytes, each rounded up to ALIGN.
    traced = [n.args[0].meta["val"] for n in program.gm.graph.nodes if n.name in {i.name for i in offloads}]
    exact = sum(t.numel() * t.element_size() for t in traced)
    assert program.arena_pool.nbytes == arena_bytes(traced) < exact + ALIGN * len(traced)
    report = megacompile.last_report()
    assert report.offload_arena_bytes == get_device("cpu").host_buffer_bytes >= program.arena_pool.nbytes
    assert "offload arenas" in str(report)


def _mlp_pair_and_batches(n: int):
    """The reference MLP, an identical copy, and ``n`` batches."""
    _, make_batch, _ = REFERENCE_MODELS["mlp"]
    gen = torch.Generator().manual_seed(1)
    batches = [make_batch(gen) for _ in range(n)]
    torch.manual_seed(0)
    model = MLP()
    return model, copy.deepcopy(model), batches


def test_two_forwards_before_their_backwards_use_two_buffers(monkeypatch):
    """Micro-batches whose forwards all run first: the second forward may not overwrite the
    first one's saved activations, so it takes a buffer of its own; gradients equal eager, and
    both forwards' held bytes stay within the budget they were planned for."""
    loss_fn = REFERENCE_MODELS["mlp"][2]
    model, reference, batches = _mlp_pair_and_batches(2)

    def loss_of(m, x, y):
        return loss_fn(m(x), y)

    # Planned for both forwards before the backward (the second runs beside what the first
    # holds until then), at the smallest budget that fits them: the plan offloads.
    options = {"device": "cpu", "lowering": "eager", "recompute": "never", "calls_before_backward": 2}
    with pytest.raises(megacompile.BudgetError) as e:
        torch.compile(loss_of, backend="megatrain", options={**options, "memory_budget": 1024})(model, *batches[0])
    torch._dynamo.reset()
    programs = record_programs(monkeypatch)
    compiled = torch.compile(loss_of, backend="megatrain", options={**options,
                                                                     "memory_budget": e.value.minimum_budget})
    for _ in range(2):  # twice: the second round reuses the buffers the first one freed
        losses = [compiled(model, x, y) for x, y in batches]
        sum(losses).backward()
        sum(loss_of(reference, x, y) for x, y in batches).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        model.zero_grad()
        reference.zero_grad()
    report = megacompile.last_report()
    assert report.measured_peak_device_bytes <= e.value.minimum_budget, str(report)
    (program,) = _with_arena(programs)
    stats = program.arena_pool.stats
    assert stats.placed > 0 and stats.spilled == 0 and stats.arenas_made == 2


def test_landing_buffers_are_exact_and_reused_once_free():
    made = []

    def allocate(n):
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    landing = LandingBuffers(allocate)
    grad = torch.randn(8, 4).t()  # a transposed weight gradient: dense, not contiguous
    first = landing.take(grad)
    assert first.shape == grad.shape and first.stride() == grad.stride() and made == [128]
    second = landing.take(grad)  # the first is still held: another buffer
    assert made == [128, 128] and second.data_ptr() != first.data_ptr()
    ptr = first.data_ptr()
    del first
    gc.collect()
    again = landing.take(grad)  # free again: reused, no allocation
    assert again.data_ptr() == ptr and made == [128, 128] and landing.reused == 1
    assert landing.take(torch.randn(4, 6)[:, ::2]) is None  # gapped: the caller allocates
    assert landing.nbytes == 256


def test_gradients_land_in_buffers_reused_every_step(monkeypatch):
    """Where the device uses them (CUDA), every returned gradient's copy lands in an exact-size
    buffer, the same buffers each step once the last step's gradients are dropped
    (``zero_grad``), with training equal to eager. The stand-in runs the same program with
    them switched on."""
    device = get_device("cpu")
    landing = LandingBuffers(device.host_buffer)
    monkeypatch.setattr(device, "landing", landing)
    model, reference, batches = _mlp_pair_and_batches(3)
    budget = sum(p.numel() * p.element_size() for p in model.parameters())  # params stream: copies
    _train(model, budget, batches, reference)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    n = len(list(model.parameters()))
    # The first step made one buffer per gradient; the later ones reused them.
    assert landing.made == n and landing.reused == 2 * n
    assert megacompile.last_report().gradient_landing_bytes == landing.nbytes
