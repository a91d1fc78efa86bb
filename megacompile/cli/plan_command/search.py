"""The largest sequence length or batch at which a plan fits: a few real k-layer probes and,
between them, a memory model interpolated through the nearest three."""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable

from megacompile.cli.plan_command import POLICIES


def _interpolated(traces: dict, x: float):
    """Per-policy memory numbers at ``x``, interpolated (Lagrange) through the probes in ``traces``.

    Activation sizes are polynomials of degree <= 2 in the sequence length (the attention mask
    is seq x seq) and of degree 1 in the batch, and so are the peaks as long as they stay at
    the same op; three probes pin a quadratic down.
    """

    xs = sorted(traces)

    def lagrange(values: list[float]) -> float:
        total = 0.0
        for i, xi in enumerate(xs):
            term = values[i]
            for j, xj in enumerate(xs):
                if j != i:
                    term *= (x - xj) / (xi - xj)
            total += term
        return total

    any_trace = traces[xs[0]]
    policies = {}
    for p in [p for p in POLICIES if all(p in traces[xi].policies for xi in xs)]:
        fields = {}
        for name in ("early_peak", "layer_base", "head_base", "saved_device", "saved_host"):
            fields[name] = lagrange([float(getattr(traces[xi].policies[p], name)) for xi in xs])
        fields["glue_host"] = lagrange([float(getattr(traces[xi].policies[p], "glue_host", 0)) for xi in xs])
        policies[p] = types.SimpleNamespace(**fields)
    pair_base = {pair: lagrange([float(traces[xi].pair_base[pair]) for xi in xs])
                 for pair in any_trace.pair_base if all(pair in traces[xi].pair_base for xi in xs)}
    return types.SimpleNamespace(k=any_trace.k, policies=policies, pair_base=pair_base)


@dataclasses.dataclass
class SearchResult:
    axis: str  # seq_len | batch
    value: int | None  # the largest value that fits (None: not even the smallest)
    how: str  # "bracketed by probes" | "probe fits; next step predicted not to" | ...
    probes: dict  # value -> fits (each a real k-layer plan on the meta device)
    step: int


def search_largest(axis: str, fits_at: Callable[[int], bool], traces: dict, *, start: int, step: int,
                   lo_limit: int, hi_limit: int, predict_fits: Callable[[Any], bool],
                   max_probes: int = 5) -> SearchResult:
    """The largest value of ``axis`` (on a grid of ``step``) at which the plan fits.

    ``fits_at(x)`` plans k layers at x on the meta device (a probe, cached in ``traces``);
    ``predict_fits(model)`` judges an interpolated memory model. Probes: the start, two more
    a factor 2 and 4 away (down if the start does not fit, up if it does), then the value the
    quadratic through the three nearest probes predicts, checked with one probe; if that
    probe disagrees, it joins the probes and the search repeats (bisection of the bracket
    when the prediction falls outside it), at most ``max_probes`` times.
    """
    def grid(x: float) -> int:
        return int(max(lo_limit, min(hi_limit, (int(x) // step) * step)))

    known: dict[int, bool] = {start: fits_at(start)}
    first = [grid(start * 2), grid(start * 4)] if known[start] else [grid(start // 2), grid(start // 4)]
    for x in first:
        if x not in known:
            known[x] = fits_at(x)

    def bracket():
        lo = max((x for x, ok in known.items() if ok), default=None)
        hi = min((x for x, ok in known.items() if not ok), default=None)
        return lo, hi

    def model_at(x: int):
        near = sorted(traces, key=lambda xi: (abs(xi - x), xi))[:3]
        return _interpolated({xi: traces[xi] for xi in near}, x)

    def predicted_largest(a: int, b: int) -> int | None:
        """The largest grid value in (a, b) the model says fits (None if none), by bisection."""
        if b - a <= step or not predict_fits(model_at(a + step)):
            return None
        good, bad = a + step, b
        while bad - good > step:
            mid = good + ((bad - good) // (2 * step)) * step
            mid = mid if mid > good else good + step
            if predict_fits(model_at(mid)):
                good = mid
            else:
                bad = mid
        return good

    for _ in range(max_probes):
        lo, hi = bracket()
        if lo is not None and ((hi is not None and hi - lo <= step) or lo >= hi_limit):
            return SearchResult(axis, lo, "bracketed by probes", known, step)
        if lo is None and lo_limit in known:
            return SearchResult(axis, None, f"does not fit even at {axis} {lo_limit}", known, step)
        a = lo if lo is not None else lo_limit - step
        b = hi if hi is not None else hi_limit + step
        guess = predicted_largest(a, b)
        if guess is None:
            if lo is None:
                guess = lo_limit
            else:  # the model agrees that the largest fitting probe is the answer
                return SearchResult(axis, lo, f"a probe at {lo} fits; {lo + step} is predicted not to", known, step)
        if guess in known:
            guess = a + max(1, (b - a) // (2 * step)) * step  # bisect the bracket instead
        known[guess] = fits_at(guess)
        if known[guess] and guess + step not in known and (
                guess >= hi_limit or not predict_fits(model_at(grid(guess + step)))):
            return SearchResult(axis, guess, f"a probe at {guess} fits; {guess + step} is predicted not to",
                                known, step)
    lo, hi = bracket()
    how = "bracketed by probes" if lo is not None and hi is not None and hi - lo <= step \
        else "probe budget used up: the largest probe that fits"
    return SearchResult(axis, lo, how, known, step)
