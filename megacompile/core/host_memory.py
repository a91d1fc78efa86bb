"""How much host memory is left: checked before megatrain allocates the optimizer's state, so a
host that cannot hold the training state gets an error naming the bytes instead of a visit
from the kernel's OOM killer."""
from __future__ import annotations

import os

from megacompile.core.errors import HostMemoryError
from megacompile.core.units import format_bytes

# MEGACOMPILE_HOST_MEMORY_CHECK=0 skips the check (e.g. where MemAvailable misleads: a cgroup
# limit below the machine's memory is not in it, swap is).
CHECK_ENV = "MEGACOMPILE_HOST_MEMORY_CHECK"


def available_host_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), or None
    where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_allocation(nbytes: int, what: str, advice: str | None = None) -> None:
    """Raises ``HostMemoryError`` if ``nbytes`` more host memory would not fit; call it before
    allocating anything. ``advice``: what to change, given the bytes available (default: free
    memory or train fewer parameters)."""
    if nbytes <= 0 or os.environ.get(CHECK_ENV) == "0":
        return
    available = available_host_bytes()
    if available is None or nbytes <= available:
        return
    raise HostMemoryError(
        f"megatrain: {what} needs {format_bytes(nbytes)} ({nbytes} bytes) more host memory, and only "
        f"{format_bytes(available)} is available (MemAvailable). Nothing was allocated and the parameters are "
        f"unchanged. {advice or 'Free host memory, train fewer parameters per process'}, or set {CHECK_ENV}=0 to "
        f"allocate anyway.", needed_bytes=nbytes, available_bytes=available)
