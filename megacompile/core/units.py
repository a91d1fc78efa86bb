"""Byte counts as people write them: ``parse_bytes("8GiB")``, ``format_bytes(3 << 20)``."""
from __future__ import annotations

import re

from megacompile.core.errors import OptionsError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(value: int | str, what: str = "memory_budget") -> int:
    """``4096``, ``"512MiB"``, ``"1.5 GB"`` -> bytes."""
    if isinstance(value, bool):
        raise OptionsError(f"{what} must be an int number of bytes or a string like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise OptionsError(f"{what} must be positive, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if n > 0:
                return n
        raise OptionsError(
            f"{what}={value!r} is not a size; use an int number of bytes or a string like "
            f"'512MiB', '8GiB' or '1.5GB' (units: {', '.join(u for u in _UNITS if u)})"
        )
    raise OptionsError(f"{what} must be an int number of bytes or a string like '8GiB', got {type(value).__name__}")


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable
