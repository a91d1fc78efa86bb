"""Index algebra: a tensor described by what each element is, as a function of its index.

A value of a tensor of n dims is an expression of its element's index (i_0 ... i_{n-1}):

- ``Affine``: an integer ``sum(c_d * i_d) + c`` (``arange``, shifted, broadcast, sliced, gathered);
- ``Const``: one bool or float for every element;
- ``Cond(atom, then, other)``: ``then`` where the linear inequality ``atom <= 0`` holds, else
  ``other`` (comparisons, ``where``, ``tril``).

Atoms are kept in one canonical form (coefficients divided by their gcd, the first one
positive), so one inequality written two ways (``k <= q``, ``q + 1 > k``, ``~(k > q)``) is one
atom; an atom that holds everywhere (or nowhere) over the tensor's index box is folded away.
Every rule is exact over the integers: a value either means what the tensor holds or the
interpreter (``mask_interpreter``) refuses it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Union

DIM_NAMES_4D = ("b", "h", "q", "k")


class Unknown(Exception):
    """A tensor whose elements the algebra cannot state (the reason says which op and why)."""


@dataclasses.dataclass(frozen=True)
class Affine:
    coefs: tuple[tuple[int, int], ...]  # (dim, coefficient), sorted by dim, no zero coefficient
    const: int

    @staticmethod
    def of(coefs: dict[int, int], const: int) -> "Affine":
        return Affine(tuple(sorted((d, c) for d, c in coefs.items() if c)), int(const))

    @staticmethod
    def index(dim: int, scale: int = 1, offset: int = 0) -> "Affine":
        return Affine.of({dim: scale}, offset)

    @staticmethod
    def constant(c: int) -> "Affine":
        return Affine((), int(c))

    def plus(self, other: "Affine", sign: int = 1) -> "Affine":
        coefs = dict(self.coefs)
        for d, c in other.coefs:
            coefs[d] = coefs.get(d, 0) + sign * c
        return Affine.of(coefs, self.const + sign * other.const)

    def scaled(self, k: int) -> "Affine":
        return Affine.of({d: c * k for d, c in self.coefs}, self.const * k)

    def substitute(self, subs: dict[int, "Affine"]) -> "Affine":
        """Each index i_d replaced by ``subs[d]`` (an affine form over other indices)."""
        out = Affine.constant(self.const)
        for d, c in self.coefs:
            out = out.plus(subs[d].scaled(c))
        return out

    def bounds(self, sizes: tuple[int, ...]) -> tuple[int, int]:
        """Least and greatest value over the index box ``0 <= i_d < sizes[d]``."""
        lo = hi = self.const
        for d, c in self.coefs:
            span = c * (sizes[d] - 1)
            lo, hi = lo + min(0, span), hi + max(0, span)
        return lo, hi

    def describe(self, names=None) -> str:
        terms = []
        for d, c in self.coefs:
            name = names[d] if names and d < len(names) else f"i{d}"
            terms.append(name if c == 1 else f"-{name}" if c == -1 else f"{c}*{name}")
        if self.const or not terms:
            terms.append(str(self.const))
        return " + ".join(terms).replace("+ -", "- ")


@dataclasses.dataclass(frozen=True)
class Const:
    value: bool | float
    kind: str  # "bool" | "float": 0.0 and False are different values here

    @staticmethod
    def of(value) -> "Const":
        return Const(bool(value), "bool") if isinstance(value, bool) else Const(float(value), "float")


@dataclasses.dataclass(frozen=True)
class Cond:
    atom: Affine  # canonical; the condition is ``atom <= 0``
    then: "Value"
    other: "Value"


Value = Union[Affine, Const, Cond]
TRUE, FALSE = Const(True, "bool"), Const(False, "bool")


def _canonical(a: Affine) -> tuple[Affine, bool]:
    """(atom, polarity): ``a <= 0`` is ``atom <= 0`` (polarity True) or its negation."""
    g = math.gcd(*(c for _, c in a.coefs))
    # g*e + c <= 0  <=>  e <= floor(-c / g)  <=>  e + ceil(c / g) <= 0
    e = Affine(tuple((d, c // g) for d, c in a.coefs), -((-a.const) // g))
    if e.coefs[0][1] > 0:
        return e, True
    # e <= 0  <=>  not (-e >= 1)  <=>  not (-e + 1 <= 0)
    return Affine(tuple((d, -c) for d, c in e.coefs), -e.const + 1), False


def le_zero(a: Affine, sizes: tuple[int, ...]) -> Value:
    """The bool value ``a <= 0`` over the index box ``sizes``."""
    lo, hi = a.bounds(sizes)
    if hi <= 0:
        return TRUE
    if lo > 0:
        return FALSE
    atom, polarity = _canonical(a)
    return cond(atom, TRUE, FALSE) if polarity else cond(atom, FALSE, TRUE)


def restrict(v: Value, atom: Affine, truth: bool) -> Value:
    """``v`` where ``atom <= 0`` is known to be ``truth``."""
    if not isinstance(v, Cond):
        return v
    if v.atom == atom:
        return restrict(v.then if truth else v.other, atom, truth)
    return cond(v.atom, restrict(v.then, atom, truth), restrict(v.other, atom, truth))


def cond(atom: Affine, then: Value, other: Value) -> Value:
    then, other = restrict(then, atom, True), restrict(other, atom, False)
    return then if then == other else Cond(atom, then, other)


def lift(fn: Callable[..., Value], *args: Value) -> Value:
    """``fn`` (over leaves: Affine / Const) applied element by element to values that may be Conds."""
    for v in args:
        if isinstance(v, Cond):
            then = lift(fn, *(restrict(a, v.atom, True) for a in args))
            other = lift(fn, *(restrict(a, v.atom, False) for a in args))
            return cond(v.atom, then, other)
    return fn(*args)


def substitute(v: Value, subs: dict[int, Affine], sizes: tuple[int, ...]) -> Value:
    """``v`` read at index ``subs`` (an affine form per old dim over the new dims, box ``sizes``)."""
    if isinstance(v, Affine):
        return v.substitute(subs)
    if isinstance(v, Const):
        return v
    test = le_zero(v.atom.substitute(subs), sizes)
    return lift(lambda t, a, b: a if t.value else b, test, substitute(v.then, subs, sizes),
                substitute(v.other, subs, sizes))


def atoms(v: Value) -> set[Affine]:
    if isinstance(v, Cond):
        return {v.atom} | atoms(v.then) | atoms(v.other)
    return set()


def evaluate(v: Value, truth: dict[Affine, bool]) -> Value:
    """The leaf ``v`` takes where each atom has the given truth."""
    while isinstance(v, Cond):
        v = v.then if truth[v.atom] else v.other
    return v


def describe(v: Value, names=None) -> str:
    if isinstance(v, Affine):
        return v.describe(names)
    if isinstance(v, Const):
        return str(v.value)
    return f"({v.atom.describe(names)} <= 0 ? {describe(v.then, names)} : {describe(v.other, names)})"


def is_causal(v: Value, ndim: int, length: int) -> str | None:
    """None if ``v`` (over an index box of ``ndim`` dims, the last two query and key, both
    ``length`` long) is exactly the causal mask: bool ``k <= q``, or additive ``0 where k <= q
    else -inf``; else why not.

    Decided exactly where every atom compares the key with the query, ``k - q >= c``: the value
    is then a step function of ``d = k - q`` that changes only at the atoms' thresholds, so
    checking d on either side of each threshold, of 0 and at both ends covers every d."""
    names = DIM_NAMES_4D[-ndim:] if ndim <= 4 else None
    q, k = ndim - 2, ndim - 1
    found = atoms(v)
    if not found:
        return f"the mask is the same everywhere ({describe(v, names)}), not causal"
    other = [a for a in found if a.coefs != ((q, 1), (k, -1))]  # canonical q - k + c <= 0, i.e. d >= c
    if other:
        shown = ", ".join(sorted(f"{a.describe(names)} <= 0" for a in other))
        return f"the mask depends on {shown}, not only on k - q"
    lo, hi = -(length - 1), length - 1
    probes = {lo, hi, 0, 1} | {d for a in found for d in (a.const - 1, a.const)}
    attend = evaluate(v, {a: 0 >= a.const for a in found})
    masked = evaluate(v, {a: 1 >= a.const for a in found})
    if (attend, masked) not in ((TRUE, FALSE), (Const(0.0, "float"), Const(-math.inf, "float"))):
        return (f"the mask is {describe(attend)} where k = q and {describe(masked)} where k = q + 1; the causal mask "
                f"is True / False there (additive: 0 / -inf)")
    for d in sorted(p for p in probes if lo <= p <= hi):
        got = evaluate(v, {a: d >= a.const for a in found})
        if got != (attend if d <= 0 else masked):
            thresholds = ", ".join(sorted(f"k - q >= {a.const}" for a in found))
            return f"the mask is {describe(got)} where k - q = {d} ({thresholds}): not k <= q"
    return None
