"""Vocabulary Parallelism (Yeung et al., 2025) as a schedule transform: any schedule of forwards and backwards with
its output layer split by vocabulary over every device.

Each microbatch m gets, on every device d, a vocabulary forward ``dS<m>`` (device d's shard of the logits, their
per-token max and sum of exponentials) and a vocabulary backward ``dT<m>`` (the shard's softmax, its part of the
gradient of the last stage's output, its weight gradient). ``S`` waits for the last stage's forward of m, ``T``
for every device's ``S`` of m, and the last stage's backward of m for every device's ``T`` of m
(:attr:`pipefold.ir.Schedule.vocab`).

Where they go: the transform runs the schedule forward in time (forward, input and weight gradient one unit each,
a vocabulary pass ``s`` and ``t`` units) and places each vocabulary pass on each device as soon as it is ready,
before the device's next pass when both are ready at once; every device runs its ``S`` and its ``T`` in microbatch
order. While a device's next backward waits for the vocabulary passes, it may run up to ``ahead`` of its later
forwards first, so that the last stage keeps computing while the shards work (each such forward holds one more
microbatch's activations until its backward). The result is an order the dependencies allow by construction, and
the dependency graph validates it like any other schedule.
"""

from __future__ import annotations

import math
from dataclasses import replace

from pipefold.errors import ConfigError
from pipefold.ir import VOCAB, Action, Kind, Schedule, validate
from pipefold.ir.kinds import S, T

__all__ = ["MOST_AHEAD", "with_vocab"]

MOST_AHEAD = 4
"""The most later forwards a device may run while its next backward waits for the vocabulary passes, where the
transform picks the count."""

_TIME = {Kind.F: 1.0, Kind.B: 1.0, Kind.W: 1.0, Kind.BW: 2.0}


def with_vocab(schedule: Schedule, *, s: float = 0.25, t: float = 0.25, ahead: int | None = None) -> Schedule:
    """``schedule`` with its output layer split by vocabulary over its devices: an ``S`` and a ``T`` of every
    microbatch on every device, placed as the module says (``s`` and ``t``: the vocabulary passes' times in units of
    a forward; ``ahead``: forwards a device may run before a backward that waits for them; None: from 0 up, one more
    while the placement then ends sooner, at most :data:`MOST_AHEAD`)."""
    if schedule.vocab:
        raise ConfigError(f"{schedule.name} splits its output layer by vocabulary already")
    if schedule.replicas > 1:
        raise ConfigError(f"{schedule.name} holds {schedule.replicas} replicas of its stages: the vocabulary layer "
                          "is split over the devices of one pipeline; use a schedule with one replica (1f1b, zb-v, "
                          "v-half, ...)")
    other = sorted({a.kind for row in schedule.actions for a in row if a.parts or a.kind not in _TIME})
    if other:
        raise ConfigError(f"{schedule.name} has {', '.join(other)} actions: the vocabulary passes are placed among "
                          "forwards and backwards (F, B, W, BW) only; add data parallelism, offloading or K-FAC "
                          "after them")
    if schedule.devices > schedule.stages:
        raise ConfigError(f"{schedule.name} has {schedule.devices} devices but {schedule.stages} stages: every "
                          "device holds a stage and a shard of the vocabulary layer")
    if not all(math.isfinite(x) and x >= 0 for x in (s, t)):
        raise ConfigError(f"the vocabulary passes' times are numbers >= 0 (got s={s!r}, t={t!r})")
    if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0):
        raise ConfigError(f"ahead is how many forwards may run before a waiting backward: 0 or more (got {ahead!r})")
    if ahead is not None:
        rows = _place(schedule, s, t, ahead)[2]
    else:  # more forwards ahead while each try ends sooner than the best before it
        best = _place(schedule, s, t, 0)
        for k in range(1, MOST_AHEAD + 1):
            got = _place(schedule, s, t, k)
            if got[0] >= best[0]:
                break
            best = got
        rows = best[2]
    return validate(replace(schedule, actions=tuple(map(tuple, rows)), options={**schedule.options, VOCAB: 1}))


def _place(schedule: Schedule, s: float, t: float, ahead: int) -> tuple[float, int, list[list[Action]]]:
    """The rows with the vocabulary passes placed, with the time the placement ends and ``ahead``."""
    D, M, last = schedule.devices, schedule.microbatches, schedule.stages - 1
    base = [list(row) for row in schedule.actions]
    done: dict[tuple[str, int, int], float] = {}  # (pass, stage or shard, microbatch) -> end
    ran = [[False] * len(row) for row in base]
    head = [0] * D  # each device's first action of its base row not run yet
    early = [0] * D  # forwards run before their place in the base row, not yet passed by ``head``
    free = [0.0] * D
    next_s, next_t = [0] * D, [0] * D
    out: list[list[Action]] = [[] for _ in range(D)]

    def ready(a: Action) -> float | None:
        """When ``a``'s inputs are done (None: not yet known)."""
        need: list[tuple[str, int, int]] = []
        if a.kind == Kind.F:
            if a.stage > 0:
                need.append((Kind.F, a.stage - 1, a.microbatch))
        elif a.kind in (Kind.B, Kind.BW):
            need.append((Kind.F, a.stage, a.microbatch))
            if a.stage < last:
                need.append((Kind.B, a.stage + 1, a.microbatch))
            else:
                need += [(Kind.T, d, a.microbatch) for d in range(D)]
        elif a.kind == Kind.W:
            need.append((Kind.B, a.stage, a.microbatch))
        elif a.kind == Kind.S:
            need.append((Kind.F, last, a.microbatch))
        else:  # T
            need += [(Kind.S, d, a.microbatch) for d in range(D)]
        ends = [done.get(n) for n in need]
        return None if None in ends else max(ends, default=0.0)  # type: ignore[type-var]

    fscan = [0] * D  # where the search for each device's next early forward goes on from

    def next_forward(d: int) -> int | None:
        j = max(fscan[d], head[d] + 1)
        row, done_ = base[d], ran[d]
        while j < len(row) and (done_[j] or row[j].kind != Kind.F):
            j += 1
        fscan[d] = j
        return j if j < len(row) else None

    def candidates(d: int) -> tuple[float, int, int, Action, int] | None:
        """(start, preference, base position or -1, action, device) of what device d would run next."""
        got = []
        if next_t[d] < next_s[d] and (r := ready(T(d, next_t[d]))) is not None:
            got.append((max(r, free[d]), 0, -1, T(d, next_t[d]), d))
        if next_s[d] < M and (r := ready(S(d, next_s[d]))) is not None:
            got.append((max(r, free[d]), 1, -1, S(d, next_s[d]), d))
        i = head[d]
        if i < len(base[d]):
            a = base[d][i]
            r = ready(a)
            if r is not None:
                got.append((max(r, free[d]), 2, i, a, d))
            elif a.kind in (Kind.B, Kind.BW) and early[d] < ahead:
                j = next_forward(d)
                if j is not None and (r := ready(base[d][j])) is not None:
                    got.append((max(r, free[d]), 3, j, base[d][j], d))
        return min(got, default=None)

    device_of = {(st, 0): dev for st, dev in enumerate(schedule.placement[0])}
    cached = [candidates(d) for d in range(D)]
    total = sum(map(len, base)) + 2 * D * M
    for _ in range(total):
        best = min((c for c in cached if c is not None), default=None)
        if best is None:  # the base schedule was valid, so this cannot happen; say so rather than loop
            raise ConfigError(f"{schedule.name}: the vocabulary passes could not be placed (no device can go on)")
        start, _, position, a, d = best
        end = start + (s if a.kind == Kind.S else t if a.kind == Kind.T else _TIME[a.kind])
        free[d] = end
        out[d].append(a)
        if a.kind == Kind.S:
            next_s[d] += 1
        elif a.kind == Kind.T:
            next_t[d] += 1
        else:
            ran[d][position] = True
            if position != head[d]:
                early[d] += 1
            else:
                head[d] += 1
                while head[d] < len(base[d]) and ran[d][head[d]]:
                    head[d] += 1
                    early[d] -= 1
        for p in (a.kind,) if a.kind != Kind.BW else (Kind.B, Kind.W):
            done[(p, a.stage, a.microbatch)] = end
        # Who may go on now: this device, and those that wait for what it gave.
        dirty = {d}
        if a.kind in (Kind.S,) or (a.kind == Kind.F and a.stage == last):
            dirty = set(range(D))
        elif a.kind == Kind.F:
            dirty.add(device_of[a.stage + 1, 0])
        elif a.kind in (Kind.B, Kind.BW) and a.stage > 0:
            dirty.add(device_of[a.stage - 1, 0])
        elif a.kind == Kind.T:
            dirty.add(device_of[last, 0])
        for x in dirty:
            cached[x] = candidates(x)
    return max(free), ahead, out
