"""What a thread pays to take the GIL back after a call that gave it up, while another thread
runs Python: the host optimizer's worker does this after every blocking CUDA call
(``Event.synchronize``, a kernel run through ``torch.ops``) while the thread that drives the
programs issues the next layers. ``Event.query`` keeps the GIL and pays nothing.

``time.sleep(0)`` stands for a call that gives the GIL up and returns at once (an event that
has already happened); the other thread spins in Python. For each switch interval
(``sys.setswitchinterval``; Python's default is 5 ms) it prints the mean cost of one give-up
and take-back, then of a call that keeps the GIL.

    python benchmarks/gil_handback.py
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import cpu_model, write_result  # noqa: E402


def _per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(interval: float, calls: int = 200) -> tuple[float, float]:
    """(seconds per give-up-and-take-back, seconds per call that keeps the GIL) while another
    thread runs Python, at this switch interval."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    other = threading.Thread(target=spin, daemon=True)
    other.start()
    try:
        time.sleep(0.05)  # the other thread is running
        return _per_call(lambda: time.sleep(0), calls), _per_call(lambda: None, calls)
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(previous)


def main() -> None:
    lines = [f"GIL take-back while another thread runs Python  {datetime.datetime.now():%Y-%m-%d %H:%M}",
             f"command: python {' '.join(sys.argv)}",
             f"cpu: {cpu_model()}, {os.cpu_count()} logical; python {platform.python_version()}",
             "", "switch interval   give up + take back   keep the GIL"]
    alone = _per_call(lambda: time.sleep(0), 2000)
    for interval in (0.005, 0.001, 0.0005):
        back, keep = measure(interval)
        lines.append(f"{interval * 1e3:11.1f} ms   {back * 1e3:16.3f} ms   {keep * 1e6:9.3f} us")
    lines.append(f"(no other thread: give up + take back {alone * 1e6:.1f} us)")
    write_result("\n".join(lines), "gil_handback-{date}-cpu-{cores}core.txt")


if __name__ == "__main__":
    main()
