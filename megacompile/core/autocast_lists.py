"""Tracing with CUDA's autocast op lists on host tensors.

megatrain traces a step on host tensors (the parameters live there) under
``torch.autocast("cpu", bfloat16)``, so CPU autocast's lists decide which ops run in bf16 and
which in fp32. CUDA's lists differ: on CUDA, ``softmax``, ``log_softmax``, ``layer_norm``,
``exp``, ``log``, ``pow``, ``rsqrt``, ``sum``, ``cumsum`` ... of a bf16 tensor run in fp32, and
``mv``, ``addmv``, ``einsum`` ... of fp32 tensors in bf16; CPU autocast leaves all of those
alone and casts others CUDA does not (``avg_pool3d``, ``stft``, linear algebra). A program
that runs on a GPU should compute what ``torch.autocast("cuda")`` computes, so
``cuda_autocast_lists()`` makes CPU autocast follow CUDA's lists for as long as it is entered:
it registers kernels at the ``AutocastCPU`` dispatch key (``torch.library``) that apply CUDA's
policy for each op CUDA autocast lists, and a fallthrough (no autocast) for each op only CPU
autocast lists. Everything is unregistered on exit, and only threads with CPU autocast
enabled are affected while it lasts.

The policies (what CUDA autocast does with an op's floating-point tensor arguments, float64
excepted), named as in PyTorch's AMP documentation:

- ``lower``: cast to the autocast dtype (matmuls, convolutions, RNN cells, attention);
- ``fp32``: cast to float32 (pointwise transcendental ops, norms, losses);
- ``fp32_set_opt_dtype``: reductions and softmaxes called without ``dtype=``: run with
  ``dtype=torch.float32`` when the first argument is a lower-precision float;
- ``promote``: cast every floating argument to the widest floating dtype among them;
- ``banned``: refuse (``binary_cross_entropy``: unsafe under autocast, use the with-logits form).

``KNOWN_CUDA_POLICIES``: the ops CUDA autocast lists in torch 2.11 to 2.13 (2.13 added
``rms_norm`` to fp32, dropped the ``Dimname`` overloads and ``_cudnn_rnn``); ``cuda_policies()``
keeps those this build lists, so a trace follows the lists of the torch that runs it.
``tests/test_autocast_lists.py`` checks that every listed op is known, and each policy against
CUDA autocast's own kernels on fake CUDA tensors: a release that changes the lists fails them.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Any, Callable, Iterator

import torch

from megacompile.core import torch_compat as compat

_LOWER = [
    "_convolution", "_convolution.deprecated", "convolution", "cudnn_convolution", "cudnn_convolution_transpose",
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
    "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
    "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention", "_cudnn_rnn",
]
_FP32 = [
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "rms_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    # norm without a dtype: CUDA calls its dtype overload with float32, the same as casting first.
    "norm.Scalar", "norm.ScalarOpt_dim", "norm.names_ScalarOpt_dim",
]
_FP32_SET_OPT_DTYPE = [
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
    "prod.dim_Dimname", "softmax.Dimname", "log_softmax.Dimname", "cumprod.dimname", "cumsum.dimname",
    "sum.dim_DimnameList",
]
_PROMOTE = [
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "scatter_add",
    "tensordot",
]
_BANNED = ["binary_cross_entropy"]

# "name.overload" (or "name" for the default overload) -> policy, for every op CUDA autocast
# lists in a supported release.
KNOWN_CUDA_POLICIES: dict[str, str] = {
    **{op: "lower" for op in _LOWER}, **{op: "fp32" for op in _FP32},
    **{op: "fp32_set_opt_dtype" for op in _FP32_SET_OPT_DTYPE}, **{op: "promote" for op in _PROMOTE},
    **{op: "banned" for op in _BANNED},
}


@functools.lru_cache(maxsize=None)
def cuda_policies() -> dict[str, str]:
    """The ops this torch build's CUDA autocast lists, with their policies."""
    listed = compat.ops_with_kernel_for("AutocastCUDA")
    return {op: policy for op, policy in KNOWN_CUDA_POLICIES.items() if f"aten::{op}" in listed}


def _eligible(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(fn, v) for v in value)
    return value


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    return []


def _kernel(op, policy: str) -> Callable:
    """The AutocastCPU kernel that applies CUDA's ``policy`` to ``op`` (an OpOverload)."""
    def cast_to(dtype: torch.dtype):
        return lambda t: t.to(dtype) if _eligible(t) and t.dtype != dtype else t

    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu")
        # Below autocast from here on: the op and the casts run as eager would run them.
        with torch.autocast("cpu", enabled=False):
            if policy == "lower":
                args, kwargs = _map_tensors(cast_to(dtype), args), _map_tensors(cast_to(dtype), kwargs)
            elif policy == "fp32":
                args = _map_tensors(cast_to(torch.float32), args)
                kwargs = {k: _map_tensors(cast_to(torch.float32), v) for k, v in kwargs.items()}
            elif policy == "fp32_set_opt_dtype":
                first = next(iter(_flat_tensors(args)), None)
                if first is not None and _eligible(first) and first.dtype != torch.float32 \
                        and kwargs.get("dtype") is None and _dtype_position(op) >= len(args):
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif policy == "promote":
                floats = [t for t in _flat_tensors([args, list(kwargs.values())]) if _eligible(t)]
                if floats:
                    widest = max((t.dtype for t in floats), key=lambda d: torch.finfo(d).bits)
                    args = _map_tensors(cast_to(widest), args)
                    kwargs = {k: _map_tensors(cast_to(widest), v) for k, v in kwargs.items()}
            elif policy == "banned":
                raise RuntimeError(
                    f"{op.name()} is unsafe to autocast (CUDA autocast refuses it): use "
                    f"binary_cross_entropy_with_logits (BCEWithLogitsLoss), or compute it outside autocast")
            return op(*args, **kwargs)

    return kernel


def _dtype_position(op) -> int:
    """The position of ``op``'s ``dtype`` argument (a dtype given positionally is the user's)."""
    for i, a in enumerate(op._schema.arguments):
        if a.name == "dtype":
            return i
    return 1 << 30


def _overload(qualified: str):
    name, _, overload = qualified.partition(".")
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


_LOCK = threading.Lock()
_DEPTH = 0
_LIBRARY = None


def _register() -> Any:
    library = torch.library.Library("aten", "IMPL")
    cpu_listed = compat.ops_with_kernel_for("AutocastCPU")
    policies = cuda_policies()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the point here
        for qualified, policy in policies.items():
            op = _overload(qualified)
            # Ops both lists name with one cast: CPU autocast's own kernel already does what CUDA's
            # does. (CPU casts prod and grid_sampler to fp32 and allows binary_cross_entropy: those differ.)
            if op is None or (policy in ("lower", "fp32") and f"aten::{qualified}" in cpu_listed):
                continue  # not in this release, or CPU autocast does the same already
            library.impl(qualified, _kernel(op, policy), "AutocastCPU")
        for name in sorted(cpu_listed):
            qualified = name.removeprefix("aten::")
            if name.startswith("aten::") and qualified not in policies:
                library.impl(qualified, torch.library.fallthrough_kernel, "AutocastCPU")
    return library


@contextlib.contextmanager
def cuda_autocast_lists() -> Iterator[None]:
    """While entered (re-entrant), CPU autocast follows CUDA autocast's op lists."""
    global _DEPTH, _LIBRARY
    with _LOCK:
        if _DEPTH == 0:
            _LIBRARY = _register()
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                compat.destroy_library(_LIBRARY)
                _LIBRARY = None


def autocast_lists_for(lists: str) -> contextlib.AbstractContextManager:
    """The context a trace under ``precision="bf16"`` runs in: ``"cuda"``: CUDA's lists; ``"cpu"``: as is."""
    return cuda_autocast_lists() if lists == "cuda" else contextlib.nullcontext()
