"""Fused host (CPU) Adam/AdamW step: Python side of ``runtime/csrc/host_adam.cpp``.

megacompile keeps parameters, gradients and optimizer state of large models in host
memory, so the optimizer step runs on the CPU. ``fused_adam_step`` updates a whole
parameter group in one pass over memory with a C++ kernel that is JIT-built (with
``torch.utils.cpp_extension.load``) on first use and cached on disk.

Numerics match ``torch.optim.Adam`` / ``torch.optim.AdamW`` with ``foreach=False``
(``_single_tensor_adam``) op for op; the only deliberate difference is that the kernel's
float32 sqrt is correctly rounded while ATen's (MKL) is not always, which moves a small
fraction of elements by about one ulp of their update. See the C++ file for details.

Instruction-set targets: the library is compiled without ``-march=native``; it holds the
loops once per target (on x86-64: ``"x86-64"`` baseline, ``"x86-64-v3"`` AVX2+FMA,
``"x86-64-v4"`` AVX-512; elsewhere ``"default"``) and uses the best one the running CPU
supports. All targets give bitwise the same results (only correctly rounded IEEE
operations); ``target=`` picks one explicitly, e.g. to test or benchmark it.

Public API: ``host_adam_available()`` (falsy with ``.reason`` where no kernel), ``load_extension``,
``library_path``, ``fused_adam_step`` and ``torch_fused_adam_step`` (torch's fused CPU op,
same signature).

The build cache lives in ``$TORCH_EXTENSIONS_DIR/<name>`` if that variable is set, else
``~/.cache/megacompile/torch_extensions/<name>``; ``<name>`` names the targets built in and
hashes the compiler flags, the sources, the architecture and the torch and Python versions.
The library does not depend on the CPU model, so one cache can serve every machine of an
architecture that shares a home directory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from megacompile.core import torch_compat as _torch_compat

__all__ = [
    "HostAdamStatus",
    "HostAdamUnavailable",
    "fused_adam_step",
    "host_adam_available",
    "library_path",
    "load_extension",
    "torch_fused_adam_step",
]

_SOURCE = Path(__file__).resolve().parent / "csrc" / "host_adam.cpp"
_OPS_NAMESPACE = "megacompile_host_adam"

_ISA_HEADER = _SOURCE.parent / "host_adam_isa.h"

# -ffp-contract=off: the kernel spells out every fma that ATen performs; letting the
# compiler contract other a*b+c patterns would change rounding vs torch.
# -fno-math-errno: lets std::sqrt become a vector sqrt instruction (it never sees a
# negative input here); neither this nor -fno-trapping-math changes any result.
# No -march: each instruction-set target is a function attribute in the source, so the
# library runs on any CPU of the architecture and picks its loops at run time.
_COMMON_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
# Fallback for a compiler that rejects the target attributes: the baseline loops alone.
_BASELINE_ONLY_CFLAGS = ["-DMEGACOMPILE_HOST_ADAM_BASELINE_ONLY"]


class HostAdamUnavailable(RuntimeError):
    """The host Adam kernel could not be built or loaded; the message says why.

    ``toolchain_missing`` is True when the cause is a missing compiler or ninja (an
    environment without build tools) rather than a failed compilation.
    """

    def __init__(self, message: str, toolchain_missing: bool = False):
        super().__init__(message)
        self.toolchain_missing = toolchain_missing


@dataclasses.dataclass(frozen=True)
class HostAdamStatus:
    """Result of :func:`host_adam_available`; truthy iff the kernel can be used."""

    available: bool
    reason: Optional[str] = None  # why not, when unavailable
    toolchain_missing: bool = False  # no compiler/ninja, as opposed to a build failure
    target: Optional[str] = None  # the instruction-set target fused_adam_step uses here
    compiled_targets: tuple[str, ...] = ()  # all targets in the library (most portable first)
    cpu_targets: tuple[str, ...] = ()  # those this CPU can execute

    def __bool__(self) -> bool:
        return self.available


_lock = threading.Lock()
_ops = None  # torch.ops.megacompile_host_adam once loaded
_error: Optional[HostAdamUnavailable] = None  # sticky: a failure is not retried in this process
_library: Optional[Path] = None  # the loaded shared library


def _build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "megacompile" / "torch_extensions"
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cflags(baseline_only: bool) -> list[str]:
    return _COMMON_CFLAGS + (_BASELINE_ONLY_CFLAGS if baseline_only else [])


def _targets_tag(baseline_only: bool) -> str:
    """The targets a build holds, for its name (the C++ file defines the same list)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "default"
    return "x86_64" if baseline_only else "x86_64_v3_v4"


def _extension_name(baseline_only: bool) -> str:
    # The header is not a `source` of the build, so torch's own change detection does not
    # see it: its content goes into the name (as does the .cpp's, for the same reason).
    key = "\n".join(
        [
            torch.__version__,
            sys.version.split()[0],
            platform.machine(),
            os.environ.get("CXX", "c++"),
            " ".join(_cflags(baseline_only)),
            hashlib.sha256(_SOURCE.read_bytes() + _ISA_HEADER.read_bytes()).hexdigest(),
        ]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"megacompile_host_adam_{_targets_tag(baseline_only)}_{digest}"


def _ensure_toolchain() -> None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise HostAdamUnavailable(
            f"no C++ compiler: {cxx!r} is not on PATH (set CXX or install g++/clang++) "
            "to build the host Adam kernel",
            toolchain_missing=True,
        )
    if shutil.which("ninja") is None:
        # The pip `ninja` package installs its binary next to the interpreter's scripts,
        # which is not on PATH when a venv's python is run without activating the venv.
        try:
            import ninja  # type: ignore[import-not-found]  # lazy: optional, only its path is wanted

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    if shutil.which("ninja") is None:
        raise HostAdamUnavailable(
            "ninja is required to build the host Adam kernel (pip install ninja)",
            toolchain_missing=True,
        )


def _build(baseline_only: bool, verbose: bool) -> Path:
    from torch.utils.cpp_extension import load  # lazy: imports setuptools; only a build needs it

    name = _extension_name(baseline_only)
    directory = _build_directory(name)
    library = directory / f"{name}.so"
    # A first build takes tens of seconds on a small machine, inside the user's first step:
    # say so on stderr (not a log: it must show without TORCH_LOGS). A cached one says nothing.
    first = not library.exists()
    if first:
        print(f"megatrain: building the host AdamW kernel (first use; cached in {directory.parent})...",
              file=sys.stderr, flush=True)
    started = time.perf_counter()
    load(
        name=name,
        sources=[str(_SOURCE)],
        extra_cflags=_cflags(baseline_only),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        # The ops register themselves with TORCH_LIBRARY; no Python module to import.
        is_python_module=False,
        verbose=verbose,
    )
    if first:
        print(f"megatrain: host AdamW kernel built in {time.perf_counter() - started:.0f} s", file=sys.stderr,
              flush=True)
    return library


def load_extension(verbose: bool = False):
    """Builds (first call on a machine) and loads the kernel; returns the op namespace.

    Raises :class:`HostAdamUnavailable` with the reason if it cannot be built. A failure is
    remembered for the life of the process so that callers can fall back cheaply.
    """
    global _ops, _error, _library
    if _ops is not None:
        return _ops
    with _lock:
        if _ops is not None:
            return _ops
        if _error is not None:
            raise HostAdamUnavailable(str(_error), _error.toolchain_missing)
        for path in (_SOURCE, _ISA_HEADER):
            if not path.is_file():
                _error = HostAdamUnavailable(f"kernel source not found: {path}")
                raise _error
        try:
            _ensure_toolchain()
        except HostAdamUnavailable as exc:
            _error = exc
            raise
        targets_error = None
        for baseline_only in (False, True):
            try:
                library = _build(baseline_only, verbose)
            except Exception as exc:  # compiler errors surface as RuntimeError/OSError
                if not baseline_only:
                    # A compiler that rejects the target attributes: the baseline loops
                    # alone are slower on wide-vector CPUs but still one pass over memory.
                    targets_error = exc
                    continue
                _error = HostAdamUnavailable(
                    "failed to build the host Adam kernel "
                    f"(with ISA targets: {targets_error}; baseline only: {exc})"
                )
                raise _error from exc
            _library = library
            break
        _ops = getattr(torch.ops, _OPS_NAMESPACE)
        return _ops


def library_path() -> Optional[Path]:
    """The loaded kernel library (after :func:`load_extension`), e.g. to inspect its code."""
    return _library


def host_adam_available(verbose: bool = False) -> HostAdamStatus:
    """Whether the kernel can be used, building it if needed (never raises)."""
    try:
        ops = load_extension(verbose=verbose)
    except HostAdamUnavailable as exc:
        return HostAdamStatus(False, str(exc), toolchain_missing=exc.toolchain_missing)
    cpu = tuple(ops.cpu_targets())
    return HostAdamStatus(
        True,
        None,
        target=cpu[-1],
        compiled_targets=tuple(ops.compiled_targets()),
        cpu_targets=cpu,
    )


StepsArg = Union[Sequence[torch.Tensor], Sequence[float], torch.Tensor, int, float]


def _check_lengths(params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError(
            "params, grads, exp_avgs and exp_avg_sqs must have the same length, got "
            f"{n}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}"
        )
    if not isinstance(steps, (int, float, torch.Tensor)) and len(steps) != n:
        raise ValueError(f"steps must be a number or have one tensor per param ({n}), got {len(steps)}")


def fused_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: StepsArg,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool = False,
    num_threads: Optional[int] = None,
    target: Optional[str] = None,
    bf16_copies: Optional[Sequence[torch.Tensor]] = None,
) -> None:
    """One Adam (``decoupled=False``) or AdamW (``decoupled=True``) update, in place.

    ``params``, ``exp_avgs``, ``exp_avg_sqs``: contiguous float32 CPU tensors (updated).
    ``grads``: contiguous CPU tensors of the same sizes, float32 or bfloat16 (a bf16 grad
    is widened exactly to float32; the state stays float32).
    ``steps``: either torch-style step tensors, one per param (one-element float32/64 CPU
    tensors; each is incremented in place first, exactly like ``state["step"]`` in
    torch.optim), or one such tensor shared by the whole group (incremented once), or a
    plain number: the 1-based index of this update, shared by all tensors (the caller
    counts; pass 1 on the first update), or a list of such numbers, one per tensor.
    Numbers are used as given; tensors are incremented first.
    ``weight_decay`` is decoupled (AdamW: ``p *= 1 - lr*wd``) or L2 (Adam: ``g += wd*p``).
    ``num_threads``: OpenMP threads; default torch.get_num_threads().
    ``target``: the instruction-set target to run (see the module docstring); default the
    best this CPU supports. A target the CPU cannot execute raises RuntimeError. The result
    does not depend on it.
    ``bf16_copies``: optional contiguous bfloat16 tensors, one per param, each rewritten
    with its updated param rounded to nearest even (``param.to(torch.bfloat16)``), chunk by
    chunk in the same pass over memory.

    Equivalent to ``torch.optim.AdamW/Adam(..., foreach=False).step()`` for those tensors
    (amsgrad, capturable and differentiable are not supported). Runs without the GIL.
    Raises :class:`HostAdamUnavailable` if the kernel cannot be built: check
    :func:`host_adam_available` first, or use :func:`torch_fused_adam_step`.
    """
    _check_lengths(params, grads, exp_avgs, exp_avg_sqs, steps)
    if len(params) == 0:
        return  # the dispatcher cannot pick a backend for empty tensor lists
    ops = load_extension()
    with torch.no_grad():
        if isinstance(steps, (int, float)):
            step_values = [float(steps)]
        elif isinstance(steps, torch.Tensor):
            step_values = ops.increment_steps([steps])  # one value broadcast to all
        elif all(isinstance(s, (int, float)) for s in steps):
            step_values = [float(s) for s in steps]
        else:
            step_values = ops.increment_steps(list(steps))
        ops.adam_step(
            list(params),
            list(grads),
            list(exp_avgs),
            list(exp_avg_sqs),
            step_values,
            float(lr),
            float(beta1),
            float(beta2),
            float(eps),
            float(weight_decay),
            bool(decoupled),
            bool(maximize),
            int(num_threads or 0),
            target or "",
            list(bf16_copies or ()),
        )


def torch_fused_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: StepsArg,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool = False,
    num_threads: Optional[int] = None,
    target: Optional[str] = None,
    bf16_copies: Optional[Sequence[torch.Tensor]] = None,
) -> None:
    """Fallback with :func:`fused_adam_step`'s signature on torch's fused CPU Adam.

    Same update rule, but torch's fused kernel rounds differently from the for-loop
    implementation (it is not bitwise equal to ``foreach=False``). ``num_threads`` and
    ``target`` are ignored (torch uses its intra-op pool and its own CPU dispatch).
    """
    del num_threads, target
    _check_lengths(params, grads, exp_avgs, exp_avg_sqs, steps)
    if len(params) == 0:
        return
    with torch.no_grad():
        if isinstance(steps, (int, float)):
            # The fused op reads the already-incremented step from a tensor.
            step_tensors = [torch.tensor(float(steps)) for _ in params]
        elif isinstance(steps, torch.Tensor):
            steps.add_(1)
            step_tensors = [steps] * len(params)
        elif all(isinstance(s, (int, float)) for s in steps):
            step_tensors = [torch.tensor(float(s)) for s in steps]
        else:
            step_tensors = list(steps)
            _torch_compat.foreach_add_(step_tensors, 1)
        grads = [g if g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(grads, params)]
        fused = _torch_compat.fused_adam_(decoupled)
        fused(
            list(params),
            grads,
            list(exp_avgs),
            list(exp_avg_sqs),
            [],
            step_tensors,
            lr=float(lr),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=float(weight_decay),
            eps=float(eps),
            amsgrad=False,
            maximize=bool(maximize),
        )
        for copy, p in zip(bf16_copies or (), params):
            copy.copy_(p)
