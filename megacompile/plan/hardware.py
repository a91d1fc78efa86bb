"""Hardware profiles: the numbers the planner's cost model is built on.

A `HardwareProfile` describes one GPU plus the host it sits in, because
MegaTrain-style training is bound as much by the host (where parameters,
gradients and optimizer state live) and the host<->device link as by the GPU.

The built-in profiles are plain data (`_BUILTIN_PROFILES` below). GPU numbers are
vendor datasheet values for *dense* math (no 2:4 sparsity); link numbers are what
pinned-memory copies actually achieve, not the PCIe/NVLink marketing peak; host
numbers are assumptions about a typical machine for that GPU, stated per profile.
`megacompile calibrate` (see calibrate.py) measures the current machine and writes
a JSON file that `get_profile(path)` accepts in place of a built-in name.

Units everywhere: FLOP/s, bytes, bytes/s, params/s.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

GiB = 1024**3
GB = 10**9
TB = 10**12
TFLOPS = 10**12

# AdamW on fp32 state touches 28 bytes per parameter: it reads param, grad, exp_avg
# and exp_avg_sq (4 x 4 B) and writes param, exp_avg and exp_avg_sq (3 x 4 B).
ADAMW_BYTES_PER_PARAM = 28


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    # Dense matmul throughput of the device. fp32 is plain (non-tensor-core, no TF32)
    # FP32; bf16 is tensor-core bf16 with fp32 accumulation, which is what autocast
    # and bf16 training use.
    device_flops_fp32: float
    device_flops_bf16: float
    # Device memory capacity as the vendor states it (the driver reserves a little,
    # ~1%; the planner should keep its own headroom).
    hbm_bytes: int
    hbm_bandwidth: float
    # Achievable pinned-memory copy bandwidth over the host<->device link, per direction.
    h2d_bandwidth: float
    d2h_bandwidth: float
    # STREAM-copy style host memory bandwidth (bytes read + bytes written per second).
    host_memory_bandwidth: float
    host_cores: int
    # Measured CPU AdamW throughput; None when unknown (see estimated_host_adamw_params_per_s).
    host_adamw_params_per_s: Optional[float] = None
    # Where the numbers come from: "vendor datasheet ...", "measured by calibrate ...".
    source: str = ""
    # Host RAM capacity; None when unknown. Parameters, gradients and optimizer state
    # all live here, so the planner needs it to reject models the host cannot hold.
    host_memory_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        positive = (
            "device_flops_fp32", "device_flops_bf16", "hbm_bytes", "hbm_bandwidth",
            "h2d_bandwidth", "d2h_bandwidth", "host_memory_bandwidth", "host_cores",
        )
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"hardware profile {self.name!r}: {field} must be a positive number, got {value!r}")
        for field in ("host_adamw_params_per_s", "host_memory_bytes"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"hardware profile {self.name!r}: {field} must be positive or None, got {value!r}")

    def estimated_host_adamw_params_per_s(self) -> float:
        """Measured AdamW throughput if known, else the host-memory-bandwidth bound.

        CPU AdamW over large tensors is memory bound, so bandwidth / 28 bytes per
        param is an upper bound; real fused kernels reach a good fraction of it.
        """
        if self.host_adamw_params_per_s is not None:
            return float(self.host_adamw_params_per_s)
        return self.host_memory_bandwidth / ADAMW_BYTES_PER_PARAM


# Host assumptions shared by several profiles. They are typical configurations, not
# measurements: replace them with `megacompile calibrate` on the real machine.
_HOST_DDR5_2S = dict(  # 2-socket Xeon Sapphire Rapids / EPYC Genoa class (e.g. DGX H100: 2x56 cores)
    host_memory_bandwidth=300 * GB, host_cores=112, host_memory_bytes=2048 * GiB,
)
_HOST_DDR4_2S = dict(  # 2-socket EPYC Rome/Milan class (e.g. DGX A100: 2x64 cores, 8ch DDR4-3200)
    host_memory_bandwidth=200 * GB, host_cores=128, host_memory_bytes=1024 * GiB,
)
_HOST_DESKTOP_DDR5 = dict(  # desktop, dual-channel DDR5 (e.g. Ryzen 9 7950X, 16 cores)
    host_memory_bandwidth=60 * GB, host_cores=16, host_memory_bytes=128 * GiB,
)
_HOST_DESKTOP_DDR4 = dict(  # desktop, dual-channel DDR4-3200 (e.g. Ryzen 9 5950X, 16 cores)
    host_memory_bandwidth=40 * GB, host_cores=16, host_memory_bytes=128 * GiB,
)

# Achievable pinned cudaMemcpy bandwidth per direction. Theoretical x16 peaks are
# ~63 GB/s (Gen5) and ~32 GB/s (Gen4); protocol overhead leaves roughly 80%.
_PCIE_GEN5 = 50 * GB
_PCIE_GEN4 = 25 * GB

_BUILTIN_PROFILES: dict[str, dict[str, Any]] = {
    "h100-sxm": dict(
        description="NVIDIA H100 SXM5 80GB (HBM3) on a PCIe Gen5 x16 host, 2-socket DDR5 server",
        device_flops_fp32=66.9 * TFLOPS, device_flops_bf16=989.4 * TFLOPS,
        hbm_bytes=80 * GiB, hbm_bandwidth=3.35 * TB,
        h2d_bandwidth=_PCIE_GEN5, d2h_bandwidth=_PCIE_GEN5,
        **_HOST_DDR5_2S,
        source="NVIDIA H100 datasheet (dense); PCIe Gen5 x16 achievable ~50 GB/s; host values assumed (2S DDR5 server)",
    ),
    "h100-pcie": dict(
        description="NVIDIA H100 PCIe 80GB (HBM2e), PCIe Gen5 x16, 2-socket DDR5 server",
        device_flops_fp32=51.2 * TFLOPS, device_flops_bf16=756.5 * TFLOPS,
        hbm_bytes=80 * GiB, hbm_bandwidth=2.0 * TB,
        h2d_bandwidth=_PCIE_GEN5, d2h_bandwidth=_PCIE_GEN5,
        **_HOST_DDR5_2S,
        source="NVIDIA H100 datasheet (dense); PCIe Gen5 x16 achievable ~50 GB/s; host values assumed (2S DDR5 server)",
    ),
    "h200": dict(
        description="NVIDIA H200 SXM 141GB (HBM3e), PCIe Gen5 x16 host, 2-socket DDR5 server",
        device_flops_fp32=66.9 * TFLOPS, device_flops_bf16=989.4 * TFLOPS,
        hbm_bytes=141 * GiB, hbm_bandwidth=4.8 * TB,
        h2d_bandwidth=_PCIE_GEN5, d2h_bandwidth=_PCIE_GEN5,
        **_HOST_DDR5_2S,
        source="NVIDIA H200 datasheet (dense, same compute as H100 SXM); PCIe Gen5 x16 achievable ~50 GB/s; "
               "host values assumed",
    ),
    "gh200": dict(
        description="NVIDIA GH200 Grace Hopper, 96GB HBM3, NVLink-C2C to a 72-core Grace CPU with LPDDR5X",
        device_flops_fp32=66.9 * TFLOPS, device_flops_bf16=989.4 * TFLOPS,
        hbm_bytes=96 * GiB, hbm_bandwidth=4.0 * TB,
        # NVLink-C2C is 900 GB/s total = 450 GB/s per direction peak; published
        # cudaMemcpy measurements land around 375-420 GB/s.
        h2d_bandwidth=400 * GB, d2h_bandwidth=400 * GB,
        host_memory_bandwidth=500 * GB, host_cores=72, host_memory_bytes=480 * GiB,
        source="NVIDIA GH200 datasheet (dense; NVLink-C2C 450 GB/s/dir peak, ~400 achievable assumed); "
               "Grace 72 cores, LPDDR5X ~500 GB/s",
    ),
    "a100-80gb": dict(
        description="NVIDIA A100 SXM4 80GB (HBM2e), PCIe Gen4 x16 host, 2-socket DDR4 server",
        device_flops_fp32=19.5 * TFLOPS, device_flops_bf16=312 * TFLOPS,
        hbm_bytes=80 * GiB, hbm_bandwidth=2.039 * TB,
        h2d_bandwidth=_PCIE_GEN4, d2h_bandwidth=_PCIE_GEN4,
        **_HOST_DDR4_2S,
        source="NVIDIA A100 datasheet (dense); PCIe Gen4 x16 achievable ~25 GB/s; host values assumed (2S DDR4 server)",
    ),
    "rtx-4090": dict(
        description="NVIDIA GeForce RTX 4090 24GB (GDDR6X), PCIe Gen4 x16, desktop DDR5 host",
        # GeForce cards run bf16/fp16 tensor math with fp32 accumulation at half the
        # rate of fp16 accumulation: 165 dense (330 is the fp16-accumulate figure).
        device_flops_fp32=82.6 * TFLOPS, device_flops_bf16=165.2 * TFLOPS,
        hbm_bytes=24 * GiB, hbm_bandwidth=1.008 * TB,
        h2d_bandwidth=_PCIE_GEN4, d2h_bandwidth=_PCIE_GEN4,
        **_HOST_DESKTOP_DDR5,
        source="NVIDIA Ada (AD102) whitepaper, bf16 with fp32 accumulate, dense; PCIe Gen4 ~25 GB/s; "
               "host values assumed (desktop)",
    ),
    "rtx-3090": dict(
        description="NVIDIA GeForce RTX 3090 24GB (GDDR6X), PCIe Gen4 x16, desktop DDR4 host",
        device_flops_fp32=35.6 * TFLOPS, device_flops_bf16=71 * TFLOPS,
        hbm_bytes=24 * GiB, hbm_bandwidth=936 * GB,
        h2d_bandwidth=_PCIE_GEN4, d2h_bandwidth=_PCIE_GEN4,
        **_HOST_DESKTOP_DDR4,
        source="NVIDIA Ampere (GA102) whitepaper, bf16 with fp32 accumulate, dense; PCIe Gen4 ~25 GB/s; "
               "host values assumed (desktop)",
    ),
    # The CPU stand-in lets the whole pipeline run without a GPU: the "device" is the
    # host CPU, "HBM" is a memory budget the planner pretends is device memory, and
    # the "link" is a memcpy between two host buffers. These defaults are rough
    # numbers for a small cloud VM; `megacompile calibrate` on the machine replaces them.
    "cpu-standin": dict(
        description="CPU stand-in: the host CPU plays the device; 'device memory' is an 8 GiB budget, "
                    "the link is host memcpy",
        device_flops_fp32=100e9, device_flops_bf16=50e9,
        hbm_bytes=8 * GiB, hbm_bandwidth=12 * GB,
        h2d_bandwidth=6 * GB, d2h_bandwidth=6 * GB,
        host_memory_bandwidth=12 * GB, host_cores=2,
        host_adamw_params_per_s=300e6, host_memory_bytes=16 * GiB,
        source="rough defaults for a 2-core VM; run `megacompile calibrate` to measure",
    ),
}


def known_profiles() -> list[str]:
    """Names of the built-in profiles, in declaration order."""
    return list(_BUILTIN_PROFILES)


def get_profile(name: str) -> HardwareProfile:
    """A built-in profile by name, or a profile JSON file (as written by calibrate) by path."""
    if name in _BUILTIN_PROFILES:
        return HardwareProfile(name=name, **_BUILTIN_PROFILES[name])
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            return profile_from_json(text)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path} is not a valid hardware profile JSON: {e}") from e
    hint = ""
    if name.endswith(".json") or os.sep in name:
        hint = f" (no such file: {path})"
    raise ValueError(
        f"unknown hardware profile {name!r}{hint}. Known profiles: {', '.join(known_profiles())}; "
        "or pass the path to a JSON profile written by `megacompile calibrate`."
    )


def profile_to_json(profile: HardwareProfile) -> str:
    """Serialize to a JSON object with one key per dataclass field."""
    return json.dumps(dataclasses.asdict(profile), indent=2, sort_keys=False) + "\n"


def profile_from_json(text: str) -> HardwareProfile:
    """Inverse of profile_to_json. Unknown keys are an error (they usually mean a typo)."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("a hardware profile JSON must be an object")
    fields = {f.name for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"unknown hardware profile fields: {', '.join(unknown)}")
    required = {f.name for f in dataclasses.fields(HardwareProfile)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise ValueError(f"hardware profile JSON is missing fields: {', '.join(missing)}")
    # JSON has no int/float distinction worth trusting; capacities and counts are ints.
    for key in ("hbm_bytes", "host_cores", "host_memory_bytes"):
        if isinstance(data.get(key), float) and data[key].is_integer():
            data[key] = int(data[key])
    return HardwareProfile(**data)
