"""Pure solvers for the planner: which option to take for each item under a memory target.

Each item (a layer) has options; option 0 is the baseline (keep everything: saves no memory,
costs no time). Choose one option per item so that the memory saved reaches ``required``
bytes at the least added time. This is a multiple-choice covering knapsack. The solvers
take and return plain lists, so they are tested with tables and swapped by option:

- ``solve_greedy``: repeatedly take the upgrade with the least added time per byte saved.
  Fast; not always optimal.
- ``solve_exact``: dynamic programming over items with a Pareto front of (bytes saved,
  time added), saved bytes capped at ``required``. Optimal.

Both return None when even the most aggressive choice cannot save ``required`` bytes.
"""
from __future__ import annotations

import dataclasses


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


def solve_exact(items: list[list[Option]], required: int) -> list[int] | None:
    _check(items)
    front: dict[int, float] = {0: 0.0}  # saved (capped at required) -> least time
    # Per item, how each state was reached: saved -> (saved before it, option). Followed back
    # from the answer once (carrying every state's picks along cost O(items) per state).
    reached: list[dict[int, tuple[int, int]]] = []
    for options in items:
        nxt: dict[int, float] = {}
        how: dict[int, tuple[int, int]] = {}
        for saved, time in front.items():
            for j, opt in enumerate(options):
                s = min(required, saved + opt.memory_saved)
                t = time + opt.time_cost
                if s not in nxt or t < nxt[s]:
                    nxt[s], how[s] = t, (saved, j)
        # Pareto prune: drop states that save less and cost at least as much.
        pruned: dict[int, float] = {}
        best_time = float("inf")
        for s in sorted(nxt, reverse=True):
            if nxt[s] < best_time:
                pruned[s] = best_time = nxt[s]
        front = pruned
        reached.append(how)
    if required <= 0:
        return [0] * len(items)
    if required not in front:
        return None
    picks, state = [], required
    for how in reversed(reached):
        state, j = how[state]
        picks.append(j)
    return picks[::-1]


SOLVERS = {"greedy": solve_greedy, "exact": solve_exact}
