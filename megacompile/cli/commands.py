"""The ``megacompile`` command line.

    megacompile inspect train.py --steps 2            # run a script, print what megatrain compiled
    megacompile inspect --out dump/ train.py          # ... and write one file per pass snapshot
    megacompile inspect --format json -m examples.train_llama --steps 1
    megacompile inspect --format onnx --out dump/ train.py  # the rewritten programs as ONNX models
    megacompile inspect --plot --out dump/ train.py   # ... and PNGs: memory timeline, runtime lanes
    megacompile plot steps.json                       # a runtime trace's lanes as a PNG
    megacompile calibrate --quick                     # measure this machine's hardware profile
    megacompile --version

Subcommands are rows of ``SUBCOMMANDS``: a name, a one-line help, a function that adds the
subcommand's arguments to its argparse parser, and a function that runs it and returns the
exit code. Adding a subcommand is one row there.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import runpy
import sys
import traceback
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, NamedTuple, Sequence

from megacompile.capture.records import recording
from megacompile.cli import plot_command
from megacompile.cli.plan_command import command as plan_command
from megacompile.core import torch_compat as _torch_compat
from megacompile.core.units import format_bytes

# Set to "1" while `inspect` runs the user's script, so a script can notice it (for instance to
# run one step instead of a hundred); the graphs then keep their per-pass snapshots
# (option snapshots="auto").
from megacompile.options import INSPECT_ENV
from megacompile.passes import known_pass_names
from megacompile.plan import calibrate
from megacompile.report import last_report
from megacompile.runtime.trace import trace_runtime

PROG = "megacompile"


# --- megacompile inspect --------------------------------------------------------------------

GRAPH_KINDS = ("joint", "forward", "backward", "inference", "optimizer", "host")
FORMATS = ("text", "json", "onnx")


_INSPECT_EPILOG = """\
Options of inspect may come before SCRIPT or among the script's arguments; every other
argument after SCRIPT goes to the script. After a `--`, everything goes to the script (use it
when the script has an option named --out, --format or --stage).

--stage NAME selects snapshots; NAME is a graph (dynamo, joint, forward, backward, inference,
optimizer, host), a stage (captured or a pass name), or GRAPH/STAGE. Repeat it, or separate
names with commas, to select more.

Text output: without --out, every snapshot is printed; with --out DIR they are written to
DIR/<graph-label>/<NN>-<graph>-<stage>.py (NN = position in that graph's pipeline) and
DIR/summary.txt, and only the summary is printed. JSON output: printed, or written to
DIR/inspect.json with --out. ONNX output (needs --out and the onnx package, pip install
"megacompile[onnx]"): each rewritten program as DIR/<graph-label>/{forward,backward}.onnx,
viewable in Netron; megatrain's memory ops are nodes of the domain "megatrain".

--plot (needs --out and matplotlib, pip install "megacompile[plot]") records a runtime trace
while the script runs (DIR/runtime-trace.json) and draws DIR/<graph-label>/memory.png (device
memory per node: planned, measured where measured, the budget, layers, the peak) and
DIR/runtime-lanes.png (the last step's lanes). Files an earlier run left in DIR stay; summary.txt lists this
run's. The script's own stdout is sent to stderr, so inspect's stdout holds only its output.
"""


def _add_inspect_options(parser: argparse.ArgumentParser) -> None:
    # Kept apart from the positional so the options that follow SCRIPT can be parsed with the
    # same definitions (see _take_inspect_options).
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="write the output under DIR instead of printing all of it")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="text (default), json, or onnx (one model per program; needs --out)")
    parser.add_argument("--plot", action="store_true", default=None,
                        help="also draw PNGs of the memory timeline and the runtime lanes (needs --out)")
    parser.add_argument("--stage", metavar="NAME", action="append", default=None,
                        help="only these snapshots (repeatable; see below)")


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    # argparse would print the REMAINDER positional as "..."; spell it out.
    parser.usage = ("%(prog)s [-h] [--out DIR] [--format {text,json,onnx}] [--plot] [--stage NAME] [-m] "
                    "SCRIPT [ARGS ...]")
    parser.epilog = _INSPECT_EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    _add_inspect_options(parser)
    parser.add_argument("-m", dest="as_module", action="store_true",
                        help="SCRIPT is a module name, run like `python -m SCRIPT`")
    # REMAINDER: once SCRIPT is seen, argparse stops interpreting options, so the script's
    # own options reach it untouched; inspect's options among them are picked out later.
    parser.add_argument("target", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS ...]",
                        help="the training script (a path, or a module with -m) and its arguments")


class _UsageError(Exception):
    """A mistake in the command line: printed with the usage hint, exit code 2."""


class _LateOptionParser(argparse.ArgumentParser):
    """Parses inspect's options found after SCRIPT; raises instead of exiting on a mistake."""

    def error(self, message: str):
        raise _UsageError(message)


def _take_inspect_options(tokens: list[str]) -> tuple[list[str], list[str]]:
    """Splits the arguments after SCRIPT into (inspect's options, the script's arguments)."""
    takes_value = {"--out", "--format", "--stage"}
    flags = {"--plot"}
    ours: list[str] = []
    theirs: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":
            theirs.extend(tokens[i + 1:])
            break
        name = tok.split("=", 1)[0]
        if tok in flags:
            ours.append(tok)
        elif name in takes_value:
            ours.append(tok)
            if "=" not in tok:
                if i + 1 >= len(tokens):
                    raise _UsageError(f"{tok} needs a value")
                ours.append(tokens[i + 1])
                i += 1
        else:
            theirs.append(tok)
        i += 1
    return ours, theirs


def _parse_stage_filters(names: Sequence[str] | None) -> list[tuple[str | None, str | None]] | None:
    """``--stage`` values -> (graph, stage) pairs, None meaning any; None when no filter."""
    if not names:
        return None

    stages = ["captured", *known_pass_names()]
    filters = []
    for raw in names:
        for name in filter(None, (n.strip() for n in raw.split(","))):
            graph, sep, stage = name.partition("/")
            if sep:
                if graph not in GRAPH_KINDS or stage not in stages:
                    raise _UsageError(
                        f"--stage {name!r}: GRAPH/STAGE needs a graph from {', '.join(GRAPH_KINDS)} "
                        f"and a stage from {', '.join(stages)}"
                    )
                filters.append((graph, stage))
            elif name in GRAPH_KINDS:
                filters.append((name, None))
            elif name in stages:
                filters.append((None, name))
            else:
                raise _UsageError(
                    f"--stage {name!r} is neither a graph ({', '.join(GRAPH_KINDS)}) nor a stage "
                    f"({', '.join(stages)})"
                )
    return filters


def _selected(snapshot, filters) -> bool:
    if filters is None:
        return True
    return any((g is None or g == snapshot.graph) and (s is None or s == snapshot.stage) for g, s in filters)


class ScriptFailed(Exception):
    """The user's script raised or exited non-zero; the message says how."""


@contextlib.contextmanager
def _script_environment(argv: list[str], path_entry: str):
    """sys.argv, sys.path[0] and the environment as ``python SCRIPT ARGS`` would see them.

    Everything is put back afterwards: inspect also runs in-process (tests, notebooks).
    """
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    saved_env = os.environ.get(INSPECT_ENV)
    sys.argv = argv
    sys.path.insert(0, path_entry)
    os.environ[INSPECT_ENV] = "1"
    try:
        # The script's prints go to stderr so that inspect's stdout (JSON in particular) is
        # only inspect's output.
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if saved_env is None:
            os.environ.pop(INSPECT_ENV, None)
        else:
            os.environ[INSPECT_ENV] = saved_env


def _user_traceback(exc: BaseException):
    """The traceback from the user's code on: the frames of this file and runpy are noise."""
    # By module rather than file name: runpy's frames may be frozen ("<frozen runpy>").
    ours = {__name__, runpy.__name__}
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in ours:
        tb = tb.tb_next
    return tb or exc.__traceback__


def run_script(target: str, args: list[str], as_module: bool) -> None:
    """Runs the user's script as ``__main__``; raises ScriptFailed if it fails."""
    if as_module:
        # Like `python -m`: the module is looked up from the current directory first.
        path_entry = os.getcwd()
        sys.path.insert(0, path_entry)
        try:
            spec = importlib.util.find_spec(target)
        except (ImportError, ValueError) as e:
            raise _UsageError(f"cannot import module {target!r}: {e}") from None
        finally:
            sys.path.remove(path_entry)
        if spec is None:
            raise _UsageError(f"no module named {target!r} (run from the directory that contains it, "
                              f"or give a path instead of -m)")
        argv0 = spec.origin or target  # what sys.argv[0] is under `python -m`
    else:
        if not os.path.isfile(target):
            what = "is a directory, not a script" if os.path.isdir(target) else "does not exist"
            raise _UsageError(f"script {target!r} {what}")
        argv0, path_entry = target, os.path.dirname(os.path.abspath(target))

    with _script_environment([argv0, *args], path_entry):
        try:
            if as_module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except SystemExit as e:
            # A script may end with sys.exit(0) (argparse --help does too): that is success.
            if e.code not in (None, 0):
                detail = f"status {e.code}" if isinstance(e.code, int) else repr(e.code)
                raise ScriptFailed(f"the script exited with {detail}") from None
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001  (anything the user's code raises)
            traceback.print_exception(type(e), e, _user_traceback(e), file=sys.stderr)
            # The traceback above has the whole message; some (a backend failure embeds the
            # graph) run to pages, so the closing line keeps only its start.
            lines = [line for line in str(e).splitlines() if line.strip()]
            brief = " ".join(lines[:2])
            cut = len(lines) > 2 or len(brief) > 300
            brief = brief if len(brief) <= 300 else brief[:297] + "..."
            more = " (full message in the traceback above)" if cut else ""
            raise ScriptFailed(f"the script raised {type(e).__name__}: {brief}{more}") from None


# --- what the records hold, as text and as data ------------------------------------------------

def _slug(label: str) -> str:
    """A record label as a directory name: 'optimizer (host)' -> 'optimizer-host'."""
    return re.sub(r"[^a-z0-9_.]+", "-", label.lower()).strip("-") or "graph"


def _directory_names(records) -> list[str]:
    # Labels repeat (every optimizer graph is "optimizer (host)"); numbering the repeats in
    # compile order keeps the names unique. Training labels (graphN) count from a
    # process-wide counter, so under the console script (a fresh process) every run of the
    # same script gets the same names.
    names, seen = [], {}
    for record in records:
        base = _slug(record.label)
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
    return names


def _snapshot_filename(index: int, snapshot) -> str:
    return f"{index:02d}-{snapshot.graph}-{snapshot.stage}.py"


def _provenance(snapshot) -> str:
    if snapshot.stage == "untraced":
        return "not traced (runs on the host as one call)"
    if snapshot.stage == "captured":
        origin = "the host graph as Dynamo captured it" if snapshot.graph in ("optimizer", "host") \
            else "as Dynamo captured it, before AOTAutograd" if snapshot.graph == "dynamo" \
            else "as traced by AOTAutograd, before any pass"
        return f"captured ({origin})"
    return (f"pass {snapshot.stage}: created {snapshot.nodes_created} node(s), "
            f"erased {snapshot.nodes_erased}, took {snapshot.elapsed_ms:.2f} ms")


def _snapshot_header(label: str, index: int, snapshot) -> str:
    return f"{label} [{index:02d}] {snapshot.graph} / {snapshot.stage} -- {_provenance(snapshot)}"


def _options_line(options) -> str:

    budget = format_bytes(options.memory_budget) if options.memory_budget else "none"
    disabled = ",".join(options.disable_passes) or "none"
    return (f"device={options.device} lowering={options.lowering} memory_budget={budget} "
            f"recompute={options.recompute} prefetch_depth={options.prefetch_depth} "
            f"disable_passes={disabled}")


def _plan_reason(plan, options) -> str:
    if plan.reason:
        return plan.reason
    if plan.policy == "inference":
        return "inference graph: none of its outputs needs a gradient, so it has no backward and saves nothing"
    budget = options.memory_budget
    # capture.TrainingCompiler tries the policies the options allow, cheapest first, and
    # records a reason only when it had to move past the first; an empty reason means the
    # first one was taken.
    return (f"'{plan.policy}' is the first policy recompute={options.recompute!r} allows, and it fits "
            + ("(no memory_budget set)" if budget is None else "the memory_budget"))


def _plan_lines(record) -> list[str]:

    plan = record.plan
    if plan is None:
        return ["  plan         none: this graph runs on the host over host-resident state"]
    lines = [f"  plan         policy {plan.policy}, planned peak {format_bytes(plan.peak_bytes)}"
             f" (limited by layer '{plan.limiting_layer or '(glue)'}'), budget "
             f"{format_bytes(plan.budget) if plan.budget else 'none'}"]
    for name, est in (("forward", plan.forward), ("backward", plan.backward)):
        if est is not None:
            lines.append(f"  {name:<12} peak {format_bytes(est.peak_bytes)} at node {est.peak_node} "
                         f"(layer '{est.peak_layer or '(glue)'}'); live at start {format_bytes(est.start_bytes)}, "
                         f"at end {format_bytes(est.end_bytes)}")
    lines.append(f"  saved        {len(plan.saved_values)} value(s) for the backward; "
                 f"{len(plan.recomputed_ops)} op(s) recomputed")
    if plan.value_policy:
        counts: dict[str, int] = {}
        for decision in plan.value_policy.values():
            counts[decision] = counts.get(decision, 0) + 1
        lines.append("  activations  decided one by one: " + ", ".join(f"{d} {n}" for d, n in sorted(counts.items()))
                     + " (reasons in the program text: keep / offload / recompute: planner: ...)")
    if plan.resident:
        lines.append(f"  resident     {len(plan.resident)} parameter(s) kept on the device for the step: "
                     + ", ".join(plan.resident))
    lines.append(f"  reason       {_plan_reason(plan, record.options)}")
    return lines


def _record_summary(record, directory: str, snapshots: list[tuple[int, Any]]) -> str:

    lines = [f"{record.label}  (directory {directory}/)", f"  options      {_options_line(record.options)}"]
    lines += _plan_lines(record)
    if record.param_bytes_by_layer:
        params = ", ".join(f"{layer} {format_bytes(n)}" for layer, n in record.param_bytes_by_layer.items())
        lines.append(f"  parameters   {params}")
    by_graph: dict[str, list[str]] = {}
    for _, snap in snapshots:
        by_graph.setdefault(snap.graph, []).append(snap.stage)
    shown = "; ".join(f"{g}: {', '.join(stages)}" for g, stages in by_graph.items()) or "none selected"
    lines.append(f"  snapshots    {shown}")
    return "\n".join(lines)


def _plan_dict(record) -> dict | None:
    plan = record.plan
    if plan is None:
        return None
    data = plan.as_dict()
    data.update(peak_bytes=plan.peak_bytes, limiting_layer=plan.limiting_layer,
                reason=_plan_reason(plan, record.options))
    return data


def _report_for(records):
    """``last_report()`` when the last step ran one of these graphs, else None.

    The recorder is process-wide: in-process, a report from an earlier run must not be
    passed off as this script's.
    """

    report = last_report()
    labels = {r.label for r in records}
    if report is None or not labels.intersection(report.graphs):
        return None
    return report


@dataclasses.dataclass
class _Dump:
    """What one inspect run found, ready to print or write."""

    script: str
    records: list
    directories: list[str]
    selected: list[list[tuple[int, Any]]]  # per record: (index in its pipeline, snapshot)
    report: Any

    def summary(self, files: list[str] | None = None) -> str:
        parts = [f"megacompile inspect: {self.script}: megatrain compiled {len(self.records)} graph(s): "
                 + ", ".join(r.label for r in self.records)]
        parts += [_record_summary(r, d, s) for r, d, s in zip(self.records, self.directories, self.selected)]
        parts.append(str(self.report) if self.report is not None
                     else "no step report: no megatrain training step ran in this script")
        if files:
            parts.append("files:\n" + "\n".join(f"  {f}" for f in files))
        return "\n\n".join(parts) + "\n"

    def as_dict(self) -> dict:
        graphs = []
        for record, directory, selected in zip(self.records, self.directories, self.selected):
            stages: dict[str, list[dict]] = {}
            for index, snap in selected:
                stages.setdefault(snap.graph, []).append({
                    "index": index, "stage": snap.stage,
                    "file": f"{directory}/{_snapshot_filename(index, snap)}",
                    "provenance": {"pass": None if snap.stage == "captured" else snap.stage,
                                   "nodes_created": snap.nodes_created, "nodes_erased": snap.nodes_erased,
                                   "elapsed_ms": snap.elapsed_ms, "summary": _provenance(snap)},
                    "text": snap.text,
                })
            graphs.append({
                "label": record.label, "directory": directory,
                "options": dataclasses.asdict(record.options),
                "plan": _plan_dict(record),
                "param_bytes_by_layer": dict(record.param_bytes_by_layer),
                "stages": stages,
            })
        return {"tool": f"{PROG} inspect", "version": _version(), "script": self.script,
                "graphs": graphs, "report": self.report.as_dict() if self.report is not None else None}

    def snapshot_texts(self):
        """(relative file path, header, text) of every selected snapshot, in order."""
        for record, directory, selected in zip(self.records, self.directories, self.selected):
            for index, snap in selected:
                yield (f"{directory}/{_snapshot_filename(index, snap)}",
                       _snapshot_header(record.label, index, snap), snap.text)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _emit(dump: _Dump, fmt: str, out: str | None, files: list[str]) -> None:
    """Prints or writes the dump; ``files`` are the ONNX models and pictures already written."""
    if fmt == "onnx":
        summary_path = os.path.join(out, "summary.txt")
        _write(summary_path, dump.summary(files))
        sys.stdout.write(dump.summary([*files, summary_path]))
        return
    if fmt == "json":
        text = json.dumps(dump.as_dict(), indent=2) + "\n"
        if out is None:
            sys.stdout.write(text)
        else:
            _write(os.path.join(out, "inspect.json"), text)
            print(f"wrote {os.path.join(out, 'inspect.json')}", file=sys.stderr)
        for path in files:
            print(f"wrote {path}", file=sys.stderr)
        return
    if out is None:
        sys.stdout.write(dump.summary())
        for _, header, text in dump.snapshot_texts():
            sys.stdout.write(f"\n{'=' * 8} {header} {'=' * 8}\n{text}")
        return
    written = []
    for rel, header, text in dump.snapshot_texts():
        # The header as comments keeps the file valid to syntax-highlight as Python.
        _write(os.path.join(out, rel), f"# megacompile inspect: {header}\n{text}")
        written.append(os.path.join(out, rel))
    written += files
    summary_path = os.path.join(out, "summary.txt")
    _write(summary_path, dump.summary(written))
    sys.stdout.write(dump.summary([*written, summary_path]))


def run_inspect(args: argparse.Namespace) -> int:
    target = list(args.target)
    if target and target[0] == "--":
        target.pop(0)
    if not target:
        raise _UsageError("give the script to run: megacompile inspect SCRIPT [ARGS ...] "
                          "(or -m MODULE [ARGS ...])")
    script, rest = target[0], target[1:]
    late, script_args = _take_inspect_options(rest)
    if late:
        late_parser = _LateOptionParser(prog=f"{PROG} inspect", add_help=False)
        _add_inspect_options(late_parser)
        # Parsing into the same namespace: a later --out/--format wins, --stage accumulates.
        late_parser.parse_args(late, namespace=args)
    fmt = args.format or "text"
    filters = _parse_stage_filters(args.stage)
    for wanted, module, extra in ((fmt == "onnx", "onnx", "onnx"), (args.plot, "matplotlib", "plot")):
        what = "--format onnx" if module == "onnx" else "--plot"
        if wanted and args.out is None:
            raise _UsageError(f"{what} writes files: give the directory with --out DIR")
        if wanted and importlib.util.find_spec(module) is None:
            raise _UsageError(f"{what} needs the {module} package: pip install \"megacompile[{extra}]\"")


    # Report only this script's graphs; and forget Dynamo's cache, or a function compiled
    # earlier in this process would be a cache hit here and show nothing.
    _torch_compat.reset_dynamo()
    shown = f"-m {script}" if args.as_module else script
    trace_path = os.path.join(args.out, "runtime-trace.json") if args.plot else None
    with recording() as records, (trace_runtime(trace_path) if trace_path else contextlib.nullcontext()):
        try:
            run_script(script, script_args, args.as_module)
        except ScriptFailed as e:
            compiled = f"; megatrain had compiled {len(records)} graph(s) before that" if records else ""
            print(f"{PROG} inspect: {shown}: {e}{compiled}. Nothing was dumped.", file=sys.stderr)
            return 1
    if not records:
        print(f"{PROG} inspect: {shown} ran, but compiled nothing with the megatrain backend. inspect shows "
              f"graphs compiled by torch.compile(..., backend=\"megatrain\"); torch.compile compiles at the "
              f"first call, so the compiled function must also be called.", file=sys.stderr)
        return 1
    selected = [[(i, s) for i, s in enumerate(r.snapshots) if _selected(s, filters)] for r in records]
    if filters is not None and not any(selected):
        print(f"{PROG} inspect: no snapshot matches --stage {', '.join(args.stage)}", file=sys.stderr)
        return 1
    dump = _Dump(shown, records, _directory_names(records), selected, _report_for(records))
    files: list[str] = []
    if fmt == "onnx":
        from megacompile.cli import onnx_program  # lazy: needs the optional onnx package

        files += onnx_program.write_programs(records, dump.directories, args.out)
    if args.plot:
        from megacompile.cli import plots  # lazy: needs the optional matplotlib package

        files += [trace_path, *plots.write_pictures(records, dump.directories, trace_path, args.out)]
    _emit(dump, fmt, args.out, files)
    return 0


# --- the command table ---------------------------------------------------------------------

class Subcommand(NamedTuple):
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("inspect", "run a training script and show every graph megatrain compiled, pass by pass",
               add_inspect_arguments, run_inspect),
    Subcommand("calibrate", "measure this machine (matmul, host<->device bandwidth, host AdamW) into a "
               "hardware profile", calibrate.add_arguments, calibrate.run),
    Subcommand(*plan_command.SUBCOMMAND),
    Subcommand(*plot_command.SUBCOMMAND),
)


def _version() -> str:

    try:
        return version("megacompile")
    except PackageNotFoundError:
        return "unknown (megacompile is not installed; run `pip install -e .`)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="megacompile: train models larger than GPU memory with "
                               "torch.compile(backend=\"megatrain\").")
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in SUBCOMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(_run=command.run, _parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse has printed them
        return e.code if isinstance(e.code, int) else 1
    try:
        return args._run(args)
    except _UsageError as e:
        args._parser.print_usage(sys.stderr)
        print(f"{args._parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
