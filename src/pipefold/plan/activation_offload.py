"""Which activations to offload (PipeOffload's selective strategy), and the schedule that fits a budget with them.

A microbatch's activations on a stage live from the end of its forward to the start of its backward. Offloading
them costs two copies over the host link (``CostModel.offload`` each way); it is free when the copies fit in that
lifetime beside the compute, and it lowers the device's peak only where they were held at the peak. So the planner
offloads the longest-lived first: on each device over the budget it adds the longest-lived pair held across that
device's peak, simulates again, and stops when every device fits (or nothing is left, which it says with the
smallest peak offloading everything reaches). :func:`plan_offload` does that for every registered schedule family
and keeps the fastest that fits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from pipefold import schedules
from pipefold.errors import ConfigError, ScheduleError
from pipefold.ir import Kind, Schedule
from pipefold.ir.ref import ScheduleRef
from pipefold.plan.budget import Progress, candidates
from pipefold.schedules.offload import offloadable_pairs, with_offload
from pipefold.sim.simulate import CostModel, SimResult, simulate

__all__ = ["COPY_LIKE_A_FORWARD", "OffloadChoice", "OffloadPoint", "TooSmall", "choose_offload", "lifetimes",
           "offload_fraction", "parse_share", "plan_offload", "reload_ahead", "spans"]

_TOLERANCE = 1e-9

COPY_LIKE_A_FORWARD = CostModel(offload=1.0)
"""The costs a run without a profile chooses and times its offloads by: unit passes and a copy each way as long as a
forward, so that a reload starts about one action before its backward in the steady state."""


class TooSmall(ConfigError):
    """A budget that a schedule cannot meet even with every activation offloaded; ``least`` is its peak then."""

    def __init__(self, message: str, *, least: float) -> None:
        super().__init__(message)
        self.least = least


@dataclass(frozen=True)
class OffloadChoice:
    """A schedule with some activations offloaded, and what the simulator predicts for it beside the plain one."""

    schedule: Schedule
    """The schedule with its ``OF`` and ``RL`` actions."""
    pairs: tuple[tuple[int, int], ...]
    """The (stage, microbatch)s offloaded, longest-lived first."""
    offloadable: int
    """How many (stage, microbatch)s could be."""
    result: SimResult
    plain: SimResult
    """The same schedule without offloading."""

    @property
    def slowdown(self) -> float:
        """Step time with offloading over step time without."""
        return self.result.makespan / self.plain.makespan if self.plain.makespan else 1.0

    def peaks(self) -> list[float]:
        """Per device, its peak memory (activations, and what it holds all step where the costs give it)."""
        return self.result.peak_memory


def parse_share(value: str | float, flag: str = "--offload-activations") -> float:
    """How much to offload, as ``flag`` takes it: ``all`` (1), ``none`` (0), or a fraction from 0 to 1 of the
    (stage, microbatch)s, the longest-lived first."""
    given = value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("all", "none"):
            return 1.0 if text == "all" else 0.0
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"cannot read {flag} {value!r}: use all, none or a fraction from 0 to 1 of the "
                              "activations, e.g. 0.5 (the longest-lived first)") from None
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 <= value <= 1):
        raise ConfigError(f"{flag} {given}: the share of activations to offload is from 0 to 1 (or all, none), "
                          "e.g. 0.5")
    return float(value)


def spans(result: SimResult) -> dict[tuple[int, int], tuple[float, float]]:
    """Per (stage, microbatch) with a backward: when its forward ends and when its backward (B or BW) starts, in the
    simulated ``result``."""
    done: dict[tuple[int, int], float] = {}
    back: dict[tuple[int, int], float] = {}
    for row in result.timeline:
        for iv in row:
            for a in iv.action.passes:
                if a.kind == Kind.F:
                    done[a.stage, a.microbatch] = iv.end
                elif a.kind in (Kind.B, Kind.BW):
                    back[a.stage, a.microbatch] = iv.start
    return {pair: (done[pair], start) for pair, start in back.items() if pair in done}


def lifetimes(result: SimResult) -> dict[tuple[int, int], float]:
    """Per (stage, microbatch) with a backward: the time from the end of its forward to the start of its backward
    (B or BW) in the simulated ``result``."""
    return {pair: start - end for pair, (end, start) in spans(result).items()}


def reload_ahead(schedule: Schedule, result: SimResult, cost: CostModel) -> dict[tuple[int, int], int]:
    """Per (stage, microbatch), how many computing actions before its backward its reload goes, from the simulated
    ``result`` of ``schedule`` without offloading: the latest place from which the copy back (its stage's
    ``offload`` time) still ends by the backward's start. A backward that waits (for a gradient from the next
    stage, in a warm-up) gets its reload late, so that activations do not come back long before they are read."""
    S, D = schedule.stages, schedule.devices
    copy = [cost.stage_cost(s, S, D, replicas=len(schedule.holders(s))).offload for s in range(S)]
    out: dict[tuple[int, int], int] = {}
    for row in result.timeline:
        starts: list[float] = []  # the start of each computing action so far on this device
        free = 0.0  # when the last of them ended
        for iv in row:
            act = iv.action
            if not (act.parts or act.spec.computes):
                continue
            for a in act.passes:
                if a.kind in (Kind.B, Kind.BW):
                    by = iv.start - copy[a.stage]  # the reload must start by then
                    # Just before the backward it starts when the device is free; k actions earlier, with the
                    # k-th computing action before it.
                    early, at = 0, free
                    while at > by + 1e-12 and early < len(starts):
                        early += 1
                        at = starts[-early]
                    out[a.stage, a.microbatch] = early
            starts.append(iv.start)
            free = iv.end
    return out


def _by_lifetime(schedule: Schedule, result: SimResult) -> list[tuple[int, int]]:
    life = lifetimes(result)
    order = offloadable_pairs(schedule)
    rank = {pair: k for k, pair in enumerate(order)}
    return sorted(order, key=lambda pair: (-life.get(pair, 0.0), rank[pair]))


def offload_fraction(schedule: Schedule, fraction: float, cost: CostModel | None = None) -> OffloadChoice:
    """Offload the longest-lived ``fraction`` (0..1) of the schedule's (stage, microbatch)s."""
    if isinstance(fraction, bool) or not (isinstance(fraction, (int, float)) and 0 <= fraction <= 1):
        raise ConfigError(f"the fraction of activations to offload is a number from 0 to 1 (got {fraction!r})")
    cost = cost or CostModel()
    plain = simulate(schedule, cost)
    order = _by_lifetime(schedule, plain)
    pairs = tuple(order[:round(fraction * len(order))])
    offloaded = with_offload(schedule, pairs, ahead=reload_ahead(schedule, plain, cost))
    return OffloadChoice(offloaded, pairs, len(order), simulate(offloaded, cost), plain)


def choose_offload(schedule: Schedule, budget: float, cost: CostModel | None = None, *,
                   progress: Progress | None = None) -> OffloadChoice:
    """Few (stage, microbatch)s to offload, so that every device's peak (activations and what it holds all step,
    in the cost model's units) fits ``budget``: on each device over it, one at a time, the longest-lived of those
    held across its peak; :class:`TooSmall` with the smallest peak offloading reaches when nothing fits."""
    if isinstance(budget, bool) or not (isinstance(budget, (int, float)) and budget > 0 and math.isfinite(budget)):
        raise ConfigError(f"the memory budget is a positive number (got {budget!r})")
    cost = cost or CostModel()
    plain = simulate(schedule, cost)
    order = _by_lifetime(schedule, plain)
    ahead = reload_ahead(schedule, plain, cost)
    rank = {pair: k for k, pair in enumerate(order)}
    left = set(order)
    chosen: list[tuple[int, int]] = []
    current, result = schedule, plain
    total = len(order)
    while True:
        if progress is not None:
            progress(len(chosen), total)
        over = [d for d, peak in enumerate(result.peak_memory) if peak > budget * (1 + _TOLERANCE)]
        if not over:
            return OffloadChoice(current, tuple(chosen), total, result, plain)
        span = spans(result)
        added = [pair for d in over if (pair := _at_peak(schedule, result, span, d, left, rank)) is not None]
        if not added:  # a device over the budget offloads all it can: the least any budget can be is then known
            full = simulate(with_offload(schedule, order, ahead=ahead), cost).peak_memory
            best = max(full)
            raise TooSmall(f"{schedule.name} does not fit a budget of {budget:g} even with every activation "
                           f"offloaded: its peak is then {best:.4g} (device {full.index(best)}); give a budget of at "
                           f"least {best:.4g}, or another schedule", least=best)
        chosen += added
        left -= set(added)
        current = with_offload(schedule, chosen, ahead=ahead)
        result = simulate(current, cost)


def _at_peak(schedule: Schedule, result: SimResult, span: dict[tuple[int, int], tuple[float, float]], device: int,
             left: set[tuple[int, int]], rank: dict[tuple[int, int], int]) -> tuple[int, int] | None:
    """The next (stage, microbatch) of ``device`` to offload: the longest-lived (earliest in ``rank``) of those held
    across the device's peak (their forward done, their backward not started), whose offload lowers it; else the
    longest-lived left on the device (it may move the peak); None when none is left."""
    mine = [pair for pair in left if schedule.device_of(*pair) == device]
    if not mine:
        return None
    curve = result.memory_curve[device]
    top = max(level for _, level in curve)
    at = next(t for t, level in curve if level >= top - 1e-12)
    held = [pair for pair in mine if span[pair][0] <= at < span[pair][1]]
    return min(held or mine, key=rank.__getitem__)


@dataclass(frozen=True)
class OffloadPoint:
    """One family in :func:`plan_offload`: its plain prediction and, where offloading makes it fit, the choice."""

    spec: str
    plain: SimResult
    choice: OffloadChoice | None
    """None: it fits without offloading, or cannot fit with it (``refused`` says why)."""
    refused: str = ""
    least: float | None = None
    """Where it cannot fit: its peak with every activation offloaded."""

    @property
    def fits(self) -> bool:
        return not self.refused

    @property
    def makespan(self) -> float:
        return (self.choice.result if self.choice is not None else self.plain).makespan


def plan_offload(p: int, m: int, budget: float, cost: CostModel | None = None, *,
                 families: Iterable[tuple[str, dict[str, int]]] | None = None,
                 progress: Progress | None = None) -> list[OffloadPoint]:
    """Every candidate schedule family for ``p`` devices and ``m`` microbatches, each made to fit ``budget`` with as
    little offloading as it needs: fitting ones first, fastest first."""
    cost = cost or CostModel()
    points = []
    todo = list(families if families is not None else candidates(p, m))
    for k, (name, options) in enumerate(todo):
        if progress is not None:
            progress(k, len(todo))
        spec = str(ScheduleRef.named(name, options))
        try:
            schedule = schedules.build(name, p, m, **options)
        except (ConfigError, ScheduleError):  # a family that cannot run this shape, as the plain planner skips it
            continue
        plain = simulate(schedule, cost)
        if max(plain.peak_memory) <= budget * (1 + _TOLERANCE):
            points.append(OffloadPoint(spec, plain, None))
            continue
        try:
            points.append(OffloadPoint(spec, plain, choose_offload(schedule, budget, cost)))
        except TooSmall as exc:
            points.append(OffloadPoint(spec, plain, None, refused=str(exc), least=exc.least))
    if progress is not None:
        progress(len(todo), len(todo))
    return sorted(points, key=lambda pt: (not pt.fits, pt.makespan, pt.spec))

