"""``megacompile plan``'s arguments and entry point: the row of ``cli.SUBCOMMANDS``."""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings

from megacompile.cli.plan_command import DEFAULT_TRACED_LAYERS, PRECISIONS, PlanError
from megacompile.cli.plan_command.planning import plan_model
from megacompile.cli.presets import count_parameters, known_presets, load_model_config
from megacompile.core.errors import OptionsError
from megacompile.core.units import parse_bytes
from megacompile.plan.hardware import get_profile, known_profiles


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megacompile plan`."""
    parser.add_argument("model", metavar="MODEL",
                        help=f"a preset ({', '.join(known_presets())}) or a path to a Hugging Face config.json")
    parser.add_argument("--hardware", required=True, metavar="NAME",
                        help=f"a hardware profile ({', '.join(known_profiles())}) or a JSON written by calibrate")
    parser.add_argument("--seq-len", type=int, required=True, metavar="N", help="tokens per sequence")
    parser.add_argument("--batch", type=int, required=True, metavar="N", help="sequences per step")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help="fp32 (default) or bf16")
    parser.add_argument("--host-memory", default=None, metavar="SIZE",
                        help="host RAM, e.g. 1.5TB or 512GiB (default: the profile's)")
    parser.add_argument("--budget", default=None, metavar="SIZE",
                        help="device memory budget, e.g. 60GiB (default: the profile's HBM)")
    parser.add_argument("--max-seq-len", action="store_true",
                        help="also find the largest sequence length that fits (a few more plans)")
    parser.add_argument("--seq-multiple", type=int, default=128, metavar="N",
                        help="sequence lengths searched are multiples of N (default: 128)")
    parser.add_argument("--traced-layers", type=int, default=DEFAULT_TRACED_LAYERS, metavar="K",
                        help="decoder layers traced and planned before extrapolating "
                             f"(default: {DEFAULT_TRACED_LAYERS})")
    parser.add_argument("--gpus", type=int, default=None, metavar="N",
                        help="data parallel: GPUs per node (--batch is per GPU); predicts the step and tokens/s")
    parser.add_argument("--nodes", type=int, default=None, metavar="M", help="data parallel: nodes (default 1)")
    parser.add_argument("--no-shard-optimizer", action="store_true",
                        help="data parallel: every rank keeps the whole optimizer state (default: sharded)")
    parser.add_argument("--nic-bandwidth", default=None, metavar="RATE",
                        help="data parallel: bytes/s of each node's NIC between nodes, e.g. 25GB "
                             "(default 25 GB/s: a 200 Gb/s NIC)")
    parser.add_argument("--reduce-gradients-on", choices=("auto", "host", "device"), default=None,
                        help="data parallel: average gradients on the GPUs (NCCL) or on the host (gloo); "
                             "default auto: the faster")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _quiet():
    """Keep tracing noise (PyTorch warnings and log lines) off the terminal."""

    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    for name in ("torch._dynamo", "torch._inductor", "torch._functorch", "torch.fx", "torch._logging",
                 "torch.utils._sympy", "transformers"):
        logger = logging.getLogger(name)
        old = logger.level
        logger.setLevel(logging.ERROR)
        stack.callback(logger.setLevel, old)
    return stack


def run(args: argparse.Namespace) -> int:
    def usage_error(message: str) -> int:
        print(f"megacompile plan: error: {message}", file=sys.stderr)
        return 2

    try:
        config = load_model_config(args.model)
    except ValueError as e:
        return usage_error(str(e))
    try:
        profile = get_profile(args.hardware)
    except ValueError as e:
        return usage_error(str(e))
    try:
        budget = parse_bytes(args.budget, "--budget") if args.budget is not None else None
        host_memory = parse_bytes(args.host_memory, "--host-memory") if args.host_memory is not None else None
    except OptionsError as e:
        return usage_error(str(e))
    if args.batch < 1 or args.seq_len < 1:
        return usage_error("--batch and --seq-len must be >= 1")
    data_parallel = None
    if args.gpus is not None or args.nodes is not None:
        gpus = args.gpus if args.gpus is not None else 1
        nodes = args.nodes if args.nodes is not None else 1
        if gpus < 1 or nodes < 1:
            return usage_error("--gpus and --nodes must be >= 1")
        data_parallel = {"gpus": gpus, "nodes": nodes, "shard_optimizer": not args.no_shard_optimizer,
                         "reduce_gradients_on": args.reduce_gradients_on or "auto"}
        if args.nic_bandwidth is not None:
            try:
                data_parallel["nic_bandwidth"] = parse_bytes(args.nic_bandwidth, "--nic-bandwidth")
            except OptionsError as e:
                return usage_error(str(e))
    elif args.no_shard_optimizer or args.nic_bandwidth is not None or args.reduce_gradients_on is not None:
        return usage_error("--no-shard-optimizer, --nic-bandwidth and --reduce-gradients-on describe data "
                           "parallel: add --gpus N")
    if args.traced_layers < 2 or args.seq_multiple < 1:
        return usage_error("--traced-layers must be >= 2 and --seq-multiple >= 1")
    try:
        count_parameters(config)
    except ValueError as e:
        return usage_error(str(e))
    name = args.model if args.model in known_presets() else config.get("_name_or_path") or args.model
    try:
        with _quiet():
            result = plan_model(config, profile, batch=args.batch, seq_len=args.seq_len, precision=args.precision,
                                budget=budget, host_memory=host_memory, k=args.traced_layers,
                                max_seq_len=args.max_seq_len, seq_multiple=args.seq_multiple, model_name=name,
                                data_parallel=data_parallel)
    except PlanError as e:
        print(f"megacompile plan: error: {e}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else result.to_text())
    return 0 if result.fits else 1


# The row of cli.SUBCOMMANDS: (name, help, add_arguments, run). Exit codes: 0 fits, 1 does not
# fit (the output says which resource and the smallest change), 2 bad input.
SUBCOMMAND = ("plan", "will a model's training step fit on this hardware, and how fast (plans a few layers on the "
              "meta device with the megatrain backend and extrapolates)", add_arguments, run)
