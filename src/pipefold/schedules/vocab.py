"""Vocabulary Parallelism (Yeung et al., 2025) as a schedule transform: any schedule of forwards and backwards with
its output layer split by vocabulary over every device.

Each microbatch m gets, on every device d, a vocabulary forward ``dS<m>`` (device d's shard of the logits, their
per-token max and sum of exponentials) and a vocabulary backward ``dT<m>`` (the shard's softmax, its part of the
gradient of the last stage's output, its weight gradient). ``S`` waits for the last stage's forward of m, ``T``
for every device's ``S`` of m, and the last stage's backward of m for every device's ``T`` of m
(:attr:`pipefold.ir.Schedule.vocab`).

Where they go: the transform runs the schedule forward in time (forward, input and weight gradient one unit each,
a vocabulary pass ``s`` and ``t`` units) and, whenever a device is free, runs what can start first: its next pass
of the schedule in the schedule's order, or its next ``T`` or ``S`` (every device runs them in microbatch order). A
vocabulary pass that can start within :data:`SLACK` of that pass's time goes first, as the last stage's backward
waits for every device's ``T``: a device that starts a long backward instead would hold the whole pipeline up. The
result is an order the dependencies allow by construction, and the dependency graph validates it like any other
schedule.
"""

from __future__ import annotations

import math
from dataclasses import replace

from pipefold.errors import ConfigError
from pipefold.ir import VOCAB, Action, Kind, Schedule, validate
from pipefold.ir.kinds import S, T

__all__ = ["SLACK", "with_vocab"]

SLACK = 0.25
"""A device runs a vocabulary pass before its next pass of the schedule when it can start within this share of that
pass's time of when the pass could."""

_TIME = {Kind.F: 1.0, Kind.B: 1.0, Kind.W: 1.0, Kind.BW: 2.0}


def with_vocab(schedule: Schedule, *, s: float = 0.25, t: float = 0.25) -> Schedule:
    """``schedule`` with its output layer split by vocabulary over its devices: an ``S`` and a ``T`` of every
    microbatch on every device, placed as the module says (``s`` and ``t``: the vocabulary passes' times in units of
    a forward)."""
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
    rows = _place(schedule, s, t)
    return validate(replace(schedule, actions=tuple(map(tuple, rows)), options={**schedule.options, VOCAB: 1}))


def _place(schedule: Schedule, s: float, t: float) -> list[list[Action]]:
    """The rows with the vocabulary passes placed."""
    D, M, last = schedule.devices, schedule.microbatches, schedule.stages - 1
    base = [list(row) for row in schedule.actions]
    done: dict[tuple[str, int, int], float] = {}  # (pass, stage or shard, microbatch) -> end
    head = [0] * D  # each device's next action of its base row
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

    def candidates(d: int) -> tuple[float, int, int, Action, int] | None:
        """(start, preference, 1 for a pass of the schedule, action, device) of what device d would run next."""
        vocab = []
        if next_t[d] < next_s[d] and (r := ready(T(d, next_t[d]))) is not None:
            vocab.append((max(r, free[d]), 0, 0, T(d, next_t[d]), d))
        if next_s[d] < M and (r := ready(S(d, next_s[d]))) is not None:
            vocab.append((max(r, free[d]), 1, 0, S(d, next_s[d]), d))
        own = None
        if head[d] < len(base[d]):
            a = base[d][head[d]]
            if (r := ready(a)) is not None:
                own = (max(r, free[d]), 2, 1, a, d)
        first = min(vocab, default=None)
        if first is not None and own is not None and first[0] <= own[0] + SLACK * _TIME[own[3].kind]:
            return first
        return min((c for c in (first, own) if c is not None), default=None)

    device_of = {(st, 0): dev for st, dev in enumerate(schedule.placement[0])}
    cached = [candidates(d) for d in range(D)]
    total = sum(map(len, base)) + 2 * D * M
    for _ in range(total):
        best = min((c for c in cached if c is not None), default=None)
        if best is None:  # the base schedule was valid, so this cannot happen; say so rather than loop
            raise ConfigError(f"{schedule.name}: the vocabulary passes could not be placed (no device can go on)")
        start, _, _, a, d = best
        end = start + (s if a.kind == Kind.S else t if a.kind == Kind.T else _TIME[a.kind])
        free[d] = end
        out[d].append(a)
        if a.kind == Kind.S:
            next_s[d] += 1
        elif a.kind == Kind.T:
            next_t[d] += 1
        else:
            head[d] += 1
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
    return out
