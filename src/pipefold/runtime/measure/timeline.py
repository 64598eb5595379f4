"""Measured timelines: what the ranks recorded, as a trace file, in the simulator's result shape, and as the
cost model that lets the simulator predict the same run."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from pipefold.ir import Schedule
from pipefold.ir.graph import dependency_graph
from pipefold.runtime.executor import COMPUTE_KINDS
from pipefold.runtime.history import step_number
from pipefold.runtime.launch.job import RankReport
from pipefold.runtime.pipeline import step_costs, step_result
from pipefold.sim.simulate import CostModel, SimResult


def measured_result(schedule: Schedule, reports: list[RankReport], step: int) -> SimResult:
    """One step's measured compute intervals and memory curves as a :class:`SimResult` (seconds from the earliest
    rank's start, bytes): :func:`pipefold.runtime.pipeline.step_result` of the ranks' records of ``step``."""
    return step_result([r.steps[step] for r in sorted(reports, key=lambda r: r.rank)], schedule)


def measured_costs(schedule: Schedule, reports: list[RankReport], step: int) -> CostModel:
    """The cost model of what the ranks measured in ``step`` (:func:`pipefold.runtime.pipeline.step_costs`): the
    simulator fed with it predicts the run in seconds and bytes."""
    return step_costs([r.steps[step] for r in reports], schedule)


def measured_trace(reports: list[RankReport]) -> dict[str, Any]:
    """Chrome trace-event JSON of every rank's F/B/W/send/recv events over the steps it kept in full (the first
    ``Job.keep_steps`` and the last; Perfetto opens it); an action's CPU time on its rank's thread, where measured
    (:attr:`~pipefold.runtime.executor.Event.cpu`), is its ``cpu_us``."""
    t0 = min(r.steps[0].started_at for r in reports)
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "pipefold train"}}]
    for r in reports:
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r.rank, "args": {"name": f"rank {r.rank}"}})
        for i in r.steps.kept():
            s, number = r.steps[i], step_number(r.first_step + i)
            base = (s.started_at - t0) * 1e6
            for e in s.events:
                args: dict[str, Any] = {"step": number}
                if e.cpu is not None:
                    args["cpu_us"] = e.cpu * 1e6
                events.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": 0, "tid": r.rank,
                               "ts": base + e.start * 1e6, "dur": (e.end - e.start) * 1e6, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_measured_trace(reports: list[RankReport], path: str) -> None:
    """Write :func:`measured_trace` to ``path`` atomically."""
    from pipefold.files import write_json

    write_json(path, measured_trace(reports))


def measured_summary(reports: list[RankReport], warmup: int = 1) -> dict[str, Any]:
    """What a run measured, in the planner's terms, over the steps after the first ``warmup`` ones that ran plain
    (:meth:`~pipefold.runtime.history.StepHistory.timed`; ``steps`` lists them, numbered from 0):
    - the median step time, from the first rank's start to the last rank's end: the schedule and what follows it
      (the gradients' check, the optimizer step, ZeRO-1's sharing), as the plan predicts it; the median of the
      schedule's alone (``schedule_time_s``), and of the time from the last rank's end of its schedule to the
      step's end (``after_schedule_s``: the plan's ``after_step``);
    - the bubble ratio, 1 - busy / (ranks x the schedule's time), and the CPU time the processes spent over ranks x
      that time (the operating system's count, a check on busy time where each rank has a core of its own);
    - each rank's peak bytes: the most activations its meter held in any step, plus its parameters,
      gradients and optimizer state, and with FSDP its stages' parameters and gradients gathered whole (held
      from each stage's ``AG`` to its ``RS``)."""
    later = reports[0].steps.timed(warmup)  # every rank ran the same steps checked
    # A step spans from the first rank's start to the last rank's end (ranks start apart: their clocks agree).
    starts = [min(r.steps.started_at[i] for r in reports) for i in later]
    schedules = [end - start for end, start in zip(_ends(reports, later, False), starts, strict=True)]
    walls = [end - start for end, start in zip(_ends(reports, later, True), starts, strict=True)]
    tails = [tail(reports, i) for i in later]
    step = statistics.median(schedules)  # the schedule's, what bubbles are a part of
    busy = [statistics.median(r.steps.busy[i] for i in later) for r in reports]
    cpu = [statistics.median(r.steps.cpu[i] for i in later) for r in reports]
    return {"steps": list(later),
            "step_time_s": statistics.median(walls), "step_time_spread_s": [min(walls), max(walls)],
            "schedule_time_s": step, "schedule_time_spread_s": [min(schedules), max(schedules)],
            "after_schedule_s": statistics.median(tails),
            "bubble_ratio": 1.0 - sum(busy) / (len(reports) * step) if step else 0.0,
            "cpu_utilization": sum(cpu) / (len(reports) * step) if step else 0.0,
            "activation_peak_bytes": [r.steps.peak_activation_bytes for r in reports],
            "static_bytes": [r.static_bytes for r in reports],
            "gathered_bytes": [r.gathered_bytes for r in reports],
            "peak_bytes": [r.steps.peak_activation_bytes + r.static_bytes + r.gathered_bytes for r in reports]}


def _ends(reports: list[RankReport], steps: Iterable[int], update: bool) -> list[float]:
    """When the last rank ended each of ``steps`` (wall clock): its schedule, or with ``update`` its whole step."""
    return [max(r.steps.started_at[i] + r.steps.wall[i] + (r.steps.update[i] if update else 0.0) for r in reports)
            for i in steps]


def tail(reports: list[RankReport], step: int) -> float:
    """Seconds from the last rank's end of ``step``'s schedule to the step's end: the update after the schedule
    (check, optimizer step, ZeRO-1's sharing) as the step pays it; a rank that ended its schedule earlier waits in
    the check, which this leaves out."""
    return _ends(reports, (step,), True)[0] - _ends(reports, (step,), False)[0]


_NOT_COLLECTIVE = COMPUTE_KINDS | {"recv", "send"}
"""The events that are not collectives among ranks (R, DP, AG, RS, and the waits for them, kind "comm")."""


def step_parts(reports: list[RankReport], warmup: int = 1) -> list[dict[str, float]]:
    """Where each rank's step goes, medians over its fully kept steps after the first ``warmup``: ``step`` (the
    executor's wall time), ``compute`` (its passes, from its own events), ``recv wait`` (blocked on a receive),
    ``send wait`` (on the delivery of sends), ``collectives`` (the data-parallel copies' all-reduces, FSDP's
    gathers and reduce-scatters, the replicas' all-reduces, and the waits for them), ``runtime`` (the rest: the
    executor's own work between passes, posting receives and sends, bookkeeping), ``cpu`` (the operating
    system's CPU seconds of the process) and
    ``update`` (after the schedule: the check and the optimizer step); on the CPU also ``compute cpu``, the
    passes' own CPU seconds on the executor's thread (:attr:`~pipefold.runtime.executor.Event.cpu`): ``compute``
    over it is how much longer the passes took for sharing the cores."""
    out = []
    for r in reports:
        rows = []
        for i in r.steps.settled(warmup):
            st = r.steps[i]
            passes = [e for e in st.events if e.kind in COMPUTE_KINDS]
            compute = sum(e.end - e.start for e in passes)
            recv = sum(e.end - e.start for e in st.events if e.kind == "recv")
            sent = sum(e.end - e.start for e in st.events if e.kind == "send")
            together = sum(e.end - e.start for e in st.events if e.kind not in _NOT_COLLECTIVE)
            row = {"step": st.wall, "compute": compute, "recv wait": recv, "send wait": sent, "collectives": together,
                   "runtime": st.wall - compute - recv - sent - together, "cpu": st.cpu, "update": st.update}
            if passes and all(e.cpu is not None for e in passes):
                row["compute cpu"] = sum(e.cpu or 0.0 for e in passes)
            rows.append(row)
        out.append({k: statistics.median(row[k] for row in rows) for k in rows[0] if all(k in row for row in rows)})
    return out


def replayed_step(schedule: Schedule, reports: list[RankReport], step: int) -> tuple[float, list[float]]:
    """Step ``step`` replayed with no runtime at all: every action lasting what it took in the run (its compute
    events), starting as soon as its rank is free and its inputs are done (:func:`pipefold.ir.graph.dependency_graph`'s
    traversal), with no time for messages nor between passes. Returns (the replayed step's seconds, each rank's
    busy seconds in it)."""
    took = []
    for d, r in enumerate(sorted(reports, key=lambda r: r.rank)):
        spent: dict[str, float] = {}
        for e in r.steps[step].events:
            if e.kind in COMPUTE_KINDS:
                spent[e.name] = spent.get(e.name, 0.0) + e.end - e.start
        took.append([spent.get(str(a), 0.0) for a in schedule.actions[d]])
    graph = dependency_graph(schedule, [t for row in took for t in row])
    return max(graph.ends), [sum(row) for row in took]


def replayed_busy(schedule: Schedule, reports: list[RankReport], warmup: int = 1) -> list[float]:
    """Per rank, its passes' share of the step replayed (:func:`replayed_step`), the median over its fully kept steps
    after the first ``warmup``: the run's waits as they would be if they came from the schedule's dependencies and
    the passes' own times alone, step by step (a pass that ran slow in one step delays its dependants there, which
    a simulation of median times does not show)."""
    shares: list[list[float]] = [[] for _ in reports]
    for i in reports[0].steps.settled(warmup):
        makespan, busy = replayed_step(schedule, reports, i)
        for d, b in enumerate(busy):
            shares[d].append(b / makespan)
    return [statistics.median(x) for x in shares]


def per_step(reports: list[RankReport]) -> list[dict[str, Any]]:
    """Each step: the schedule it ran, the seconds the ranks waited on receives (mean over ranks), what the
    policy predicted, what it took (the slowest rank), and when it started (seconds from the first step)."""
    t0 = min(r.steps.started_at[0] for r in reports)
    rows = []
    for i in range(len(reports[0].steps)):
        rows.append({"step": step_number(reports[0].first_step + i), "schedule": reports[0].steps.schedule(i),
                     "wait_s": sum(r.steps.wait[i] for r in reports) / len(reports),
                     "predicted_s": reports[0].steps.prediction(i), "measured_s": max(r.steps.wall[i] for r in reports),
                     "started_s": min(r.steps.started_at[i] for r in reports) - t0})
    return rows
