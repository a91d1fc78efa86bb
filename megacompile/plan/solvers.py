"""Pure solvers for the planner: which option to take for each item under a memory target.

Each item (a layer) has options; option 0 is the baseline (keep everything: saves no memory,
costs no time). Choose one option per item so that the memory saved reaches ``required``
bytes at the least added time. This is a multiple-choice covering knapsack. The solvers
take and return plain lists, so they are tested with tables and swapped by option:

- ``solve_greedy``: repeatedly take the upgrade with the least added time per byte saved.
  Fast; not always optimal.
- ``solve_exact``: dynamic programming over items with a Pareto front of (bytes saved,
  time added), saved bytes capped at ``required``. Optimal while the front stays within
  ``MAX_FRONT`` buckets of bytes saved; past that, thinned to the ends of each bucket (see
  ``_thinned``): a saving the items can reach is still found, its time may be a little above
  the optimum.

Both return None when even the most aggressive choice cannot save ``required`` bytes.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    memory_saved: int
    time_cost: float


def _check(items: list[list[Option]]) -> None:
    for i, options in enumerate(items):
        if not options or options[0].memory_saved != 0 or options[0].time_cost != 0:
            raise ValueError(f"item {i}: option 0 must be the baseline (0 bytes saved, 0 time)")


def solve_greedy(items: list[list[Option]], required: int) -> list[int] | None:
    _check(items)
    choice = [0] * len(items)
    saved = 0
    if sum(max(o.memory_saved for o in opts) for opts in items) < required:
        return None
    while saved < required:
        best = None
        for i, options in enumerate(items):
            current = options[choice[i]]
            for j, opt in enumerate(options):
                gain = opt.memory_saved - current.memory_saved
                if gain <= 0:
                    continue
                # Enough to finish: prefer the cheapest such move outright.
                finishes = saved + gain >= required
                ratio = (opt.time_cost - current.time_cost) / gain
                key = (not finishes, (opt.time_cost - current.time_cost) if finishes else ratio)
                if best is None or key < best[0]:
                    best = (key, i, j, gain)
        if best is None:
            return None
        _, i, j, gain = best
        choice[i] = j
        saved += gain
    return choice


# Past this many buckets of bytes saved the exact solver's front is thinned. Unthinned, its size
# grew with the square of the items or faster: 800 storage groups of random sizes took 35 s a
# solve, and Gemma-2-9B's 42 layers (eager attention: more saved values per layer) did not
# finish one plan in 20 minutes, the fronts holding 23 GB.
MAX_FRONT = 4096


def _thinned(saved: np.ndarray, required: int, max_front: int) -> np.ndarray:
    """Which states of a front (sorted by bytes saved, most first; time falling with them) to
    keep: where it holds more than two states per bucket of ``required / max_front`` bytes,
    only each bucket's first and last (its most saved and its fastest). The front's first
    state, the most that can be saved, is always kept: whatever was reachable still is."""
    keep = np.ones(len(saved), dtype=bool)
    if len(saved) <= 2 * max_front:
        return keep
    bucket = saved * max_front // (required + 1)
    change = bucket[1:] != bucket[:-1]
    keep[1:-1] = change[1:] | change[:-1]  # the first or the last of its bucket
    return keep


def solve_exact(items: list[list[Option]], required: int, max_front: int = MAX_FRONT) -> list[int] | None:
    _check(items)
    if required <= 0:
        return [0] * len(items)
    # The Pareto front of (bytes saved, capped at required; least time), as arrays sorted by
    # bytes saved, most first. Vectorized: at 7B a plan's ~120 saved activations grow the
    # front to thousands of states and the planner solves for a dozen targets (a pure-Python
    # loop was seconds per plan).
    saved = np.zeros(1, dtype=np.int64)
    seconds = np.zeros(1, dtype=np.float64)
    # Per item, how each state of its front was reached: (index in the front before, option).
    reached: list[tuple[np.ndarray, np.ndarray]] = []
    for options in items:
        gains = np.array([o.memory_saved for o in options], dtype=np.int64)
        costs = np.array([o.time_cost for o in options], dtype=np.float64)
        # Every (state, option) in enumeration order: state by state, option by option.
        s = np.minimum(required, saved[:, None] + gains[None, :]).ravel()
        t = (seconds[:, None] + costs[None, :]).ravel()
        # For each bytes-saved value its least time, the first in enumeration order among
        # equal times (a stable sort by bytes saved descending, then time).
        order = np.lexsort((t, -s))
        s, t = s[order], t[order]
        first = np.ones(len(s), dtype=bool)
        first[1:] = s[1:] != s[:-1]
        order, s, t = order[first], s[first], t[first]
        # Pareto prune: drop states that save less and cost at least as much.
        before = np.minimum.accumulate(np.concatenate(([np.inf], t[:-1])))
        keep = t < before
        order, saved, seconds = order[keep], s[keep], t[keep]
        keep = _thinned(saved, required, max_front)
        order, saved, seconds = order[keep], saved[keep], seconds[keep]
        reached.append((order // len(options), order % len(options)))
    if saved[0] != required:
        return None
    picks, state = [], 0
    for before, option in reversed(reached):
        picks.append(int(option[state]))
        state = int(before[state])
    return picks[::-1]


SOLVERS = {"greedy": solve_greedy, "exact": solve_exact}
