"""core/autocast_lists.py: tracing on host tensors with CUDA autocast's op lists.

The table of policies is checked two ways against this torch build: it names exactly the ops
CUDA autocast registers kernels for, and for each kind of op the emulation (CPU autocast
under ``cuda_autocast_lists()``) gives the dtypes CUDA autocast's own kernels give when run on
fake CUDA tensors (no GPU needed: the kernels are in every build; fake tensors allocate
nothing). Then a bf16 GPT trained by megatrain with ``autocast_lists="cuda"`` is bitwise equal
to eager under the same lists (and differs from CPU's lists: its softmax runs in fp32).
"""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from reference_models import REFERENCE_MODELS, make_training_step
from test_bf16 import _megatrain_optimizer_arithmetic

from megacompile.core import torch_compat as compat
from megacompile.core.autocast_lists import KNOWN_CUDA_POLICIES, cuda_autocast_lists, cuda_policies


def _b(dev, *shape):
    return torch.ones(*shape, device=dev, dtype=torch.bfloat16)


def _f(dev, *shape):
    return torch.ones(*shape, device=dev)


def _long(dev, n):
    return torch.zeros(n, dtype=torch.long, device=dev)


# name -> a call on tensors made on the given device: every policy, the ops the two lists
# treat differently (both ways), and ops neither lists.
CASES = {
    "softmax": lambda d: torch.softmax(_b(d, 4, 8), -1),
    "log_softmax": lambda d: F.log_softmax(_b(d, 4, 8), -1),
    "exp": lambda d: torch.exp(_b(d, 4)),
    "log": lambda d: torch.log(_b(d, 4)),
    "rsqrt": lambda d: torch.rsqrt(_b(d, 4)),
    "pow_scalar_exponent": lambda d: torch.pow(_b(d, 4), 2),
    "pow_tensors": lambda d: torch.pow(_b(d, 4), _b(d, 4)),
    "pow_scalar_base": lambda d: torch.pow(2, _b(d, 4)),
    "sum": lambda d: torch.sum(_b(d, 4, 8)),
    "sum_dim": lambda d: torch.sum(_b(d, 4, 8), dim=0),
    "sum_explicit_dtype": lambda d: torch.sum(_b(d, 4, 8), dtype=torch.bfloat16),
    "cumsum": lambda d: torch.cumsum(_b(d, 4, 8), 0),
    "prod": lambda d: torch.prod(_b(d, 4)),
    "prod_dim": lambda d: torch.prod(_b(d, 4, 8), 0),
    "layer_norm": lambda d: F.layer_norm(_b(d, 4, 8), (8,)),
    "group_norm": lambda d: F.group_norm(_b(d, 2, 4, 8), 2),
    "rms_norm": lambda d: F.rms_norm(_b(d, 4, 8), (8,)),
    "logsumexp": lambda d: torch.logsumexp(_b(d, 4, 8), 0),
    "softplus": lambda d: F.softplus(_b(d, 4)),
    "cosine_similarity": lambda d: F.cosine_similarity(_b(d, 4, 8), _b(d, 4, 8)),
    "vector_norm": lambda d: torch.linalg.vector_norm(_b(d, 4, 8)),
    "norm": lambda d: torch.norm(_b(d, 4, 8), 2, 0),
    "mse_loss": lambda d: F.mse_loss(_b(d, 4), _b(d, 4)),
    "cross_entropy": lambda d: F.cross_entropy(_b(d, 4, 8), _long(d, 4)),
    "mm": lambda d: torch.mm(_f(d, 4, 8), _f(d, 8, 4)),
    "mv": lambda d: torch.mv(_f(d, 4, 8), _f(d, 8)),
    "addmv": lambda d: torch.addmv(_f(d, 4), _f(d, 4, 8), _f(d, 8)),
    "addr": lambda d: torch.addr(_f(d, 4, 8), _f(d, 4), _f(d, 8)),
    "einsum": lambda d: torch.einsum("ij,jk->ik", _f(d, 4, 8), _f(d, 8, 4)),
    "matmul": lambda d: torch.matmul(_f(d, 4, 8), _f(d, 8, 4)),
    "linear": lambda d: F.linear(_f(d, 4, 8), _f(d, 3, 8), _f(d, 3)),
    "bmm": lambda d: torch.bmm(_f(d, 2, 4, 8), _f(d, 2, 8, 4)),
    "multi_dot": lambda d: torch.linalg.multi_dot([_f(d, 4, 8), _f(d, 8, 4), _f(d, 4, 2)]),
    "sdpa": lambda d: F.scaled_dot_product_attention(_f(d, 1, 2, 4, 8), _f(d, 1, 2, 4, 8), _f(d, 1, 2, 4, 8)),
    "addcmul": lambda d: torch.addcmul(_f(d, 4), _b(d, 4), _b(d, 4)),
    "atan2": lambda d: torch.atan2(_b(d, 4), _f(d, 4)),
    "dot": lambda d: torch.dot(_b(d, 4), _f(d, 4)),
    "scatter_add": lambda d: torch.scatter_add(_f(d, 4), 0, _long(d, 4), _b(d, 4)),
    "trace": lambda d: torch.trace(_b(d, 4, 4)),
    "stack": lambda d: torch.stack([_b(d, 4), _b(d, 4)]),
    "binary_cross_entropy": lambda d: F.binary_cross_entropy(_f(d, 4).sigmoid(), _f(d, 4)),
    "silu": lambda d: F.silu(_b(d, 4)),
    "tanh": lambda d: torch.tanh(_b(d, 4)),
}


def _dtypes(call, device: str):
    try:
        out = call(device)
    except RuntimeError:
        return "raises"
    return [t.dtype for t in (out if isinstance(out, (tuple, list)) else [out])]


def _under_cuda_autocast(call):
    """What CUDA autocast's own kernels make of ``call`` (on fake CUDA tensors)."""
    with compat.FakeTensorMode():
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        try:
            return _dtypes(call, "cuda")
        finally:
            torch.set_autocast_enabled("cuda", False)


def test_the_table_names_every_op_cuda_autocast_lists():
    """Every op this build's CUDA autocast lists has a known policy (a release that lists a new
    one fails here), and the policies in use are exactly those ops."""
    registered = compat.ops_with_kernel_for("AutocastCUDA")
    assert registered <= {f"aten::{op}" for op in KNOWN_CUDA_POLICIES}, sorted(
        registered - {f"aten::{op}" for op in KNOWN_CUDA_POLICIES})
    assert {f"aten::{op}" for op in cuda_policies()} == registered


def _cpu_has_kernel(call) -> bool:
    """False where this torch's CPU build has no kernel for the case's dtypes (torch 2.11: no
    bf16 trace): such a case says nothing about the lists."""
    try:
        call("cpu")
    except NotImplementedError:
        return False
    except RuntimeError:
        pass
    return True


def test_each_policy_does_what_cuda_autocast_does():
    differs_from_cpu = []
    cases = {name: call for name, call in CASES.items() if _cpu_has_kernel(call)}
    for name, call in cases.items():
        want = _under_cuda_autocast(call)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cpu = _dtypes(call, "cpu")
            with cuda_autocast_lists():
                got = _dtypes(call, "cpu")
        assert got == want, (name, got, want)
        if cpu != want:
            differs_from_cpu.append(name)
    # The cases CPU autocast alone gets wrong, both ways: fp32 on CUDA (softmax, norms, exp,
    # sums), bf16 on CUDA (mv, addmv, addr; trace, which only CPU casts), refused on CUDA (bce).
    assert {"softmax", "log_softmax", "layer_norm", "exp", "sum", "cumsum", "mv", "addr", "trace",
            "binary_cross_entropy"} & set(cases) <= set(differs_from_cpu), differs_from_cpu


def test_cpu_autocast_is_itself_again_outside():
    with cuda_autocast_lists(), cuda_autocast_lists():  # re-entrant
        pass
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(_b("cpu", 4), -1).dtype == torch.bfloat16
        assert torch.mv(_f("cpu", 4, 8), _f("cpu", 8)).dtype == torch.float32


def test_megatrain_trains_with_cuda_lists_like_eager_under_them():
    ctor, make_batch, loss_fn = REFERENCE_MODELS["gpt"]  # softmax over bf16 scores
    torch.manual_seed(0)
    model = ctor()
    reference, cpu_lists = copy.deepcopy(model), copy.deepcopy(model)
    step, _ = make_training_step(model, loss_fn)
    compiled = torch.compile(step, backend="megatrain", options={
        "device": "cpu", "lowering": "eager", "precision": "bf16", "autocast_lists": "cuda",
        "overlap_optimizer": True, "disable_passes": ["fuse_lm_head"]})
    ref_step, ref_opt = make_training_step(reference, loss_fn)
    cpu_step, cpu_opt = make_training_step(cpu_lists, loss_fn)
    _megatrain_optimizer_arithmetic(ref_opt)
    _megatrain_optimizer_arithmetic(cpu_opt)
    gen = torch.Generator().manual_seed(1)
    differs = 0
    for i in range(3):
        x, y = make_batch(gen)
        got = compiled(x, y)
        with cuda_autocast_lists(), torch.autocast("cpu", dtype=torch.bfloat16):
            want = ref_step(x, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            differs += cpu_step(x, y).item() != want.item()
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"step {i}: {m}")
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert differs == 3  # the lists mattered: CPU's run the softmax in bf16


def test_bad_autocast_lists_option_says_what_to_use():
    from megacompile.options import OptionsError, parse_options

    with pytest.raises(OptionsError, match="'device', 'cuda', 'cpu'"):
        parse_options({"autocast_lists": "rocm"})
    assert parse_options({"device": "cpu"}).traced_autocast_lists == "cpu"
    assert parse_options({"device": "cpu", "autocast_lists": "cuda"}).traced_autocast_lists == "cuda"


def test_a_steps_own_cuda_autocast_region_computes_what_it_computes_on_a_gpu():
    """A step written for a GPU, ``with torch.autocast("cuda", dtype=torch.bfloat16):`` around
    its forward, precision left at fp32: megatrain traces on host tensors, where CUDA autocast
    would cast nothing and the step would silently run in fp32. The region is traced as a CPU
    autocast region following CUDA's lists: bitwise eager under those lists, not fp32."""
    ctor, make_batch, loss_fn = REFERENCE_MODELS["gpt"]
    torch.manual_seed(0)
    model = ctor()
    reference, fp32 = copy.deepcopy(model), copy.deepcopy(model)
    step, _ = make_training_step(model, loss_fn, autocast="cuda")
    compiled = torch.compile(step, backend="megatrain", options={
        "device": "cpu", "lowering": "eager", "overlap_optimizer": True, "disable_passes": ["fuse_lm_head"]})
    ref_step, ref_opt = make_training_step(reference, loss_fn)
    _megatrain_optimizer_arithmetic(ref_opt)
    gen = torch.Generator().manual_seed(1)
    for i in range(3):
        x, y = make_batch(gen)
        got = compiled(x, y)  # (CPU-only torch warns that it disables CUDA autocast: not here)
        with cuda_autocast_lists(), torch.autocast("cpu", dtype=torch.bfloat16):
            want = ref_step(x, y)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"step {i}: {m}")
        if i == 0:
            with torch.no_grad():
                assert abs(got.item() - loss_fn(fp32(x), y).item()) > 1e-5  # bf16 really ran
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_a_model_called_inside_the_callers_cuda_autocast_computes_in_bf16():
    """``with torch.autocast("cuda"): out = compiled_model(x)`` in a GPU loop: Dynamo compiles
    the model without recording the caller's autocast. megatrain traces the whole graph as
    such a region (CUDA's lists), and its programs run with autocast off. The caller's CUDA
    autocast is set by hand here (on a CPU-only torch the context manager disables itself)."""
    ctor, make_batch, loss_fn = REFERENCE_MODELS["gpt"]
    torch.manual_seed(0)
    model = ctor()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="megatrain", options={
        "device": "cpu", "lowering": "eager", "disable_passes": ["fuse_lm_head"]})
    x, y = make_batch(torch.Generator().manual_seed(1))
    previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        logits = compiled(x)
    finally:
        torch.set_autocast_enabled("cuda", previous[0])
        torch.set_autocast_dtype("cuda", previous[1])
    loss = loss_fn(logits.float(), y)
    loss.backward()
    with cuda_autocast_lists(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits = reference(x)
    ref_loss = loss_fn(ref_logits.float(), y)
    ref_loss.backward()
    assert logits.dtype == torch.bfloat16  # the head ran in bf16, as on a GPU
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize("lists", ["cuda", "device"])
def test_a_callers_cpu_autocast_follows_the_devices_lists(lists):
    """A model called inside ``torch.autocast("cpu")`` (what accelerate wraps a host-side
    Trainer's forward in under ``bf16=True``): traced under that autocast with the lists the
    option names ("device" on the stand-in: CPU's), run with autocast off."""
    ctor, make_batch, loss_fn = REFERENCE_MODELS["gpt"]
    torch.manual_seed(0)
    model = ctor()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="megatrain", options={
        "device": "cpu", "lowering": "eager", "autocast_lists": lists, "disable_passes": ["fuse_lm_head"]})
    x, y = make_batch(torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = compiled(x)
    with cuda_autocast_lists() if lists == "cuda" else contextlib.nullcontext(), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits = reference(x)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    loss_fn(logits.float(), y).backward()
    loss_fn(ref_logits.float(), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
