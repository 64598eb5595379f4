"""Measured timelines: what the ranks recorded, as a trace file and in the simulator's result shape."""

from __future__ import annotations

import json
from typing import Any

from pipefold.ir import Action, Schedule
from pipefold.runtime.launch import RankReport
from pipefold.simulate import CostModel, Interval, SimResult

_COMPUTE = ("F", "B", "W", "BW")


def measured_result(schedule: Schedule, reports: list[RankReport], step: int) -> SimResult:
    """One step's measured compute intervals as a :class:`SimResult` (times in seconds from the earliest rank)."""
    t0 = min(r.steps[step].started_at for r in reports)
    rows = []
    for r in sorted(reports, key=lambda r: r.rank):
        s = r.steps[step]
        shift = s.started_at - t0
        rows.append(tuple(Interval(Action.parse(e.name), shift + e.start, shift + e.end)
                          for e in s.events if e.kind in _COMPUTE))
    return SimResult(schedule, CostModel(), tuple(rows), tuple(((0.0, 0.0),) for _ in rows))


def measured_trace(reports: list[RankReport]) -> dict[str, Any]:
    """Chrome trace-event JSON of every rank's F/B/W/send/recv events over all steps (Perfetto opens it)."""
    t0 = min(r.steps[0].started_at for r in reports)
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "pipefold train"}}]
    for r in reports:
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r.rank, "args": {"name": f"rank {r.rank}"}})
        for i, s in enumerate(r.steps):
            base = (s.started_at - t0) * 1e6
            for e in s.events:
                events.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": 0, "tid": r.rank,
                               "ts": base + e.start * 1e6, "dur": (e.end - e.start) * 1e6, "args": {"step": i}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_measured_trace(reports: list[RankReport], path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(measured_trace(reports), fh)
