"""The memory-budget planner: the fastest registered schedule whose peak activation memory fits a budget."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pipefold import schedules
from pipefold.errors import ConfigError, ScheduleError
from pipefold.simulate import CostModel, SimResult, simulate

__all__ = ["PlanResult", "Point", "candidates", "choose", "evaluate", "format_spec", "frontier",
           "one_f_one_b_peak", "parse_budget", "plan"]

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` before the first candidate and after each one."""

_TOLERANCE = 1e-9  # a peak this far above the budget still fits: sums of fractions of M pick up float noise
_BUDGET_TEXT = re.compile(r"(?P<number>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>[xXmM]?)")


@dataclass(frozen=True)
class Point:
    """One evaluated candidate: a schedule family, its options, and what the simulator predicts for it."""

    name: str
    options: dict[str, int] = field(hash=False)
    makespan: float
    bubble_ratio: float
    peak_memory: tuple[float, ...]
    """Per device, in units of M."""

    @property
    def memory(self) -> float:
        """The highest peak over devices: what the budget bounds."""
        return max(self.peak_memory)

    @property
    def spec(self) -> str:
        """The ``name:key=value,...`` text that ``pipefold simulate`` accepts."""
        return format_spec(self.name, self.options)


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer for one budget, with everything it evaluated on the way."""

    best: Point
    """The fastest candidate within the budget."""
    result: SimResult
    """The simulation of ``best``, with its timeline and memory curves."""
    budget: float
    """In units of M."""
    points: tuple[Point, ...]
    """Every candidate that ran, in candidate order."""
    frontier: tuple[Point, ...]
    """The points not dominated in (peak memory, makespan), by increasing memory; ``best`` is one of them."""
    skipped: tuple[str, ...] = ()
    """Specs of candidates that cannot run this shape (ConfigError or ScheduleError)."""

    @property
    def name(self) -> str:
        return self.best.name

    @property
    def options(self) -> dict[str, int]:
        return self.best.options

    @property
    def spec(self) -> str:
        return self.best.spec


def format_spec(name: str, options: Mapping[str, int]) -> str:
    """('kfkb', {'k': 3}) -> 'kfkb:k=3'; no options -> the bare name."""
    opts = ",".join(f"{k}={v}" for k, v in options.items())
    return f"{name}:{opts}" if opts else name


def parse_budget(text: str, one_f_one_b_peak: float) -> float:
    """A memory budget in units of M: ``'3'`` (or ``'3M'``) is 3 M, ``'0.5x'`` is half of 1F1B's peak.

    ``one_f_one_b_peak`` is that peak for the shape and cost model at hand
    (p M on device 0 with unit memory; see :func:`one_f_one_b_peak`).
    """
    match = _BUDGET_TEXT.fullmatch(text.strip())
    if match is None:
        raise ConfigError(f"cannot read memory budget {text!r}: use a number of M such as 3, "
                          f"or a multiple of 1F1B's peak such as 0.5x")
    number = float(match["number"])
    budget = number * one_f_one_b_peak if match["unit"] in ("x", "X") else number
    if not (math.isfinite(budget) and budget > 0):
        raise ConfigError(f"memory budget must be a positive amount of M (got {text!r}); e.g. 3 or 0.5x")
    return budget


def one_f_one_b_peak(p: int, m: int, cost: CostModel | None = None) -> float:
    """1F1B's highest peak activation memory over devices: the unit of ``'0.5x'`` budgets."""
    return max(simulate(schedules.build("1f1b", p, m), cost).peak_memory)


def candidates(p: int, m: int) -> list[tuple[str, dict[str, int]]]:
    """Every registered family that can run m microbatches on p devices, times its options' search spaces.

    An option whose search space is empty takes its default. Families are
    read from the registry on every call, so new ones join without changes here.
    """
    out: list[tuple[str, dict[str, int]]] = []
    for spec in schedules.REGISTRY.values():
        if spec.min_microbatches(p) > m:
            continue
        spaces = [list(o.search(p, m)) or [o.default] for o in spec.options]
        for values in itertools.product(*spaces):
            out.append((spec.name, {o.name: int(v) for o, v in zip(spec.options, values, strict=True)}))
    return out


def evaluate(p: int, m: int, cost: CostModel | None = None, *, progress: Progress | None = None) -> list[Point]:
    """Build and simulate every candidate; those that cannot run this shape are left out."""
    return _evaluate(p, m, cost, progress)[0]


def choose(points: Sequence[Point], budget: float) -> Point:
    """The point with the smallest makespan whose peak memory fits ``budget``.

    Ties go to lower memory, then to fewer options, the name and the options, so the answer is
    deterministic; a larger budget only adds points, so it never gives a
    larger makespan. A budget below every point raises ConfigError naming the
    smallest reachable peak.
    """
    fits = [pt for pt in points if pt.memory <= budget + _TOLERANCE]
    if not fits:
        raise _too_small(points, budget)
    return min(fits, key=_order)


def frontier(points: Iterable[Point]) -> list[Point]:
    """Points not dominated in (peak memory, makespan), by increasing memory (and so decreasing makespan).

    Of points with equal memory and makespan only one is kept, the one
    :func:`choose` would pick, so a chosen point is always on the frontier.
    """
    out: list[Point] = []
    for pt in sorted(points, key=lambda q: (q.memory, *_order(q))):
        if not out or pt.makespan < out[-1].makespan:
            out.append(pt)
    return out


def plan(p: int, m: int, budget: float, cost: CostModel | None = None, *,
         progress: Progress | None = None) -> PlanResult:
    """The fastest registered schedule for p devices and m microbatches whose peak memory fits ``budget`` M.

    To try many budgets on one shape, call :func:`evaluate` once and :func:`choose` per budget.
    """
    points, skipped = _evaluate(p, m, cost, progress)
    best = choose(points, budget)
    result = simulate(schedules.build(best.name, p, m, **best.options), cost)
    return PlanResult(best=best, result=result, budget=budget, points=tuple(points),
                      frontier=tuple(frontier(points)), skipped=tuple(skipped))


# --------------------------------------------------------------------------- helpers


def _evaluate(p: int, m: int, cost: CostModel | None, progress: Progress | None) -> tuple[list[Point], list[str]]:
    for label, value in (("devices", p), ("microbatches", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{label} must be a positive integer (got {value!r})")
    todo = candidates(p, m)
    points: list[Point] = []
    skipped: list[str] = []
    if progress is not None:
        progress(0, len(todo))
    for done, (name, options) in enumerate(todo, 1):
        try:
            points.append(_point(name, options, simulate(schedules.build(name, p, m, **options), cost)))
        except (ConfigError, ScheduleError):
            skipped.append(format_spec(name, options))
        if progress is not None:
            progress(done, len(todo))
    if not points:
        raise ConfigError(f"no registered schedule runs {m} microbatches on {p} stages "
                          f"({len(skipped)} candidates tried); try more microbatches")
    return points, skipped


def _point(name: str, options: dict[str, int], result: SimResult) -> Point:
    # Rounded like SimResult.to_dict: float noise must not split ties or order the frontier.
    return Point(name=name, options=options, makespan=round(result.makespan, 9),
                 bubble_ratio=round(result.bubble_ratio, 9),
                 peak_memory=tuple(round(x, 9) for x in result.peak_memory))


def _order(pt: Point) -> tuple[float, float, int, str, tuple[tuple[str, int], ...]]:
    # Among equals, a named schedule (v-min) reads better than the knobs that rebuild it (v-block:...).
    return pt.makespan, pt.memory, len(pt.options), pt.name, tuple(pt.options.items())


def _too_small(points: Sequence[Point], budget: float) -> ConfigError:
    if not points:
        return ConfigError("no schedules to choose from: evaluate found none that runs this shape")
    least = min(points, key=lambda q: (q.memory, *_order(q)))
    return ConfigError(f"no schedule fits {budget:.6g} M on {len(least.peak_memory)} stages; "
                       f"the smallest reachable peak is {least.memory:.6g} M ({least.spec})")
