"""What machine a benchmark ran on, for the header and file name of its results."""
from __future__ import annotations

import platform


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_result(text: str, name: str, out: str | None = None) -> str:
    """Print ``text`` and write it to ``out`` or ``benchmarks/results/<name>-<date>-cpu-<N>core<suffix>``."""
    import datetime
    import os

    print(text)
    path = out or os.path.join(os.path.dirname(__file__), "results", name.format(
        date=datetime.date.today(), cores=os.cpu_count()))
    with open(path, "w") as f:
        f.write(text + "\n")
    return path
