"""Data parallelism across whole pipelines: each stage's gradient all-reduce as an action of the schedule.

D copies of a pipeline run D shards of the global batch; before the optimizer steps, every stage's
gradients are averaged across the D copies. :func:`with_data_parallel` puts that all-reduce in each
device's list as ``sDP``, right after the stage's last weight gradient (and its all-reduce between
replicas, if any), so it runs beside the rest of the device's tail instead of after the step::

    device 0:  ... 1W7 1DP 0W6 0W7 0DP        stage 1's gradients travel while stage 0 finishes

The simulator costs it as a ring all-reduce of the stage's share of ``grad_bytes`` among
``CostModel.dp`` pipelines; the runtime starts it there and waits for it before the optimizer.

With ``shard=True`` the copies shard what they replicate instead (FSDP, torch's ``fully_shard`` per stage):
each keeps 1/dp of the stage's parameters, gradients and optimizer state. ``sAG`` gathers the parameters one
action ahead of the stage's first forward, so the gather runs under that action, and ``sRS`` takes the DP's
place: it reduce-scatters the gradients as soon as the last weight gradient is done and frees the gathered
parameters (the breadth-first pairing: gathered once per step, not once per microbatch)::

    device 0:  0AG 0F0 0F1 ... 1AG 0F3 1F0 ... 1W7 1RS 0W6 0W7 0RS
"""

from __future__ import annotations

from pipefold.errors import ConfigError
from pipefold.ir import AG, DP, RS, Kind, Schedule

__all__ = ["with_data_parallel"]


def with_data_parallel(schedule: Schedule, *, shard: bool = False) -> Schedule:
    """``schedule`` with each stage's ``DP`` (or, sharded, ``RS``) right after the last action that completes its
    gradients, and with ``shard`` each stage's ``AG`` one action before its first forward on the device."""
    if any(a.kind in (Kind.DP, Kind.AG, Kind.RS) for row in schedule.actions for act in row for a in act.passes):
        raise ConfigError(f"{schedule.name} already reduces across data-parallel pipelines (DP, AG or RS actions)")
    reduce = RS if shard else DP
    rows = []
    for row in schedule.actions:
        last: dict[int, int] = {}
        first: dict[int, int] = {}
        for i, act in enumerate(row):
            for a in act.passes:
                if a.kind in (Kind.W, Kind.BW, Kind.R):
                    last[a.stage] = i
                if a.kind == Kind.F:
                    first.setdefault(a.stage, i)
        after: dict[int, list[int]] = {}
        for stage, i in last.items():
            after.setdefault(i, []).append(stage)
        before: dict[int, list[int]] = {}
        if shard:
            for stage, i in first.items():
                before.setdefault(max(i - 1, 0), []).append(stage)
        out = []
        for i, act in enumerate(row):
            out += [AG(s) for s in sorted(before.get(i, ()))]
            out.append(act)
            out += [reduce(s) for s in sorted(after.get(i, ()))]
        rows.append(out)
    return schedule.with_actions(rows)
