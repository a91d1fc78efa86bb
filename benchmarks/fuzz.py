"""The property test of tests/test_fuzz.py, run for many random examples.

Usage:  python benchmarks/fuzz.py [--examples 100] [--seed N] [--merged] [--out FILE]

Each example draws a model and a budget (tests/fuzz_models.py) and checks that megatrain
trains it like eager PyTorch with the measured peak within the budget and the planned peak
within 5% of the measured; a budget no plan meets must name a minimum that works. Prints one
line per example and every failure with its spec (a failure becomes a regression test).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from fuzz_models import NORMS, FuzzSpec, check_spec  # noqa: E402


def draw(rng: random.Random) -> FuzzSpec:
    return FuzzSpec(depth=rng.randint(1, 4), width=rng.choice([16, 24, 32]), norm=rng.choice(NORMS),
                    residual=rng.random() < 0.5, reuse_layer=rng.random() < 0.5, tied=rng.random() < 0.5,
                    buffer=rng.random() < 0.5, frozen=rng.random() < 0.5, aux_output=rng.random() < 0.5,
                    dropout=rng.random() < 0.5, budget_fraction=rng.uniform(0.02, 1.5),
                    batch=rng.randint(1, 3), seq=rng.choice([4, 8, 16]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--merged", action="store_true",
                   help="also build each plan's merge_compute_runs variant, measured by the eager lowering")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    lines = [f"megatrain fuzz  {datetime.datetime.now():%Y-%m-%d %H:%M}  python {platform.python_version()}",
             f"command: python benchmarks/fuzz.py --examples {args.examples} --seed {seed}"
             + (" --merged" if args.merged else "")]
    failures = 0
    start = time.perf_counter()
    for i in range(args.examples):
        spec = draw(rng)
        try:
            result = "ok: " + check_spec(spec, merged=args.merged)
        except Exception as e:  # noqa: BLE001  (a failure is a finding, listed with its spec)
            failures += 1
            result = f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            traceback.print_exc()
        lines.append(f"{i:3d} {spec}\n    {result}")
        print(lines[-1], flush=True)
    lines.append(f"{args.examples} examples, {failures} failures, {time.perf_counter() - start:.0f} s")
    print(lines[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
