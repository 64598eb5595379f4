"""PipeFisher: K-FAC's work placed in a schedule's bubbles, spilling into later steps when they are too small.

K-FAC (:mod:`pipefold.runtime.kfac`) needs, per stage, curvature from every microbatch (``KA`` from its layer
inputs after its F, ``KG`` from its output gradients after its backward), then an inversion of the
factors (``KI``), and before every optimizer step the gradient preconditioned with the latest
inverses (``KP``). :func:`fill` takes a schedule and its simulated timeline and puts that work into
the idle time of each device, in time order::

    device 0:  F0 F1 F2 F3 [KA0 KA1 KA2 KI] B0 F4 B1 ...        the bubble before the first backward
    device 3:  [KI] F0 B0 KA0 KG0 F1 B1 ... B7 [KG6 KG7 KP]     the warm-up and the drain

A piece of work goes into a gap only when what it reads is there (its microbatch's F or B has ended,
or for ``KI`` the curvature of the refresh, M microbatches' of each factor, is placed) and it fits in
what is left of the gap, so the step takes no longer: inserted work starts when its device would
have idled and ends before the device's next action would have started. ``KP`` has to run every
step after the stage's last weight gradient; where no gap after it is long enough, it goes last and
lengthens the step. What one step
cannot hold spills into the next: the result is a *cycle* of schedules, step t running
``cycle[t % len(cycle)]``, in which every stage refreshes its factors at least once. A stage whose
bubbles stop holding its next piece of work refreshes with the curvature it has (at least one
microbatch's of each factor) and inverts where that delays the step least. Curvature a
cycle leaves over counts towards the next refresh. Exact when devices do not share cores (with
``CostModel.contention`` the gaps are those of the shared-core timeline, and inserted work slows the
others); the result's simulated steps say what it costs either way.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipefold.errors import ConfigError
from pipefold.ir import KA, KG, KI, KP, Action, Kind, Schedule
from pipefold.sim.simulate import CostModel, SimResult, StageOverride, simulate, split_backward

__all__ = ["KFAC_KINDS", "Filled", "Refill", "fill", "fit_latency", "inline", "measured_cost", "plain",
           "utilization"]

KFAC_KINDS = (Kind.KA, Kind.KG, Kind.KI, Kind.KP)
"""K-FAC's action kinds (see :mod:`pipefold.ir`)."""

_EPS = 1e-9


def utilization(result: SimResult) -> float:
    """Busy time over devices x step time (1 - bubble ratio), K-FAC's work counted as busy."""
    return 1.0 - result.bubble_ratio


@dataclass(frozen=True)
class Filled:
    """A schedule with K-FAC's work in its bubbles: the plain step and the cycle of filled steps."""

    base: SimResult
    steps: tuple[SimResult, ...]
    """One simulated step per schedule of the cycle."""
    refreshes: tuple[int, ...] = field(default=())
    """Per stage, how many times its factors are inverted in one cycle."""
    late: tuple[tuple[int, ...], ...] = field(default=())
    """Per step of the cycle, the stages that finished a refresh the bubbles could not hold (at the end of their
    device's list, the inversion moved to where it delays the step least): that step's passes may move."""

    @property
    def cycle(self) -> tuple[Schedule, ...]:
        return tuple(r.schedule for r in self.steps)

    @property
    def step_time(self) -> float:
        """Mean simulated step time over the cycle."""
        return sum(r.makespan for r in self.steps) / len(self.steps)

    @property
    def utilization(self) -> float:
        """Busy time over devices x time, over the whole cycle."""
        busy = sum(sum(r.busy) for r in self.steps)
        return busy / (self.base.schedule.devices * sum(r.makespan for r in self.steps))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.base.schedule.name, "devices": self.base.schedule.devices,
            "microbatches": self.base.schedule.microbatches, "cycle_steps": len(self.steps),
            "refreshes_per_cycle": list(self.refreshes), "late_stages": [list(x) for x in self.late],
            "base": {"step_time": self.base.makespan, "utilization": utilization(self.base),
                     "peak_memory": self.base.peak_memory},
            "filled": {"step_time": self.step_time, "utilization": self.utilization,
                       "step_times": [r.makespan for r in self.steps],
                       "peak_memory": [max(r.peak_memory[d] for r in self.steps)
                                       for d in range(self.base.schedule.devices)]},
            "cycle": [[[str(a) for a in row] for row in r.schedule.actions] for r in self.steps],
        }


@dataclass
class _Stage:
    """What one stage's K-FAC still has to do in the refresh under way."""

    device: int
    ka_left: int
    kg_left: int
    refreshes: int = 0


def fill(schedule: Schedule, cost: CostModel | None = None, *, slack: float = 0.0, max_steps: int = 16,
         g_from_w: frozenset[int] = frozenset()) -> Filled:
    """Place K-FAC's work in the bubbles of ``schedule`` under ``cost`` (whose ``work`` gives its times).

    ``g_from_w``: the stages whose layers get their output gradients from the microbatch's W, not its B (the first
    stage, whose first layer reads the batch: with a split backward its B stops before that layer); their ``KG``
    follows the W.

    ``slack`` lets each step grow by that fraction of the plain step (more room at the ends of the
    devices); ``max_steps`` bounds the cycle: a stage not refreshed by its last step ends its refresh
    there. Raises ConfigError for a replicated schedule (its replicas would gather different
    curvature) or a schedule that already has K-FAC actions.
    """
    cost = cost or CostModel()
    _check(schedule)
    if not 0 <= slack < 10:
        raise ConfigError(f"slack is a fraction of the step the filled step may add: 0..10 (got {slack!r})")
    if max_steps < 1:
        raise ConfigError(f"a cycle has at least one step (got max_steps={max_steps})")
    base = simulate(schedule, cost)
    limit = base.makespan * (1.0 + slack)
    S, M = schedule.stages, schedule.microbatches
    costs = [cost.stage_cost(s, S, schedule.devices) for s in range(S)]
    times = {(s, k): costs[s].work.get(k, 0.0) for s in range(S) for k in KFAC_KINDS}
    ready, grads_done = _ready_times(base, g_from_w)
    gaps = _gaps(base, limit)
    stages = [_Stage(schedule.device_of(s), M, M) for s in range(S)]
    steps: list[SimResult] = []
    lates: list[tuple[int, ...]] = []
    # Every stage inverts by the last step a cycle may have (a late stage ends its refresh there at the latest).
    while not (steps and all(st.refreshes for st in stages)):
        rows, late = _fill_step(schedule, stages, gaps, ready, grads_done, times, last=len(steps) == max_steps - 1)
        for stage in late:
            _settle(schedule, rows, cost, stage)
        steps.append(simulate(schedule.with_actions(rows), cost))
        lates.append(tuple(late))
    counts = tuple(sum(1 for r in steps for a in r.schedule.actions[st.device] if a == KI(s))
                   for s, st in enumerate(stages))
    return Filled(base, tuple(steps), counts, tuple(lates))


def inline(schedule: Schedule, cost: CostModel | None = None, *, g_from_w: frozenset[int] = frozenset()) -> Filled:
    """K-FAC without filling: curvature right after each pass it reads, inversion and preconditioning after the
    step's last pass of each stage, every step (what K-FAC costs when its work waits for nobody's bubbles).
    ``g_from_w`` as for :func:`fill`."""
    cost = cost or CostModel()
    _check(schedule)
    rows = []
    for device, row in enumerate(schedule.actions):
        out: list[Action] = []
        for act in row:
            out.append(act)
            for a in act.passes:
                if a.kind == Kind.F:
                    out.append(KA(a.stage, a.microbatch))
                elif a.kind == (Kind.W if a.stage in g_from_w else Kind.B) or a.kind == Kind.BW:
                    out.append(KG(a.stage, a.microbatch))
        for s in schedule.stages_of(device):
            out += [KI(s), KP(s)]
        rows.append(out)
    base = simulate(schedule, cost)
    return Filled(base, (simulate(schedule.with_actions(rows), cost),), (1,) * schedule.stages)


def plain(schedule: Schedule) -> Schedule:
    """``schedule`` without its K-FAC actions."""
    return schedule.with_actions([[a for a in row if a.kind not in KFAC_KINDS] for row in schedule.actions])


def measured_cost(cost: CostModel, times: dict[int, dict[str, float]]) -> CostModel:
    """``cost`` (whose stage overrides give each stage's memory and stash) with the times measured on the ranks:
    per stage, median seconds by kind (F, B and W or BW, K-FAC's). A stage or kind not measured keeps its own."""
    over = {}
    for s, old in cost.stage_overrides.items():
        got = times.get(s, {})
        timed = split_backward(got) if "F" in got else old
        work = {**(old.work or {}), **{k: v for k, v in got.items() if k in KFAC_KINDS}}
        # A KP before its stage's first inversion has nothing to do, so its median over the first steps can be
        # near 0: the time it takes with an inverse, timed before the run, is the least it is taken to cost.
        if old.work and Kind.KP in old.work:
            work[Kind.KP] = max(work.get(Kind.KP, 0.0), old.work[Kind.KP])
        over[s] = StageOverride(f=timed.f, b=timed.b, w=timed.w, bw=timed.bw, memory=old.memory, kept=old.kept,
                                memory_w=old.memory_w, work=work, stash=old.stash)
    return CostModel(stage_overrides=over, contention=cost.contention)


@dataclass(frozen=True)
class Refill:
    """Place K-FAC's work again once the ranks have run ``after`` steps, in the gaps of the step simulated from
    what they measured (:func:`measured_cost`) instead of from the costs timed before the run."""

    after: int
    schedule: Schedule
    """The plain schedule."""
    cost: CostModel
    """The costs the first placement used (their memory and stash stay)."""
    slack: float = 0.0
    max_steps: int = 16
    g_from_w: frozenset[int] = frozenset()
    """As for :func:`fill`."""
    data_parallel: bool = False
    """Every schedule of the new cycle averages each stage's gradients across data-parallel copies (``DP``
    actions, :func:`pipefold.schedules.dataparallel.with_data_parallel`), as the first cycle's do."""

    def __post_init__(self) -> None:
        if self.after < 2:
            raise ConfigError(f"refill after 2 steps or more: the first is a warm-up (got {self.after})")

    def plan(self, times: dict[int, dict[str, float]], ran: Sequence[tuple[Schedule, float]] = ()) -> Filled:
        """Place the work in the step simulated from the ranks' ``times``, with the latency per message that
        makes the steps that ``ran`` (each schedule with its measured seconds) last as long as they did."""
        cost = measured_cost(self.cost, times)
        cost = dataclasses.replace(cost, latency=fit_latency(cost, ran))
        filled = fill(self.schedule, cost, slack=self.slack, max_steps=self.max_steps, g_from_w=self.g_from_w)
        if not self.data_parallel:
            return filled
        from pipefold.schedules.dataparallel import with_data_parallel

        return dataclasses.replace(filled, steps=tuple(simulate(with_data_parallel(r.schedule), cost)
                                                       for r in filled.steps))


def fit_latency(cost: CostModel, ran: Sequence[tuple[Schedule, float]]) -> float:
    """The latency per message between devices at which the simulated steps of ``ran`` last, in the median, as
    long as measured: what the ranks lose between passes (gloo's messages, Python) that per-kind times do not
    hold. 0 when the simulation is already as long."""
    if not ran:
        return 0.0

    def ratio(latency: float) -> float:
        timed = dataclasses.replace(cost, latency=latency)
        return statistics.median(simulate(s, timed).makespan / max(wall, 1e-12) for s, wall in ran)

    if ratio(0.0) >= 1.0:
        return 0.0
    lo, hi = 0.0, max(wall for _, wall in ran)
    for _ in range(30):  # the step grows with the latency: bisect to a thousandth of a percent
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < 1.0 else (lo, mid)
    return lo


def _check(schedule: Schedule) -> None:
    if schedule.replicas > 1:
        raise ConfigError(f"{schedule.name} holds {schedule.replicas} replicas of each stage, whose K-FAC factors "
                          "would differ: fill the bubbles of a schedule with one replica (1f1b, zb-h1, v-half, ...)")
    if any(a.kind in (*KFAC_KINDS, Kind.OPT) for row in schedule.actions for act in row for a in act.passes):
        raise ConfigError(f"{schedule.name} already has K-FAC or optimizer (OPT) actions: give the plain schedule, "
                          "whose optimizer steps after the step")


def _ready_times(base: SimResult, g_from_w: frozenset[int]) -> tuple[dict[tuple[str, int, int], float],
                                                                     dict[int, float]]:
    """When each (pass, stage, microbatch) that K-FAC reads has ended (``"B"``: the pass that makes the output
    gradients, the W for a stage of ``g_from_w``), and when each stage's last W has."""
    ready: dict[tuple[str, int, int], float] = {}
    grads_done: dict[int, float] = {}
    for row in base.timeline:
        for iv in row:
            for a in iv.action.passes:
                if a.kind == Kind.F:
                    ready["F", a.stage, a.microbatch] = iv.end
                if a.kind == (Kind.W if a.stage in g_from_w else Kind.B) or a.kind == Kind.BW:
                    ready["B", a.stage, a.microbatch] = iv.end
                if a.kind in (Kind.W, Kind.BW, Kind.R):
                    grads_done[a.stage] = max(grads_done.get(a.stage, 0.0), iv.end)
    return ready, grads_done


def _gaps(base: SimResult, limit: float) -> list[list[tuple[int, float, float]]]:
    """Per device, its idle intervals as (position in its list that work put there goes before, start, end)."""
    out = []
    for row in base.timeline:
        gaps = []
        t = 0.0
        for i, iv in enumerate(row):
            if iv.start - t > _EPS:
                gaps.append((i, t, iv.start))
            t = max(t, iv.end)
        if limit - t > _EPS:
            gaps.append((len(row), t, limit))
        out.append(gaps)
    return out


def _fill_step(schedule: Schedule, stages: list[_Stage], gaps: list[list[tuple[int, float, float]]],
               ready: dict[tuple[str, int, int], float], grads_done: dict[int, float],
               times: dict[tuple[int, str], float], *, last: bool) -> tuple[list[list[Action]], list[int]]:
    """One step of the cycle: the plain action lists with K-FAC's work inserted where it fits.

    A stage not yet refreshed in this cycle whose refresh made no progress in this step's gaps (its
    bubbles cannot hold the next piece), or any such stage in the ``last`` step a cycle may have,
    ends its refresh with the curvature it has (adding one microbatch's of a factor that has none,
    at the end of its device's list), then inverts and preconditions; that step grows, and such
    stages are returned for :func:`_settle` to move their inversion where it delays the step least.
    """
    M = schedule.microbatches
    used: set[Action] = set()
    preconditioned: set[int] = set()
    inverted: set[int] = set()  # a KI waits for the step's curvature of its stage: none may follow it
    progressed: set[int] = set()  # stages whose refresh went on in this step's gaps
    late: list[int] = []  # stages that finish their refresh at the end
    inserts: list[list[tuple[int, Action]]] = [[] for _ in range(schedule.devices)]

    def candidates(device: int, t: float) -> list[Action]:
        """What may start on ``device`` at ``t``, most urgent first: KP, then KI, then the G curvature (only gaps
        after a backward can hold it), then the A curvature (the warm-up's gaps can), each in time order."""
        out: list[tuple[tuple[int, float], Action]] = []
        for s in schedule.stages_of(device):
            st = stages[s]
            if s not in preconditioned and grads_done[s] <= t + _EPS:
                out.append(((0, 0.0), KP(s)))
            if s in inverted:
                continue  # a KI waits for all of its step's curvature: none may come after it
            if st.ka_left == 0 and st.kg_left == 0:
                if s not in preconditioned:  # the KP of its step reads it: a KI after that KP waits a step
                    out.append(((1, 0.0), KI(s)))
                continue
            for j in range(M):
                for rank, make, left, needs in ((3, KA, st.ka_left, "F"), (2, KG, st.kg_left, "B")):
                    a = make(s, j)
                    at = ready[needs, s, j]
                    if left and a not in used and at <= t + _EPS:
                        out.append(((rank, at), a))
        return [a for _, a in sorted(out, key=lambda x: x[0])]

    def place(device: int, position: int, a: Action) -> None:
        inserts[device].append((position, a))
        used.add(a)
        st = stages[a.stage]
        if a.kind == Kind.KA:
            st.ka_left -= 1
        elif a.kind == Kind.KG:
            st.kg_left -= 1
        elif a.kind == Kind.KI:
            inverted.add(a.stage)
            st.refreshes += 1
            st.ka_left = st.kg_left = M
        else:
            preconditioned.add(a.stage)

    for device in range(schedule.devices):
        for position, start, end in gaps[device]:
            t = start
            while True:
                a = next((a for a in candidates(device, t) if times[a.stage, a.kind] <= end - t + _EPS), None)
                if a is None:
                    break
                place(device, position, a)
                if a.kind != Kind.KP:
                    progressed.add(a.stage)
                t += times[a.stage, a.kind]
        # Preconditioning is due every step: where no gap after the last weight gradient holds it, it goes
        # last and the step grows by it.
        end = len(schedule.actions[device])
        for s in schedule.stages_of(device):
            st = stages[s]
            if not st.refreshes and s not in inverted and (last or s not in progressed):
                # The refresh ends with the curvature the bubbles held (one microbatch's at least), so that the
                # cycle ends; the inversion goes where it delays the step least (_settle).
                _finish_late(s, st, end, M, used, place)
                inserts[device] = [(i, a) for i, a in inserts[device] if a != KP(s)]
                preconditioned.discard(s)
                place(device, end, KI(s))
                late.append(s)
            if s not in preconditioned:
                place(device, end, KP(s))
    rows = []
    for device, row in enumerate(schedule.actions):
        out: list[Action] = []
        by_position: dict[int, list[Action]] = {}
        for position, a in inserts[device]:
            by_position.setdefault(position, []).append(a)
        for i, a in enumerate(row):
            out += by_position.get(i, [])
            out.append(a)
        out += by_position.get(len(row), [])
        rows.append(out)
    return rows, late


def _settle(schedule: Schedule, rows: list[list[Action]], cost: CostModel, stage: int) -> None:
    """Move a late stage's inversion, then its preconditioning, to where the simulated step is shortest.

    No gap holds the inversion whole, but one may hold most of it: put there (after the step's
    curvature of the stage), it delays what follows by less than it would at the end.
    """
    device = schedule.device_of(stage)
    row = [a for a in rows[device] if a not in (KI(stage), KP(stage))]

    def span(candidate: list[Action]) -> float:
        trial = list(rows)
        trial[device] = candidate
        return simulate(schedule.with_actions(trial), cost).makespan

    def best(row: list[Action], a: Action, lo: int, then: list[Action]) -> list[Action]:
        at = min(range(lo, len(row) + 1), key=lambda i: (span(row[:i] + [a] + row[i:] + then), i))
        return row[:at] + [a] + row[at:]

    # After this step's curvature of the stage (which it folds in); the preconditioning waits at the end meanwhile.
    curvature = [i + 1 for i, a in enumerate(row) if a.stage == stage and a.kind in (Kind.KA, Kind.KG)]
    row = best(row, KI(stage), max(curvature, default=0), [KP(stage)])
    # After the inversion and every weight gradient of the stage.
    after = [i + 1 for i, act in enumerate(row) for a in act.passes
             if a.stage == stage and a.kind in (Kind.KI, Kind.W, Kind.BW)]
    rows[device] = best(row, KP(stage), max(after), [])


def _finish_late(stage: int, st: _Stage, end: int, microbatches: int, used: set[Action],
                 place: Callable[[int, int, Action], None]) -> None:
    """At the end of its device's list, the curvature a late stage needs to invert at all: one microbatch's of
    each factor that has none since the last inversion, from a microbatch this step has not used (a pass runs
    once a step)."""
    for make, left in ((KA, st.ka_left), (KG, st.kg_left)):
        if left == microbatches:
            a = next(a for j in range(microbatches) if (a := make(stage, j)) not in used)
            place(st.device, end, a)
