"""``megacompile plot TRACE.json``: a runtime trace's lanes as a PNG (the row of ``cli.SUBCOMMANDS``).

    megacompile plot steps.json                     # -> steps.png
    megacompile plot steps.json --out lanes.png --last-step
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from megacompile.cli.plot_data import TraceError, last_step_window, read_trace, trace_lanes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE.json", help="a trace written by megacompile.trace_runtime(path)")
    parser.add_argument("--out", metavar="PNG", default=None, help="the picture to write (default: TRACE.png)")
    parser.add_argument("--last-step", action="store_true",
                        help="only the last training step (from its forward's start), not the whole trace")


def run(args: argparse.Namespace) -> int:
    def error(message: str) -> int:
        print(f"megacompile plot: error: {message}", file=sys.stderr)
        return 2

    if importlib.util.find_spec("matplotlib") is None:
        return error('plot needs the matplotlib package: pip install "megacompile[plot]"')
    try:
        trace = read_trace(args.trace)
    except TraceError as e:
        return error(str(e))
    window = last_step_window(trace) if args.last_step else None
    lanes = trace_lanes(trace, window)
    if not any(lane.spans for lane in lanes):
        return error(f"{args.trace!r} has no events: nothing ran inside trace_runtime(...)")
    from megacompile.cli import plots  # lazy: needs the optional matplotlib package

    out = args.out or os.path.splitext(args.trace)[0] + ".png"
    title = f"{os.path.basename(args.trace)}: runtime lanes" + (" of the last step" if window else "")
    print(f"wrote {plots.plot_trace_lanes(lanes, out, title)}")
    return 0


SUBCOMMAND = ("plot", "draw a runtime trace (megacompile.trace_runtime) as a PNG Gantt chart of its lanes",
              add_arguments, run)
