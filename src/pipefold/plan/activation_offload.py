"""Which activations to offload (PipeOffload's selective strategy), and the schedule that fits a budget with them.

A microbatch's activations on a stage live from the end of its forward to the start of its backward. Offloading
them costs two copies over the host link (``CostModel.offload`` each way); it is free when the copies fit in that
lifetime beside the compute, and it lowers the device's peak only where they were held at the peak. So the planner
offloads the longest-lived first: on each device over the budget it adds the longest-lived pair not offloaded yet,
simulates again, and stops when every device fits (or nothing is left, which it says with the smallest peak it
reached). :func:`plan_offload` does that for every registered schedule family and keeps the fastest that fits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from pipefold import schedules
from pipefold.errors import ConfigError
from pipefold.ir import Kind, Schedule
from pipefold.ir.ref import ScheduleRef
from pipefold.plan.budget import Progress, candidates
from pipefold.schedules.offload import offloadable_pairs, with_offload
from pipefold.sim.simulate import CostModel, SimResult, simulate

__all__ = ["OffloadChoice", "OffloadPoint", "choose_offload", "lifetimes", "offload_fraction", "plan_offload",
           "reload_ahead"]

_TOLERANCE = 1e-9


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
    def fraction(self) -> float:
        """The share of the offloadable (stage, microbatch)s offloaded."""
        return len(self.pairs) / self.offloadable if self.offloadable else 0.0

    @property
    def slowdown(self) -> float:
        """Step time with offloading over step time without."""
        return self.result.makespan / self.plain.makespan if self.plain.makespan else 1.0

    def peaks(self) -> list[float]:
        """Per device, the peak of activation memory plus what it holds all step (``SimResult.static_memory``)."""
        return _totals(self.result)


def _totals(result: SimResult) -> list[float]:
    return [a + s for a, s in zip(result.peak_memory, result.static_memory, strict=True)]


def lifetimes(schedule: Schedule, result: SimResult) -> dict[tuple[int, int], float]:
    """Per (stage, microbatch) with a backward: the time from the end of its forward to the start of its backward
    (B or BW) in the simulated ``result`` of ``schedule``."""
    done: dict[tuple[int, int], float] = {}
    out: dict[tuple[int, int], float] = {}
    rows = result.timeline
    for row in rows:
        for iv in row:
            for a in iv.action.passes:
                if a.kind == Kind.F:
                    done[a.stage, a.microbatch] = iv.end
    for row in rows:
        for iv in row:
            for a in iv.action.passes:
                if a.kind in (Kind.B, Kind.BW) and (a.stage, a.microbatch) in done:
                    out[a.stage, a.microbatch] = iv.start - done[a.stage, a.microbatch]
    return out


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
    life = lifetimes(schedule, result)
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
    """The fewest longest-lived (stage, microbatch)s to offload so that every device's peak (activations and what
    it holds all step, in the cost model's units) fits ``budget``; :class:`ConfigError` with the smallest peak
    offloading reaches when nothing fits."""
    if isinstance(budget, bool) or not (isinstance(budget, (int, float)) and budget > 0 and math.isfinite(budget)):
        raise ConfigError(f"the memory budget is a positive number (got {budget!r})")
    cost = cost or CostModel()
    plain = simulate(schedule, cost)
    order = _by_lifetime(schedule, plain)
    ahead = reload_ahead(schedule, plain, cost)
    per_device: dict[int, list[tuple[int, int]]] = {}
    for pair in order:
        per_device.setdefault(schedule.device_of(*pair), []).append(pair)
    chosen: list[tuple[int, int]] = []
    current, result = schedule, plain
    total = len(order)
    while True:
        if progress is not None:
            progress(len(chosen), total)
        over = [d for d, peak in enumerate(_totals(result)) if peak > budget * (1 + _TOLERANCE)]
        if not over:
            return OffloadChoice(current, tuple(chosen), total, result, plain)
        added = [per_device[d].pop(0) for d in over if per_device.get(d)]
        if not added:
            best = max(_totals(result))
            raise ConfigError(f"{schedule.name} does not fit a budget of {budget:g} even with every activation "
                              f"offloaded: its peak is then {best:.4g} (device {over[0]}); give a budget of at least "
                              f"{best:.4g}, or another schedule")
        chosen += added
        current = with_offload(schedule, chosen, ahead=ahead)
        result = simulate(current, cost)


@dataclass(frozen=True)
class OffloadPoint:
    """One family in :func:`plan_offload`: its plain prediction and, where offloading makes it fit, the choice."""

    spec: str
    plain: SimResult
    choice: OffloadChoice | None
    """None: it fits without offloading, or cannot fit with it (``refused`` says why)."""
    refused: str = ""

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
        schedule = schedules.build(name, p, m, **options)
        spec = str(ScheduleRef.named(name, options))
        plain = simulate(schedule, cost)
        if max(_totals(plain)) <= budget * (1 + _TOLERANCE):
            points.append(OffloadPoint(spec, plain, None))
            continue
        try:
            points.append(OffloadPoint(spec, plain, choose_offload(schedule, budget, cost)))
        except ConfigError as exc:
            points.append(OffloadPoint(spec, plain, None, refused=str(exc)))
    if progress is not None:
        progress(len(todo), len(todo))
    return sorted(points, key=lambda pt: (not pt.fits, pt.makespan, pt.spec))

