"""``trace_model``: k layers traced on the meta device, digested, checked to repeat, and the
last few kept for the process (a search's probes are planned again)."""
from __future__ import annotations

import collections
import json

from megacompile.cli.plan_command import DEFAULT_TRACED_LAYERS, PlanError
from megacompile.cli.plan_command.digest import Trace, _digest, _uniform_peak_at_depth, check_repeat
from megacompile.cli.plan_command.full_depth import evaluate
from megacompile.cli.plan_command.policy_capture import trace_policies
from megacompile.cli.presets import count_parameters
from megacompile.plan.cost_model import is_cpu_standin
from megacompile.plan.hardware import HardwareProfile

_TRACE_CACHE: "collections.OrderedDict[tuple, Trace]" = collections.OrderedDict()
_TRACE_CACHE_SIZE = 16


def trace_model(config: dict, profile: HardwareProfile, *, batch: int, seq_len: int, precision: str = "fp32",
                k: int = DEFAULT_TRACED_LAYERS, skip_if_keep_fits: int | None = None,
                token_chunks: int | None = None) -> Trace:
    """Trace k layers (on the meta device; bf16 on unwritten host weights) and digest the policies' programs.

    ``skip_if_keep_fits``: a device budget; if keeping every activation of all the model's
    layers fits it, only the keep plan is built (``Trace.complete`` is then False).
    ``token_chunks``: each layer's per-token runs in that many chunks (None: whole).
    The last few traces are cached in the process (a search's probes, planned again).
    """
    key = (json.dumps(config, sort_keys=True, default=str), profile, batch, seq_len, precision, k, token_chunks)
    cached = _TRACE_CACHE.get(key)
    if cached is not None:
        # A keep-only trace serves only budgets that keep fits.
        usable = cached.complete or skip_if_keep_fits is not None and evaluate(
            cached, {"keep": int(config["num_hidden_layers"])}).peak_bytes <= skip_if_keep_fits
        if usable:
            _TRACE_CACHE.move_to_end(key)
            return cached
    trace = _trace_model(config, profile, batch=batch, seq_len=seq_len, precision=precision, k=k,
                         skip_if_keep_fits=skip_if_keep_fits, token_chunks=token_chunks)
    _TRACE_CACHE[key] = trace
    while len(_TRACE_CACHE) > _TRACE_CACHE_SIZE:
        _TRACE_CACHE.popitem(last=False)
    return trace


def _trace_model(config: dict, profile: HardwareProfile, *, batch: int, seq_len: int, precision: str,
                 k: int, skip_if_keep_fits: int | None, token_chunks: int | None = None) -> Trace:
    if k < 2:
        raise ValueError("at least 2 traced layers are needed to check that the layers repeat")
    num_layers = int(config["num_hidden_layers"])
    keep_suffices = None
    if skip_if_keep_fits is not None:
        keep_suffices = lambda attempts, layers: (  # noqa: E731
            _uniform_peak_at_depth(attempts["keep"], layers, num_layers) <= skip_if_keep_fits)
    raw = trace_policies(config, num_layers=k, batch=batch, seq_len=seq_len, precision=precision,
                         keep_suffices=keep_suffices, token_chunks=token_chunks,
                         autocast_lists="cpu" if is_cpu_standin(profile) else "cuda")
    trace = _digest(raw, profile, k=k, batch=batch, seq_len=seq_len, precision=precision,
                    num_params_full=count_parameters(config))
    differ = check_repeat(trace)
    if differ:
        raise PlanError("the traced decoder layers are not identical, so their numbers cannot be "
                        "extrapolated to the full depth: " + "; ".join(differ))
    return trace
