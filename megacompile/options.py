"""The backend's options, validated in one place.

``torch.compile(step, backend="megatrain", options={...})`` passes the dict here. An unknown
key or a bad value raises ``OptionsError`` (a ``ValueError``) naming the valid choices, before
any graph is touched.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import torch

from megacompile.core.errors import OptionsError
from megacompile.core.units import parse_bytes
from megacompile.passes import known_pass_names, optional_pass_names
from megacompile.plan.hardware import get_profile

DEVICES = ("cuda", "cpu")
PRECISIONS = ("fp32", "bf16")
LOWERINGS = ("inductor", "eager")
RECOMPUTE_POLICIES = ("auto", "always", "never")
SOLVER_NAMES = ("exact", "greedy")
PLAN_REPEATS = ("auto", "template", "flat")
# Set to "1" while `megacompile inspect` runs the user's script (a script can notice it, and
# the option `snapshots="auto"` reads it).
INSPECT_ENV = "MEGACOMPILE_INSPECT"

@dataclasses.dataclass(frozen=True)
class Options:
    device: str = "cuda"
    memory_budget: int | None = None  # bytes; None: the whole device
    # Most host bytes the runtime page-locks (pinned parameters, bf16 weight copies, landing
    # buffers); past it tensors stay pageable and their copies synchronous. None: no cap.
    # Process-wide: the smallest cap any compiled step gives wins.
    pinned_host_memory: int | None = None
    # Most bytes of activations a plan may put on the host (what the forward offloads for the
    # backward: offloaded values, streamed layers' inputs). The planner takes the fastest plan
    # within memory_budget that also keeps within this; 0: activations stay on the device (the
    # host holds the training state alone). None: no cap.
    host_activation_budget: int | None = None
    # "fp32": fp32 weights, gradients, optimizer states and compute. "bf16": compute under
    # torch.autocast(bfloat16); weights cross to the device in bf16 and gradients come back in
    # bf16, while fp32 master weights, fp32 gradients and fp32 optimizer states stay on the host.
    precision: str = "fp32"
    lowering: str = "inductor"
    # How many layers ahead parameters are loaded (1 = double buffering).
    prefetch_depth: int = 1
    # How many times one compiled graph may run before its backward: micro-batches whose
    # losses are summed before one backward(), a Python loop around a graph break (a mixture
    # of experts' code per expert). Each call holds what its backward reads until then, so each
    # graph is planned to fit this many calls' held bytes beside one call's peak.
    calls_before_backward: int = 1
    # "auto": the planner decides keep / offload / recompute per layer, only when saved
    # activations do not fit; "never": keep or offload only; "always": recompute every layer.
    recompute: str = "auto"
    # The planner's solver (see megacompile.plan.solvers).
    solver: str = "exact"
    # Hardware profile for the cost model: a built-in name or a calibrate JSON path; None
    # picks one for the device.
    hardware: str | None = None
    # How marked repeated layers are planned when saved activations do not fit: "template"
    # prices the candidates on short copies of the step and builds one over the full graph
    # (megacompile/plan/template_planner.py); "flat" builds every candidate over the full graph;
    # "auto": template from 8 chained repeated layers.
    plan_repeats: str = "auto"
    # Pass names to switch off, for bisecting (see megacompile.passes.PASS_ORDER).
    disable_passes: tuple[str, ...] = ()
    # Update each layer's parameters on a host thread as its gradients land, while the
    # backward goes on, where that is provably the same as eager (megacompile/optimizer/overlap.py).
    # "auto": on CUDA; off on the CPU stand-in, whose device lane computes on the very host
    # cores the updates would run on (there is nothing to overlap with).
    overlap_optimizer: bool | str = "auto"
    # Keep the text of every graph after every pass for `megacompile inspect` (the chosen plan
    # is then built with a lint after each pass, so a broken graph names its pass). Formatting
    # and linting the whole program after each pass was a tenth of a compile's growth per
    # layer. "auto": only while `megacompile inspect` runs the script.
    snapshots: bool | str = "auto"
    # Tokens per chunk of the fused LM head + loss (passes/fuse_lm_head.py; switched off by
    # disable_passes=["fuse_lm_head"]). "auto": as many as make 512 MiB of fp32 logits (a
    # power of two, at least 16; 1024 for a 128k vocabulary), and a head whose logits fit in
    # one chunk is not fused; an int: that many, and every recognised head is fused.
    head_chunk_tokens: int | str = "auto"
    # Chunks of tokens for the runs of per-token ops inside a layer (passes/chunk_tokens.py;
    # switched off by disable_passes=["chunk_tokens"]). "auto": the graph is left alone unless
    # the step does not fit memory_budget without it; then the planner picks the fewest chunks
    # whose plan fits. An int: every run is chunked into that many chunks.
    token_chunks: int | str = "auto"
    # Under autocast (precision="bf16", or the step's or its caller's torch.autocast): whose op
    # lists decide which ops run in bf16 and which in fp32 (core/autocast_lists.py). "device":
    # those of the device the program runs on (CUDA's on "cuda", so a step computes what
    # torch.autocast("cuda") computes; CPU's on the stand-in); "cuda" or "cpu": those, on any
    # device (the stand-in with CUDA's numerics). A torch.autocast("cuda") region follows
    # CUDA's lists whatever this says.
    autocast_lists: str = "device"
    # After each backward, return the C heap's freed pages to the OS on a background thread
    # (glibc's malloc_trim; runtime/host_heap.py): what the step allocated and freed on the host
    # would otherwise stay in the process (RSS). False: leave the heap to the allocator.
    release_host_heap: bool = True
    # How many layers the thread that drives the programs may run ahead of the device's
    # compute (runtime/host_lead.py): before it enqueues a layer's first compute with this many
    # layers outstanding, it waits for the device to reach the oldest. Bounds what the host
    # holds for work the GPU has not done (landing buffers for gradients) and keeps kernel
    # launches from blocking on a full CUDA launch queue. None: no bound. (CUDA only; the CPU
    # stand-in runs its work where it is issued.)
    host_lead_layers: int | None = 3
    # The step's backward is called with retain_graph=True: autograd then holds every saved
    # activation to the backward's end, so the planner prices the backward that way
    # (capture/retained_graph.py warns where a backward retains the graph without it).
    retain_graph: bool = False

    def fused_head_chunk_tokens(self, vocab: int) -> int:
        if self.head_chunk_tokens != "auto":
            return int(self.head_chunk_tokens)
        fitting = max(1, (512 << 20) // (4 * max(1, vocab)))
        return max(16, 1 << (fitting.bit_length() - 1))

    @property
    def keeps_snapshots(self) -> bool:
        if self.snapshots == "auto":
            return os.environ.get(INSPECT_ENV) == "1"
        return bool(self.snapshots)

    @property
    def overlaps_optimizer(self) -> bool:
        if self.overlap_optimizer == "auto":
            return self.device == "cuda"
        return bool(self.overlap_optimizer)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the graphs are traced under ``torch.autocast`` with (None: no autocast)."""
        return torch.bfloat16 if self.precision == "bf16" else None

    @property
    def traced_autocast_lists(self) -> str:
        """"cuda" or "cpu": the autocast op lists the step is traced with."""
        if self.autocast_lists == "device":
            return "cuda" if self.device == "cuda" else "cpu"
        return self.autocast_lists

    def hardware_profile(self) -> str:
        if self.hardware is not None:
            return self.hardware
        if self.device == "cpu":
            return "cpu-standin"
        name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
        for key, profile in (("gh200", "gh200"), ("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"),
                             ("a100", "a100-80gb"), ("4090", "rtx-4090"), ("3090", "rtx-3090")):
            if key in name:
                return profile
        return "h100-sxm"


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise OptionsError(f"option {key}={value!r} is not valid; choose one of {', '.join(map(repr, choices))}")
    return value


def parse_options(raw: Mapping[str, Any] | None) -> Options:
    raw = dict(raw or {})
    valid = [f.name for f in dataclasses.fields(Options)]
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise OptionsError(
            f"unknown megatrain option(s) {', '.join(map(repr, unknown))}; valid options are: {', '.join(valid)}"
        )
    kw: dict[str, Any] = {}
    if "device" in raw:
        kw["device"] = _choice("device", raw["device"], DEVICES)
    elif not torch.cuda.is_available():
        kw["device"] = "cpu"
    if kw.get("device", "cuda") == "cuda" and not torch.cuda.is_available():
        raise OptionsError(
            "option device='cuda' but no CUDA device is available here; use device='cpu' "
            "(the CPU stand-in runs the same streaming schedule with an accounted device arena)"
        )
    if raw.get("memory_budget") is not None:
        kw["memory_budget"] = parse_bytes(raw["memory_budget"])
    if raw.get("host_activation_budget") is not None:
        cap = raw["host_activation_budget"]
        none_on_host = cap == 0 and not isinstance(cap, bool)
        kw["host_activation_budget"] = 0 if none_on_host else parse_bytes(cap, "host_activation_budget")
    if raw.get("pinned_host_memory") is not None:
        cap = raw["pinned_host_memory"]
        # 0 is a cap too: pin nothing.
        pin_nothing = cap == 0 and not isinstance(cap, bool)
        kw["pinned_host_memory"] = 0 if pin_nothing else parse_bytes(cap, "pinned_host_memory")
    if "precision" in raw:
        kw["precision"] = _choice("precision", raw["precision"], PRECISIONS)
    if "autocast_lists" in raw:
        kw["autocast_lists"] = _choice("autocast_lists", raw["autocast_lists"], ("device", "cuda", "cpu"))
    if "lowering" in raw:
        kw["lowering"] = _choice("lowering", raw["lowering"], LOWERINGS)
    if "prefetch_depth" in raw:
        depth = raw["prefetch_depth"]
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise OptionsError(f"option prefetch_depth={depth!r} must be an int >= 0 (1 = double buffering)")
        kw["prefetch_depth"] = depth
    if "calls_before_backward" in raw:
        calls = raw["calls_before_backward"]
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
            raise OptionsError(f"option calls_before_backward={calls!r} must be an int >= 1 (how many times a "
                               f"compiled graph runs before its backward)")
        kw["calls_before_backward"] = calls
    if "recompute" in raw:
        kw["recompute"] = _choice("recompute", raw["recompute"], RECOMPUTE_POLICIES)
    if "solver" in raw:
        kw["solver"] = _choice("solver", raw["solver"], SOLVER_NAMES)
    if "plan_repeats" in raw:
        kw["plan_repeats"] = _choice("plan_repeats", raw["plan_repeats"], PLAN_REPEATS)
    if raw.get("hardware") is not None:
        try:
            get_profile(raw["hardware"])
        except ValueError as e:
            raise OptionsError(f"option hardware={raw['hardware']!r}: {e}") from None
        kw["hardware"] = raw["hardware"]
    if "overlap_optimizer" in raw:
        if not isinstance(raw["overlap_optimizer"], bool) and raw["overlap_optimizer"] != "auto":
            raise OptionsError(f"option overlap_optimizer={raw['overlap_optimizer']!r} must be True, False or 'auto'")
        kw["overlap_optimizer"] = raw["overlap_optimizer"]
    if "release_host_heap" in raw:
        if not isinstance(raw["release_host_heap"], bool):
            raise OptionsError(f"option release_host_heap={raw['release_host_heap']!r} must be True or False")
        kw["release_host_heap"] = raw["release_host_heap"]
    if "retain_graph" in raw:
        if not isinstance(raw["retain_graph"], bool):
            raise OptionsError(f"option retain_graph={raw['retain_graph']!r} must be True or False")
        kw["retain_graph"] = raw["retain_graph"]
    if "host_lead_layers" in raw:
        lead = raw["host_lead_layers"]
        if lead is not None and (isinstance(lead, bool) or not isinstance(lead, int) or lead < 1):
            raise OptionsError(f"option host_lead_layers={lead!r} must be an int >= 1 (layers the host may run ahead "
                               f"of the device) or None (no bound)")
        kw["host_lead_layers"] = lead
    if "snapshots" in raw:
        if not isinstance(raw["snapshots"], bool) and raw["snapshots"] != "auto":
            raise OptionsError(f"option snapshots={raw['snapshots']!r} must be True, False or 'auto'")
        kw["snapshots"] = raw["snapshots"]
    if "head_chunk_tokens" in raw:
        chunk = raw["head_chunk_tokens"]
        if chunk != "auto" and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise OptionsError(f"option head_chunk_tokens={chunk!r} must be 'auto' or an int >= 1 (tokens per chunk "
                               f"of the fused LM head + loss)")
        kw["head_chunk_tokens"] = chunk
    if "token_chunks" in raw:
        chunks = raw["token_chunks"]
        if chunks != "auto" and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
            raise OptionsError(f"option token_chunks={chunks!r} must be 'auto' or an int >= 1 (chunks of tokens per "
                               f"run of per-token ops in a layer)")
        kw["token_chunks"] = chunks
    if "disable_passes" in raw:
        names = raw["disable_passes"]
        if isinstance(names, str):
            names = [names]
        known = known_pass_names()
        optional = optional_pass_names()
        bad = [n for n in names if n not in known]
        if bad:
            raise OptionsError(f"disable_passes names unknown pass(es) {bad}; passes are: {', '.join(known)}")
        required = [n for n in names if n not in optional]
        if required:
            raise OptionsError(
                f"disable_passes cannot switch off {required}: later passes depend on them; "
                f"passes that can be disabled: {', '.join(optional)}"
            )
        kw["disable_passes"] = tuple(names)
    return Options(**kw)
