"""K-FAC over data-parallel copies: which copy owns each layer's factors (DP-KFAC), and what each copy computes,
sends and holds per second-order update, against D-KFAC where every copy builds every factor.

A Linear layer with ``a`` input features (``+1`` with a bias) and ``g`` output features has the factors
``A`` (``a x a``) and ``G`` (``g x g``), built from the rows of its inputs and output gradients.

- **D-KFAC** (``d-kfac``): every copy builds both factors of every layer from its own rows, the copies all-reduce
  the factors' sums, and every copy inverts every layer and preconditions every gradient.
- **DP-KFAC** (``dp-kfac``): each layer has one owner copy (:func:`assign`, balanced by the layer's cost). Where a
  refresh's rows are fewer bytes than the factor (fewer rows than columns), every copy sends its rows to the owner,
  which builds the factor from all of them; elsewhere every copy sums the factor of its own rows, as D-KFAC does,
  and the inversion reduces the sums into the owner (half an all-reduce's bytes). Only the owner inverts the layer
  and preconditions its gradient (after the gradient's all-reduce), then broadcasts the preconditioned gradient:
  ``a x g`` numbers, fewer than the two inverses' ``a^2 + g^2`` for every shape (``2ag <= a^2 + g^2``), so the
  gradient is what travels, never the inverses. The factors are those of D-KFAC (the same rows summed), so the
  updates are the same.

DP-KFAC as published builds each owner's factors from the owner's own rows alone: no factor travels at all, and
the factors (an estimate of the curvature either way) differ from D-KFAC's. Here they are D-KFAC's, exactly; what
that costs in bytes is the reduce above.

:func:`predict` gives, per copy, the floating-point work, the bytes each collective carries and the K-FAC state
held, by the closed forms below; the runtime counts the same quantities as it runs (``runtime.curvature``), and
``benchmarks/dpkfac.py`` sets the two side by side. :func:`stage_work` turns a stage's K-FAC seconds measured in
one process into each copy's, for the simulator to lay out on the copy's timeline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipefold.errors import ConfigError

__all__ = ["DISTRIBUTIONS", "Layer", "PerCopy", "assign", "layer_cost", "predict", "sends_rows", "stage_work"]

DISTRIBUTIONS = ("dp-kfac", "d-kfac")
"""How K-FAC's work is spread over data-parallel copies: each layer on one copy, or every layer on every copy."""


@dataclass(frozen=True)
class Layer:
    """One Linear layer as K-FAC sees it."""

    inputs: int
    """Columns of ``A``: the input features, plus one with a bias."""
    outputs: int
    """Columns of ``G``: the output features."""
    rows: int
    """Rows of one microbatch's inputs (and output gradients) on one copy: tokens or samples."""


def layer_cost(layer: Layer, updates: int = 1) -> float:
    """The floating-point work of one layer's K-FAC per second-order update with ``updates`` microbatches of
    curvature: the factors' products (``2 r a^2 + 2 r g^2`` per microbatch), the two Cholesky inversions
    (about ``a^3 + g^3`` each way, ``2(a^3 + g^3)``) and the preconditioning's two products (``2ag(a + g)``)."""
    a, g, r = layer.inputs, layer.outputs, layer.rows
    return updates * 2.0 * r * (a * a + g * g) + 2.0 * (a ** 3 + g ** 3) + 2.0 * a * g * (a + g)


def assign(costs: Sequence[float], copies: int) -> tuple[int, ...]:
    """The copy that owns each layer: the costliest first, each to the copy with the least work so far (ties to the
    lowest copy), so that the largest share is at most the average plus one layer's cost."""
    if copies < 2:
        raise ConfigError(f"DP-KFAC spreads K-FAC's layers over data-parallel copies: give --dp 2 or more "
                          f"(got {copies}), or use --kfac-distribution d-kfac")
    load = [0.0] * copies
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        c = min(range(copies), key=lambda c: (load[c], c))
        owner[i] = c
        load[c] += costs[i]
    return tuple(owner)


def sends_rows(rows: int, width: int) -> bool:
    """Whether the copies send a factor's ``rows`` (a refresh's, on one copy) to its owner rather than the sum of
    their products: fewer bytes where they are fewer than the factor's ``width`` (its columns)."""
    return rows < width


@dataclass(frozen=True)
class PerCopy:
    """One copy's share of a second-order update (one refresh of every factor and one preconditioning)."""

    flops: float
    """Floating-point work of its K-FAC."""
    sent: dict[str, float]
    """Bytes it puts into each kind of collective: 'factors' (D-KFAC's all-reduce of the sums, a ring's 2(p-1)/p of
    them; DP-KFAC's reduce of the sums into their owners, the whole sum from each other copy), 'rows' (rows sent to
    their owners), 'preconditioned' (the owners' broadcast of the preconditioned gradients, a ring's (p-1)/p)."""
    state: float
    """Bytes of K-FAC state it holds: factors and their running sums and inverses (``runtime.kfac.LinearFactors``)."""

    @property
    def total_sent(self) -> float:
        return sum(self.sent.values())


def predict(layers: Sequence[Layer], copies: int, distribution: str, *, updates: int = 1, itemsize: int = 4,
            owners: Sequence[int] | None = None) -> list[PerCopy]:
    """Each copy's work, bytes and state per second-order update with ``updates`` microbatches of curvature per copy.

    D-KFAC: every copy builds every factor from its rows (``updates`` microbatches), all-reduces the sums, inverts and
    preconditions everything. DP-KFAC with ``owners`` (:func:`assign` by :func:`layer_cost` when None), as the
    module says."""
    if distribution not in DISTRIBUTIONS:
        raise ConfigError(f"unknown K-FAC distribution {distribution!r}: use {' or '.join(DISTRIBUTIONS)}")
    p = copies
    ring = 2.0 * (p - 1) / p
    if distribution == "d-kfac":
        flops = sum(layer_cost(x, updates) for x in layers)
        factors = sum((x.inputs ** 2 + x.outputs ** 2) * itemsize for x in layers)
        # The running factors, the sums and the inverses: three of each matrix.
        state = 3.0 * factors
        return [PerCopy(flops=flops, sent={"factors": ring * factors}, state=state) for _ in range(p)]
    owners = tuple(owners) if owners is not None else assign([layer_cost(x, updates) for x in layers], p)
    out = []
    for c in range(p):
        flops = sent_rows = sent_sums = state = precond = 0.0
        for x, o in zip(layers, owners, strict=True):
            a, g, r = x.inputs, x.outputs, x.rows
            for width in (a, g):
                gathered = sends_rows(r * updates, width)
                if gathered:
                    if o == c:  # the factor of every copy's rows, built here
                        flops += updates * 2.0 * p * r * width * width
                        state += 3.0 * width * width * itemsize
                    else:
                        sent_rows += updates * r * width * itemsize
                else:  # every copy sums its own rows' factor; the owner gets the others' sums
                    flops += updates * 2.0 * r * width * width
                    if o == c:
                        state += 3.0 * width * width * itemsize
                    else:
                        state += width * width * itemsize
                        sent_sums += width * width * itemsize
            if o == c:
                flops += 2.0 * (a ** 3 + g ** 3) + 2.0 * a * g * (a + g)
            precond += (p - 1) / p * a * g * itemsize
        out.append(PerCopy(flops=flops, sent={"rows": sent_rows, "factors": sent_sums, "preconditioned": precond},
                           state=state))
    return out


def stage_work(work: Mapping[str, float], layers: Sequence[Layer], copies: int, distribution: str, *,
               updates: int, owners: Sequence[int] = ()) -> list[dict[str, float]]:
    """Each copy's seconds of one stage's K-FAC actions (KA and KG per microbatch, KI and KP per step), their
    computation alone, from ``work``: the same actions' seconds measured in one process that builds, inverts and
    applies every factor of the stage (as D-KFAC's copies each do). With DP-KFAC each action's seconds are split by
    the closed-form work of what the copy does (:func:`predict`'s terms): KA and KG by the factors it builds (its own
    rows' sums, or a gathered factor from every copy's rows where it owns the layer), KI by the inversions and KP by
    the preconditionings of the layers it owns. The collectives are not in these seconds: their bytes are
    :func:`predict`'s, and the runtime times them apart."""
    if distribution not in DISTRIBUTIONS:
        raise ConfigError(f"unknown K-FAC distribution {distribution!r}: use {' or '.join(DISTRIBUTIONS)}")
    whole = {k: float(v) for k, v in work.items()}
    if distribution == "d-kfac" or not layers:
        return [dict(whole) for _ in range(copies)]
    if len(owners) != len(layers):
        raise ConfigError(f"{len(owners)} owners for {len(layers)} K-FAC layers")
    p = copies

    def built(width: int, x: Layer, c: int, o: int) -> float:  # work of one factor of one microbatch on copy c
        if sends_rows(x.rows * updates, width):
            return p * x.rows * width * width if o == c else 0.0
        return float(x.rows * width * width)

    totals = {"KA": sum(x.rows * x.inputs ** 2 for x in layers), "KG": sum(x.rows * x.outputs ** 2 for x in layers),
              "KI": sum(x.inputs ** 3 + x.outputs ** 3 for x in layers),
              "KP": sum(x.inputs * x.outputs * (x.inputs + x.outputs) for x in layers)}
    out = []
    for c in range(p):
        mine = {"KA": sum(built(x.inputs, x, c, o) for x, o in zip(layers, owners, strict=True)),
                "KG": sum(built(x.outputs, x, c, o) for x, o in zip(layers, owners, strict=True)),
                "KI": sum(x.inputs ** 3 + x.outputs ** 3 for x, o in zip(layers, owners, strict=True) if o == c),
                "KP": sum(x.inputs * x.outputs * (x.inputs + x.outputs)
                          for x, o in zip(layers, owners, strict=True) if o == c)}
        out.append({k: whole.get(k, 0.0) * (mine[k] / totals[k] if totals[k] else 1.0) for k in whole})
    return out
