"""Bad input reaches the user as an error that says what to change, and touches nothing.

Every case checks three things:
- the error type (``megacompile.BudgetError`` / ``OptionsError`` / ``PlacementError``, all
  ``ValueError``s, or ``UnsupportedStepError``, raised unwrapped by the compiled step rather than as Dynamo's
  ``BackendCompilerFailed``);
- that the message names the fix (the minimum budget, the valid option names or values,
  ``device='cpu'``, keep the model on the CPU);
- that the user's parameters, gradients and optimizer state are bitwise what they were
  before the failing call (the optimizer has taken one eager step first, so its state is
  not empty).

A graph the passes cannot rewrite (a higher-order op) is not an error: it warns once and
falls back to plain compilation, and training stays correct.

Everything runs on the CPU stand-in with ``lowering="eager"`` and small models.
"""
from __future__ import annotations

import copy
import gc
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference_models import MLP, REFERENCE_MODELS, make_training_step

import megacompile
from megacompile.backend import check_placement
from megacompile.core.units import parse_bytes
from megacompile.options import Options, parse_options

CPU_EAGER = {"device": "cpu", "lowering": "eager"}
VALID_OPTIONS = ("device", "memory_budget", "precision", "lowering", "prefetch_depth", "recompute", "disable_passes")




# --- helpers ------------------------------------------------------------------------------
def _mlp_setup(width: int = 64, depth: int = 6, out: int = 8, warm: bool = True):
    """The reference MLP, its AdamW step and a batch; one eager step taken so the
    optimizer state holds real tensors (exp_avg, exp_avg_sq, step)."""
    torch.manual_seed(0)
    model = MLP(width, depth, out)
    _, batch, loss_fn = REFERENCE_MODELS["mlp"]
    step, opt = make_training_step(model, loss_fn)
    g = torch.Generator().manual_seed(0)
    if width == 64 and out == 8:
        x, y = batch(g)
    else:
        x, y = torch.randn(4, width, generator=g), torch.randn(4, out, generator=g)
    if warm:
        step(x, y)
        assert opt.state_dict()["state"], "the warm-up step should have created optimizer state"
    return model, opt, step, x, y


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer):
    return (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(opt.state_dict()),
        [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
        # A compiled training graph gives the optimizer a step() Dynamo does not trace
        # (host_optimizer.take_step_out_of_trace); a failed compile must not.
        "step" in vars(opt),
        # The compile pauses Python's cycle collector (backend._cycle_collector_paused).
        gc.isenabled(),
    )


def _assert_bitwise_equal(a, b, path: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor became {type(b).__name__}"
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), f"{path}: dtype/shape/device changed"
        assert a.layout == b.layout, f"{path}: layout changed"
        if a.is_sparse:  # SGD's momentum from a sparse gradient
            a, b = a.coalesce().to_dense(), b.coalesce().to_dense()
        same = torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))
        assert same, f"{path}: values changed"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys changed"
        for k in a:
            _assert_bitwise_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: length changed"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _assert_unchanged(model, opt, before) -> None:
    _assert_bitwise_equal(before, _snapshot(model, opt))


def _compiled(step, **options):
    return torch.compile(step, backend="megatrain", options={**CPU_EAGER, **options})


# --- impossible budget ----------------------------------------------------------------------
def test_impossible_budget_says_the_minimum_and_the_minimum_works():
    model, opt, step, x, y = _mlp_setup()
    before = _snapshot(model, opt)

    with pytest.raises(megacompile.BudgetError) as excinfo:
        _compiled(step, memory_budget=1024)(x, y)
    err = excinfo.value
    # Unwrapped (not BackendCompilerFailed), and a ValueError like the other input errors.
    assert type(err) is megacompile.BudgetError
    assert isinstance(err, ValueError) and isinstance(err, megacompile.MegacompileError)
    assert isinstance(err.minimum_budget, int) and err.minimum_budget > 1024
    assert re.fullmatch(r"layers\.\d+|head", err.limiting_layer), err.limiting_layer
    message = str(err)
    assert str(err.minimum_budget) in message
    assert "memory_budget" in message and "at least" in message
    assert f"'{err.limiting_layer}'" in message
    _assert_unchanged(model, opt, before)

    # The number the error gave is enough: it compiles, runs, and stays under it.
    torch._dynamo.reset()
    compiled = _compiled(step, memory_budget=err.minimum_budget)
    for _ in range(2):
        # .item() drops the returned tensor at once: a loss held across the next step is
        # wrongly counted as device memory (see test_held_loss_is_not_device_memory).
        loss = compiled(x, y).item()
        assert torch.isfinite(torch.tensor(loss))
        report = megacompile.last_report()
        assert report is not None and report.memory_budget == err.minimum_budget
        assert report.measured_peak_device_bytes is not None
        # Exact: the CPU stand-in's arena counts exactly the planned live set.
        assert report.measured_peak_device_bytes <= err.minimum_budget, str(report)
        assert report.planned_peak_device_bytes <= err.minimum_budget


def test_held_loss_is_not_device_memory():
    """Inference glue (``loss.detach()``) loads its host input like any other graph, so a
    loss the user keeps is host memory and never counted as device memory."""
    model, opt, step, x, y = _mlp_setup(warm=False)
    compiled = _compiled(step)
    held = []
    for _ in range(2):
        held.append(compiled(x, y))  # the user keeps the returned (host) losses
    report = megacompile.last_report()
    assert report.measured_peak_device_bytes <= report.planned_peak_device_bytes, str(report)


# --- bad options ------------------------------------------------------------------------------
def test_unknown_option_lists_valid_names():
    model, opt, step, x, y = _mlp_setup()
    before = _snapshot(model, opt)
    with pytest.raises(megacompile.OptionsError) as excinfo:
        _compiled(step, foo=1)(x, y)
    err = excinfo.value
    assert isinstance(err, ValueError)
    message = str(err)
    assert "'foo'" in message
    for name in VALID_OPTIONS:
        assert name in message, f"valid option {name!r} not listed: {message}"
    _assert_unchanged(model, opt, before)


BAD_VALUES = [
    # (options, words the message must contain: the valid choices or the rule)
    ({"device": "tpu"}, ["'tpu'", "'cuda'", "'cpu'"]),
    ({"precision": "fp16"}, ["'fp16'", "'fp32'", "'bf16'"]),
    ({"lowering": "aot"}, ["'aot'", "'inductor'", "'eager'"]),
    ({"recompute": "sometimes"}, ["'sometimes'", "'auto'", "'always'", "'never'"]),
    ({"prefetch_depth": -1}, ["prefetch_depth=-1", "int >= 0"]),
    ({"prefetch_depth": True}, ["prefetch_depth=True", "int >= 0"]),
    ({"memory_budget": "lots"}, ["'lots'", "'512MiB'", "'8GiB'", "gib"]),
    ({"memory_budget": 0}, ["memory_budget", "positive"]),
    ({"memory_budget": -5}, ["memory_budget", "positive", "-5"]),
    ({"memory_budget": "12XB"}, ["'12XB'", "'8GiB'", "kib", "gb"]),
    ({"disable_passes": ["no_such_pass"]},
     ["no_such_pass", "annotate", "recompute", "stream_parameters", "offload_gradients"]),
    ({"disable_passes": ["recompute"]}, ["cannot switch off", "'recompute'", "stream_parameters", "offload_gradients"]),
    ({"disable_passes": ["annotate"]}, ["cannot switch off", "'annotate'"]),
]


@pytest.mark.parametrize("bad,words", BAD_VALUES, ids=[repr(b) for b, _ in BAD_VALUES])
def test_bad_option_value_names_valid_choices(bad, words):
    model, opt, step, x, y = _mlp_setup(width=16, depth=2, out=4)
    before = _snapshot(model, opt)
    with pytest.raises(megacompile.OptionsError) as excinfo:
        _compiled(step, **bad)(x, y)
    assert isinstance(excinfo.value, ValueError)
    message = str(excinfo.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"
    _assert_unchanged(model, opt, before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: device='cuda' is valid here")
def test_cuda_without_cuda_says_use_cpu():
    model, opt, step, x, y = _mlp_setup(width=16, depth=2, out=4)
    before = _snapshot(model, opt)
    with pytest.raises(megacompile.OptionsError) as excinfo:
        torch.compile(step, backend="megatrain", options={"device": "cuda", "lowering": "eager"})(x, y)
    message = str(excinfo.value)
    assert "device='cuda'" in message and "no CUDA" in message
    assert "use device='cpu'" in message
    _assert_unchanged(model, opt, before)
    # Without a device option a CUDA-less machine gets the CPU stand-in, not the error.
    assert parse_options({}).device == "cpu"


# --- parse_options / parse_bytes -----------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 * 2**20),
    ("1.5GB", 1_500_000_000),
    (4096, 4096),
    ("8GiB", 8 * 2**30),
    (" 2 kib ", 2 * 2**10),
    ("1.5 GB", 1_500_000_000),
    ("4096", 4096),
    ("100b", 100),
    ("3kb", 3000),
    ("2MB", 2_000_000),
    ("1TiB", 2**40),
    (".5KiB", 512),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("value", ["lots", "12XB", "", "GiB", "-1GiB", "0", "0.4B", 0, -5, True, False, 1.5, None, [1]])
def test_parse_bytes_rejects(value):
    with pytest.raises(megacompile.OptionsError) as excinfo:
        parse_bytes(value)
    assert "memory_budget" in str(excinfo.value)


def test_parse_options_table():
    default_device = "cpu" if not torch.cuda.is_available() else "cuda"
    assert parse_options(None) == parse_options({}) == Options(device=default_device)
    opts = parse_options({
        "device": "cpu", "memory_budget": "512MiB", "precision": "fp32", "lowering": "eager",
        "prefetch_depth": 0, "recompute": "always", "disable_passes": "stream_parameters",
    })
    assert opts == Options(device="cpu", memory_budget=512 * 2**20, precision="fp32", lowering="eager",
                           prefetch_depth=0, recompute="always", disable_passes=("stream_parameters",))
    assert parse_options({"device": "cpu", "memory_budget": None}).memory_budget is None
    both = ["stream_parameters", "offload_gradients"]
    assert parse_options({"device": "cpu", "disable_passes": both}).disable_passes == tuple(both)
    assert parse_options({"device": "cpu", "prefetch_depth": 3}).prefetch_depth == 3
    for bad, _ in BAD_VALUES:
        with pytest.raises(megacompile.OptionsError):
            parse_options({"device": "cpu", **bad})
    with pytest.raises(megacompile.OptionsError, match="valid options are: device, memory_budget"):
        parse_options({"device": "cpu", "budget": "1GiB"})


# --- parameters already on an accelerator ----------------------------------------------------
def test_parameter_off_host_is_a_placement_error():
    """A parameter that is not in host memory is refused with a message saying to keep
    the model on the CPU.

    This machine has no accelerator, so a ``meta`` parameter stands in for one on CUDA and
    ``check_placement`` (what the backend calls on every graph's inputs) is called directly.
    The real case, ``model.cuda()`` followed by a megatrain step, is exercised by
    ``benchmarks/gpu_smoke.py`` on a GPU machine.
    """
    model, opt, step, x, y = _mlp_setup(width=16, depth=2, out=4)
    before = _snapshot(model, opt)
    names = [n for n, _ in model.named_parameters()] + ["x"]
    inputs = list(model.parameters()) + [x]
    roles = ["param"] * (len(names) - 1) + ["input"]
    check_placement(inputs, names, roles)  # all on the host: fine

    off_host = nn.Parameter(torch.empty(2, device="meta"))
    inputs[2] = off_host
    with pytest.raises(megacompile.PlacementError) as excinfo:
        check_placement(inputs, names, roles)
    err = excinfo.value
    assert isinstance(err, ValueError)
    message = str(err)
    assert f"'{names[2]}'" in message and "meta" in message
    assert "Keep the model on the CPU" in message
    assert "model.to('meta')" in message
    # A user input off the host is allowed (only parameters are megatrain's to place).
    check_placement([torch.empty(2, device="meta")], ["x"], ["input"])
    _assert_unchanged(model, opt, before)


# --- sparse gradients -----------------------------------------------------------------------
class SparseLookup(nn.Module):
    def __init__(self, sparse: bool, bag: bool = False) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(50, 16, sparse=sparse) if bag else nn.Embedding(50, 16, sparse=sparse)
        self.bag = bag
        self.out = nn.Linear(16, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx) if self.bag else self.emb(idx).mean(1))


def _sgd_step(model: nn.Module):
    """SGD with momentum: it takes sparse gradients in eager PyTorch (Adam does not)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(idx, y):
        loss = F.mse_loss(model(idx), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step, opt


def _lookup_batches(n: int = 3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 50, (8, 3), generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding_bag"])
def test_sparse_embedding_gradient_is_refused_with_the_dense_equivalent(bag):
    """A trainable embedding with sparse=True (a recommender's) would get a sparse gradient of
    data-dependent size: refused before anything runs, naming the parameter and the dense
    equivalent, which trains like the sparse eager model."""
    torch.manual_seed(0)
    model = SparseLookup(sparse=True, bag=bag)
    step, opt = _sgd_step(model)
    idx, y = _lookup_batches(1)[0]
    step(idx, y)  # one eager step: optimizer state to keep
    before = _snapshot(model, opt)
    with pytest.raises(megacompile.UnsupportedStepError) as excinfo:
        _compiled(step)(idx, y)
    message = str(excinfo.value)
    assert "'emb.weight'" in message and "sparse=False" in message
    assert ("nn.EmbeddingBag" if bag else "nn.Embedding(") in message
    _assert_unchanged(model, opt, before)

    # What the message says: the dense model under megatrain trains like the sparse one in eager.
    torch.manual_seed(1)
    sparse_eager = SparseLookup(sparse=True, bag=bag)
    dense = SparseLookup(sparse=False, bag=bag)
    dense.load_state_dict(sparse_eager.state_dict())
    compiled, eager = _compiled(_sgd_step(dense)[0]), _sgd_step(sparse_eager)[0]
    for idx, y in _lookup_batches():
        torch.testing.assert_close(compiled(idx, y), eager(idx, y), rtol=1e-5, atol=0)
    for p, q in zip(dense.parameters(), sparse_eager.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_frozen_sparse_embedding_has_no_gradient_and_trains():
    torch.manual_seed(0)
    model = SparseLookup(sparse=True)
    model.emb.weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    compiled = _compiled(make_training_step(model, F.mse_loss)[0])
    eager = make_training_step(reference, F.mse_loss)[0]
    for idx, y in _lookup_batches():
        torch.testing.assert_close(compiled(idx, y), eager(idx, y), rtol=1e-5, atol=0)


# --- a graph the passes cannot rewrite -----------------------------------------------------
class CondNet(nn.Module):
    """A data-dependent branch through ``torch.cond`` (a higher-order op)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = torch.cond(x.sum() > 0, lambda t: torch.relu(t) * 2.0, lambda t: torch.tanh(t), (h,))
        return self.out(h)


def _train_cond(backend: str | None, steps: int = 3):
    torch.manual_seed(0)
    model = CondNet()
    step, _ = make_training_step(model, F.mse_loss)

    if backend is not None:
        step = torch.compile(step, backend=backend, options=CPU_EAGER if backend == "megatrain" else None)
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        shift = 3.0 if i % 2 == 0 else -3.0  # both branches run
        x = torch.randn(8, 16, generator=g) + shift
        y = torch.randn(8, 4, generator=g)
        losses.append(step(x, y).item())
    return losses, model.state_dict()


def test_higher_order_op_warns_once_and_stays_correct():
    eager_losses, eager_state = _train_cond(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, state = _train_cond("megatrain")
    ours = [w for w in caught if re.search(r"megatrain: .*higher-order op .*cond", str(w.message))]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert issubclass(ours[0].category, UserWarning)
    message = str(ours[0].message)
    assert "cannot rewrite" in message and "results stay correct" in message
    for a, b in zip(losses, eager_losses):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (losses, eager_losses)
    for name, value in eager_state.items():
        assert (state[name] - value).abs().max().item() <= 1e-5, name


# --- the cycle collector ---------------------------------------------------------------------
def test_the_cycle_collector_is_paused_while_compiling_and_left_as_the_user_had_it(monkeypatch):
    from megacompile import backend
    from megacompile.capture import training_compiler as capture

    seen_while_compiling: list[tuple[str, bool]] = []

    def recording(name):
        original = getattr(capture.TrainingCompiler, name)

        def record(self, *args, **kwargs):
            seen_while_compiling.append((name, gc.isenabled()))
            return original(self, *args, **kwargs)
        return record

    # The partition runs inside AOTAutograd's trace; the backward is lowered later, on the
    # first loss.backward().
    monkeypatch.setattr(capture.TrainingCompiler, "partition", recording("partition"))
    monkeypatch.setattr(backend, "lower_with", _recording_lowering(backend.lower_with, seen_while_compiling))
    assert gc.isenabled()
    try:
        for user_had_it_on in (True, False):
            torch._dynamo.reset()
            seen_while_compiling.clear()
            if not user_had_it_on:
                gc.disable()
            model, opt, step, x, y = _mlp_setup(warm=False)
            assert torch.isfinite(_compiled(step)(x, y))
            parts = {name for name, _ in seen_while_compiling}
            assert parts == {"partition", "forward", "backward"}, seen_while_compiling
            assert not any(enabled for _, enabled in seen_while_compiling), seen_while_compiling
            assert gc.isenabled() is user_had_it_on
    finally:
        gc.enable()


def _recording_lowering(lower_with, seen: list):
    """``capture.lower_with`` whose lowering also records whether the collector runs."""
    def recording_lower_with(options, device):
        lower = lower_with(options, device)

        def record(gm, *args, part, **kwargs):
            seen.append((part, gc.isenabled()))
            return lower(gm, *args, part=part, **kwargs)
        return record
    return recording_lower_with
