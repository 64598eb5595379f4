"""Data parallelism across whole pipelines: each stage's gradient all-reduce as an action of the schedule.

D copies of a pipeline run D shards of the global batch; before the optimizer steps, every stage's
gradients are averaged across the D copies. :func:`with_data_parallel` puts that all-reduce in each
device's list as ``sDP``, right after the stage's last weight gradient (and its all-reduce between
replicas, if any), so it runs beside the rest of the device's tail instead of after the step::

    device 0:  ... 1W7 1DP 0W6 0W7 0DP        stage 1's gradients travel while stage 0 finishes

The simulator costs it as a ring all-reduce of the stage's share of ``grad_bytes`` among
``CostModel.dp`` pipelines; the runtime starts it there and waits for it before the optimizer.
"""

from __future__ import annotations

from pipefold.errors import ConfigError
from pipefold.ir import DP, Kind, Schedule

__all__ = ["with_data_parallel"]


def with_data_parallel(schedule: Schedule) -> Schedule:
    """``schedule`` with each stage's ``DP`` right after the last action that completes its gradients."""
    if any(a.kind == Kind.DP for row in schedule.actions for act in row for a in act.passes):
        raise ConfigError(f"{schedule.name} already all-reduces across data-parallel pipelines (DP actions)")
    rows = []
    for row in schedule.actions:
        last: dict[int, int] = {}
        for i, act in enumerate(row):
            for a in act.passes:
                if a.kind in (Kind.W, Kind.BW, Kind.R):
                    last[a.stage] = i
        after: dict[int, list[int]] = {}
        for stage, i in last.items():
            after.setdefault(i, []).append(stage)
        out = []
        for i, act in enumerate(row):
            out.append(act)
            out += [DP(s) for s in sorted(after.get(i, ()))]
        rows.append(out)
    return schedule.with_actions(rows)
