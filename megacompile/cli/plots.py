"""PNG pictures of a step: the device memory timeline and the runtime trace's lanes.

Drawn with matplotlib's Agg canvas on a ``Figure`` of its own (no pyplot: the process's
backend, a notebook's for instance, is left alone). The numbers come from ``plot_data``.
"""
from __future__ import annotations

import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from megacompile.cli.plot_data import Lane, MemoryTimeline, last_step_window, memory_timeline, read_trace, trace_lanes

_UNITS = (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10), ("B", 1))

# One colour per lane kind; a worker thread's track ("host optimizer [worker-1]") takes its lane's.
_LANE_COLOURS = {"graphs": "#9e9e9e", "compute": "#1f77b4", "h2d": "#2ca02c", "h2d enqueue": "#98df8a",
                 "d2h": "#d62728", "d2h enqueue": "#ff9896", "wait": "#ff7f0e", "evict": "#8c564b",
                 "host optimizer": "#9467bd", "host": "#e377c2"}


def _unit(max_bytes: float) -> tuple[str, int]:
    return next(((name, size) for name, size in _UNITS if max_bytes >= size), _UNITS[-1])


def _save(fig: Figure, path: str | os.PathLike) -> str:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def plot_memory_timeline(timeline: MemoryTimeline, path: str | os.PathLike) -> str:
    """Planned (and measured) device bytes per node, the budget, layers shaded, the peak marked."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax = fig.add_subplot()
    top = max([*timeline.planned, *(m for m in timeline.measured if m is not None), timeline.budget or 0, 1])
    unit, scale = _unit(top)
    xs = range(len(timeline.nodes))
    for n, (_, first, last) in enumerate(timeline.layers):
        ax.axvspan(first - 0.5, last + 0.5, color="#000000", alpha=0.05 if n % 2 else 0.11, linewidth=0)
    ax.step(xs, [b / scale for b in timeline.planned], where="mid", color="#1f77b4", label="planned")
    if timeline.is_measured:
        points = [(x, m / scale) for x, m in zip(xs, timeline.measured) if m is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], ".", color="#ff7f0e", markersize=2.5,
                label="measured (last run)")
    if timeline.budget:
        ax.axhline(timeline.budget / scale, color="#d62728", linestyle="--", linewidth=1,
                   label=f"budget {timeline.budget / scale:.3g} {unit}")
    if timeline.backward_start is not None:
        ax.axvline(timeline.backward_start - 0.5, color="#555555", linewidth=0.8)
        ax.text(timeline.backward_start, top / scale * 1.02, " backward", fontsize=8, va="bottom", color="#555555")
        ax.text(0, top / scale * 1.02, "forward", fontsize=8, va="bottom", color="#555555")
    peak = timeline.peak_bytes / scale
    ax.plot([timeline.peak_index], [peak], "v", color="#d62728", markersize=8,
            label=f"planned peak {peak:.3g} {unit} at {timeline.nodes[timeline.peak_index]}")
    # Layer names along the bottom, where there is room for them.
    width = max(len(timeline.nodes), 1)
    for layer, first, last in timeline.layers:
        if (last - first + 1) / width > 0.02:
            ax.text((first + last) / 2, 0, layer.split(".")[-1] if len(layer) > 12 else layer, fontsize=7,
                    ha="center", va="bottom", color="#333333", rotation=90 if (last - first + 1) / width < 0.06 else 0)
    ax.set_xlim(-0.5, width - 0.5)
    ax.set_ylim(0, top / scale * 1.12)
    ax.set_xlabel("node of the rewritten program (forward, then backward); shading: one layer")
    ax.set_ylabel(f"device memory live ({unit})")
    ax.set_title(f"{timeline.label}: device memory of one step (plan: {timeline.policy})", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, framealpha=0.9)
    return _save(fig, path)


def plot_trace_lanes(lanes: list[Lane], path: str | os.PathLike, title: str = "runtime lanes") -> str:
    """The trace's lanes as a Gantt chart: one row per track, one bar per event (milliseconds)."""
    if not any(lane.spans for lane in lanes):
        raise ValueError("the trace has no events to draw (was anything run inside trace_runtime?)")
    origin = min(s[0] for lane in lanes for s in lane.spans)
    span_ms = max((s[0] + s[1] - origin) / 1e3 for lane in lanes for s in lane.spans) or 1.0
    shortest = span_ms * 0.0015  # drawn at least about a pixel wide: a 1 ms update in a 10 s step stays visible
    fig = Figure(figsize=(11, 0.45 * len(lanes) + 1.4), layout="constrained")
    ax = fig.add_subplot()
    for row, lane in enumerate(lanes):
        colour = _LANE_COLOURS.get(lane.name.split(" [")[0], "#7f7f7f")
        bars = [((start - origin) / 1e3, max(duration / 1e3, shortest)) for start, duration, _ in lane.spans]
        # Program runs are separated by a white edge (a backward starts as its forward ends).
        edge = dict(edgecolor="white", linewidth=1.5) if lane.name == "graphs" else dict(edgecolor="none")
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colour, **edge)
    # The program runs are few and long: their names fit inside their bars.
    for row, lane in enumerate(lanes):
        if lane.name != "graphs":
            continue
        for start, duration, name in lane.spans:
            if duration / 1e3 > 0.12 * span_ms:
                ax.text((start - origin + duration / 2) / 1e3, row, name, ha="center", va="center", fontsize=8,
                        color="white")
    ax.set_yticks(range(len(lanes)), [lane.name for lane in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def write_pictures(records, directories: list[str], trace_path: str, out: str) -> list[str]:
    """``megacompile inspect --plot``: each graph's memory timeline as ``OUT/<directory>/memory.png``
    and the last step's lanes from the trace recorded while the script ran as
    ``OUT/runtime-lanes.png``; returns the paths written."""
    written = []
    for record, directory in zip(records, directories):
        if record.plan is not None and record.forward is not None:
            written.append(plot_memory_timeline(memory_timeline(record), os.path.join(out, directory, "memory.png")))
    trace = read_trace(trace_path)
    window = last_step_window(trace)
    lanes = trace_lanes(trace, window)
    if any(lane.spans for lane in lanes):
        title = "runtime lanes of the last step" if window is not None else "runtime lanes"
        written.append(plot_trace_lanes(lanes, os.path.join(out, "runtime-lanes.png"), title))
    return written
