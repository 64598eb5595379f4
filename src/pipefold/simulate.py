"""Simulator: a cost model and a schedule give a timeline, bubbles and memory.

Every device runs its action list in order; an action starts as soon as its
device is free and its inputs have arrived. Inputs are the activation from the
previous stage (for F) and the gradient from the next stage (for B/BW); they
cost a point-to-point transfer when the two stages live on different devices.

Units. By default a cost is for one microbatch through one device's share of
the model (1/p of it): F = B = W = 1 and memory M = 1. A schedule with v stages
per device runs stages that are 1/v of a share, so each stage's times and
memory are divided by v. Activation memory of a (stage, microbatch) is taken
when its F starts and given back when its W ends (all of it when a fused BW
ends). Between its B and its W a stage holds ``M_w``, which may be less than M
(B freed what only it needed) or more (B captured gradients for W and still
keeps W's inputs); B's end steps from M to ``M_w``.

Recomputation (activation checkpointing) trades time for memory: a stage that
recomputes the fraction r of its forward keeps only ``kept = (1 - r) M``
between its F and its backward, rebuilds the rest when its B (or BW) starts,
and that B takes ``r F`` longer::

    F start         B start           B end               W end
    | + kept        | + (M - kept)    | + (M_w - M)       | - M_w
    |---- kept -----|------- M -------|------- M_w -------| 0

    a fused BW:  + (M - kept) when it starts, - M when it ends
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pipefold._gc import paused_gc
from pipefold.errors import ConfigError
from pipefold.ir import Action, Kind, Schedule, check_structure, execution_order

__all__ = ["CostModel", "Interval", "SimResult", "StageCost", "StageOverride", "memory_deltas", "peak_by_order",
           "simulate"]


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """Times and activation memory of one stage for one microbatch, in absolute units."""

    f: float
    b: float
    """Input-gradient time, recomputation included."""
    w: float
    memory: float
    """Activation memory while the backward runs: everything the stage saved, recomputed or not."""
    kept: float | None = None
    """Activation memory held from F until the backward starts; None means all of ``memory``."""
    memory_w: float | None = None
    """Activation memory held from the end of B to the end of W; None means ``memory``. May exceed it."""

    @property
    def bw(self) -> float:
        """A fused backward costs B + W."""
        return self.b + self.w

    @property
    def held(self) -> float:
        """Activation memory held from F until the backward starts."""
        return self.memory if self.kept is None else self.kept

    @property
    def held_w(self) -> float:
        """Activation memory held from the end of B to the end of W."""
        return self.memory if self.memory_w is None else self.memory_w


@dataclass(frozen=True, kw_only=True)
class StageOverride:
    """Absolute times of one stage that replace the derived ones; memory too, unless left None.

    ``recompute`` is the forward time this stage spends again in each backward; ``kept`` the
    activation memory it holds between F and the backward (None: all of ``memory``);
    ``memory_w`` what it holds between its B and its W (None: derived like ``memory``).
    """

    f: float
    b: float
    w: float
    memory: float | None = None
    recompute: float = 0.0
    kept: float | None = None
    memory_w: float | None = None


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """How long each pass takes, what crossing devices costs, and how much memory activations use."""

    f: float = 1.0
    """Forward time of one microbatch through one device's share of the model."""
    b: float = 1.0
    """Input-gradient backward time (B) for one device's share."""
    w: float = 1.0
    """Weight-gradient backward time (W) for one device's share."""
    memory: float = 1.0
    """Activation memory of one microbatch on one device's share (the unit M)."""
    memory_w: float | None = None
    """Activation memory held between a stage's B and its W, per device share; None: ``memory``. May exceed it."""
    latency: float = 0.0
    """Fixed time of a point-to-point transfer between two devices."""
    bandwidth: float = math.inf
    """Bytes per time unit of a point-to-point link."""
    activation_bytes: float = 0.0
    """Bytes sent between stages per microbatch (activation forward, its gradient backward)."""
    recompute: float = 0.0
    """Fraction of every stage's forward recomputed in its backward (activation checkpointing): 0..1."""
    stage_overrides: Mapping[int, StageOverride] = field(default_factory=dict)
    """Absolute per-stage costs that replace the derived ones for the given stages."""

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "memory", "memory_w", "latency", "activation_bytes"):
            value = getattr(self, name)
            if value is None and name == "memory_w":
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"cost {name} must be a finite number >= 0 (got {value!r})")
        if not 0 <= self.recompute <= 1:
            raise ConfigError(f"recompute is a fraction of the forward: 0..1 (got {self.recompute!r})")
        if not self.bandwidth > 0:
            raise ConfigError(f"bandwidth must be > 0 bytes per time unit (got {self.bandwidth!r})")
        for stage, cost in self.stage_overrides.items():
            for name in ("f", "b", "w", "memory", "recompute", "kept", "memory_w"):
                value = getattr(cost, name)
                if value is None and name in ("memory", "kept", "memory_w"):
                    continue
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                    raise ConfigError(f"stage {stage} cost {name} must be a finite number >= 0 (got {value!r})")
            if cost.kept is not None and cost.memory is not None and cost.kept > cost.memory:
                raise ConfigError(f"stage {stage} keeps {cost.kept:g} between F and B, more than its memory "
                                  f"{cost.memory:g}: kept is the part of memory not recomputed")

    @property
    def transfer_time(self) -> float:
        """Time to move one activation (or its gradient) between two devices."""
        return self.latency + (self.activation_bytes / self.bandwidth if self.activation_bytes else 0.0)

    def stage_cost(self, stage: int, stages: int, devices: int) -> StageCost:
        """Cost of ``stage`` in a pipeline of ``stages`` stages over ``devices`` devices."""
        share = devices / stages  # a stage is this fraction of one device's share of the model
        over = self.stage_overrides.get(stage)
        memory_w = None if self.memory_w is None else self.memory_w * share
        if over is None:
            f, memory = self.f * share, self.memory * share
            kept = None if self.recompute == 0 else memory * (1.0 - self.recompute)
            return StageCost(f=f, b=self.b * share + self.recompute * f, w=self.w * share, memory=memory, kept=kept,
                             memory_w=memory_w)
        memory = self.memory * share if over.memory is None else over.memory
        return StageCost(f=over.f, b=over.b + over.recompute, w=over.w, memory=memory,
                         kept=None if over.kept is None else min(over.kept, memory),
                         memory_w=memory_w if over.memory_w is None else over.memory_w)

    def to_dict(self) -> dict[str, Any]:
        return {
            "f": self.f, "b": self.b, "w": self.w, "memory": self.memory, "memory_w": self.memory_w,
            "latency": self.latency,
            "bandwidth": None if math.isinf(self.bandwidth) else self.bandwidth,
            "activation_bytes": self.activation_bytes, "recompute": self.recompute,
            "stage_overrides": {str(s): {"f": c.f, "b": c.b, "w": c.w, "memory": c.memory,
                                         "recompute": c.recompute, "kept": c.kept, "memory_w": c.memory_w}
                                for s, c in self.stage_overrides.items()},
        }


class Interval(NamedTuple):
    """When one action ran on its device."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What the simulator predicts for one schedule under one cost model."""

    schedule: Schedule
    cost: CostModel
    timeline: tuple[tuple[Interval, ...], ...]
    """Per device, its actions in run order with start and end times."""
    memory_curve: tuple[tuple[tuple[float, float], ...], ...]
    """Per device, (time, activation memory from then on) steps, starting at (0, 0)."""

    @property
    def makespan(self) -> float:
        return max((row[-1].end for row in self.timeline if row), default=0.0)

    @property
    def busy(self) -> list[float]:
        """Per device, the time spent running actions."""
        return [sum(iv.end - iv.start for iv in row) for row in self.timeline]

    @property
    def idle(self) -> list[float]:
        """Per device, makespan minus busy time."""
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_ratio(self) -> float:
        """1 - busy time / (devices x makespan)."""
        span = self.makespan * self.schedule.devices
        return 1.0 - sum(self.busy) / span if span else 0.0

    @property
    def peak_memory(self) -> list[float]:
        """Per device, the highest activation memory held at any time, in units of M."""
        return [max(m for _, m in curve) for curve in self.memory_curve]

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """JSON-ready summary; with ``timeline`` also every action's start and end."""
        s = self.schedule
        out: dict[str, Any] = {
            "schedule": s.name,
            "options": dict(s.options),
            "devices": s.devices,
            "stages": s.stages,
            "microbatches": s.microbatches,
            "placement": s.placement,
            "makespan": _round(self.makespan),
            "bubble_ratio": _round(self.bubble_ratio),
            "busy": [_round(x) for x in self.busy],
            "idle": [_round(x) for x in self.idle],
            "peak_memory": [_round(x) for x in self.peak_memory],
            "cost": self.cost.to_dict(),
        }
        if timeline:
            out["timeline"] = [
                [{"action": str(iv.action), "start": _round(iv.start), "end": _round(iv.end)} for iv in row]
                for row in self.timeline
            ]
            out["memory_curve"] = [[[_round(t), _round(m)] for t, m in c] for c in self.memory_curve]
        return out


def _round(x: float) -> float:
    # Sums of halves and thirds pick up float noise; 9 digits keep JSON readable and exact enough.
    return round(x, 9)


@paused_gc()
def simulate(schedule: Schedule, cost: CostModel | None = None) -> SimResult:
    """Predict the timeline of ``schedule`` under ``cost`` (unit costs by default).

    Raises :class:`~pipefold.errors.ScheduleError` if the schedule is invalid.
    """
    cost = cost or CostModel()
    S, D = schedule.stages, schedule.devices
    outside = sorted(s for s in cost.stage_overrides if not 0 <= s < S)
    if outside:
        raise ConfigError(f"a stage cost override names stage {outside[0]}, but {schedule.name} has stages 0..{S - 1}")
    check_structure(schedule)
    costs = [cost.stage_cost(s, S, D) for s in range(S)]
    starts, ends = _times(schedule, costs, cost.transfer_time)
    rows = schedule.actions
    # tuple.__new__ on zipped triples builds the Intervals without a Python call each (hundreds of thousands).
    make = functools.partial(tuple.__new__, Interval)
    timeline = tuple(tuple(map(make, zip(row, starts[d], ends[d], strict=True))) for d, row in enumerate(rows))
    deltas = _delta_table(dict(enumerate(costs)))
    curves = tuple(_memory_curve(rows[d], starts[d], ends[d], deltas) for d in range(D))
    return SimResult(schedule, cost, timeline, curves)


def _times(schedule: Schedule, costs: list[StageCost], transfer: float) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end of every action, per device and position; a schedule that cannot run raises.

    The traversal of :func:`pipefold.ir.execution_order`, timing each pass as it goes: a device
    runs its actions in order until one waits for a pass not yet done, and is woken when that
    pass is done. Each pass starts when its device is free and its inputs have arrived. If the
    traversal stops short, ``execution_order`` finds and reports the first violation.
    """
    S, D, M = schedule.stages, schedule.devices, schedule.microbatches
    SM = S * M
    rows, device_of = schedule.actions, schedule.stage_to_device
    starts = [[0.0] * len(row) for row in rows]
    ends = [[0.0] * len(row) for row in rows]
    # End times indexed by stage * M + microbatch, -1 until done: of forwards, and of the
    # backwards (B or BW) that send a gradient upstream. Waiting devices are keyed by the pass
    # they wait for: idx for a forward, SM + idx for a backward.
    f_end = [-1.0] * SM
    b_end = [-1.0] * SM
    free = [0.0] * D
    heads = [0] * D
    waiting: dict[int, list[int]] = {}
    queue = deque(range(D))
    F_, W_, B_ = Kind.F, Kind.W, Kind.B
    done = 0
    while queue:
        device = queue.popleft()
        row, pos, n = rows[device], heads[device], len(rows[device])
        row_starts, row_ends = starts[device], ends[device]
        ready = free[device]
        while pos < n:
            s, kind, mb = row[pos]
            idx = s * M + mb
            c = costs[s]
            if kind is F_:
                if s > 0:
                    arrival = f_end[idx - M]
                    if arrival < 0:
                        waiting.setdefault(idx - M, []).append(device)
                        break
                    arrival += transfer if device_of[s - 1] != device else 0.0
                    ready = arrival if arrival > ready else ready
                end = ready + c.f
                f_end[idx] = end
                key = idx
            elif kind is W_:
                arrival = b_end[idx]
                if arrival < 0:
                    waiting.setdefault(SM + idx, []).append(device)
                    break
                ready = arrival if arrival > ready else ready
                end = ready + c.w
                key = -1  # nothing waits on a W
            else:
                arrival = f_end[idx]
                if arrival < 0:
                    waiting.setdefault(idx, []).append(device)
                    break
                if s + 1 < S:
                    gradient = b_end[idx + M]
                    if gradient < 0:
                        waiting.setdefault(SM + idx + M, []).append(device)
                        break
                    gradient += transfer if device_of[s + 1] != device else 0.0
                    arrival = gradient if gradient > arrival else arrival
                ready = arrival if arrival > ready else ready
                end = ready + (c.b if kind is B_ else c.bw)
                b_end[idx] = end
                key = SM + idx
            row_starts[pos], row_ends[pos] = ready, end
            ready = end
            pos += 1
            if key >= 0:
                woken = waiting.pop(key, None)
                if woken:
                    queue.extend(woken)
        free[device] = ready
        done += pos - heads[device]
        heads[device] = pos
    if done != schedule.num_actions:
        execution_order(schedule)  # raises ScheduleError naming the first violation
        raise AssertionError(f"{schedule.name}: the traversal stopped but the schedule validates")
    return starts, ends


def _memory_curve(row: tuple[Action, ...], starts: list[float], ends: list[float],
                  deltas: dict[tuple[int, Kind], tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Activation memory of one device over time, as (time, level) steps."""
    events: list[tuple[float, float]] = []
    for a, start, end in zip(row, starts, ends, strict=True):
        at_start, at_end = deltas[a.stage, a.kind]
        if at_start:
            events.append((start, at_start))
        if at_end:
            events.append((end, at_end))
    # At equal times a release comes first: the device ended one pass before starting the next.
    events.sort()
    curve = [(0.0, 0.0)]
    level = 0.0
    for t, delta in events:
        level += delta
        if abs(level) < 1e-12:
            level = 0.0
        if curve[-1][0] == t:
            curve[-1] = (t, level)
        else:
            curve.append((t, level))
    return tuple(curve)


def memory_deltas(kind: Kind, cost: StageCost) -> tuple[float, float]:
    """How one pass changes its device's activation memory: (when it starts, when it ends).

    F takes what the stage keeps; a backward first rebuilds what was recomputed; B's end goes
    from ``memory`` to ``memory_w`` (a step up or down); W gives back ``memory_w``, a fused BW
    all of ``memory``.
    """
    if kind is Kind.F:
        return cost.held, 0.0
    rebuilt = cost.memory - cost.held
    if kind is Kind.B:
        return rebuilt, cost.held_w - cost.memory
    if kind is Kind.W:
        return 0.0, -cost.held_w
    return rebuilt, -cost.memory


def _delta_table(costs: Mapping[int, StageCost]) -> dict[tuple[int, Kind], tuple[float, float]]:
    """:func:`memory_deltas` of every (stage, kind), worked out once for a pass over many actions."""
    return {(s, kind): memory_deltas(kind, c) for s, c in costs.items() for kind in Kind}


def peak_by_order(actions: Sequence[Action], costs: Mapping[int, StageCost]) -> float:
    """The peak activation memory of one device running ``actions`` in order, without timing them.

    A device runs one pass at a time, so its memory depends on the order of its own passes
    only; this is :func:`simulate`'s peak for that device, at a fraction of the cost, for
    searches that try many memory costs on one schedule.
    """
    deltas = _delta_table(costs)
    level = peak = 0.0
    for a in actions:
        at_start, at_end = deltas[a.stage, a.kind]
        level += at_start
        peak = max(peak, level)
        level += at_end
    # A B may end higher than it ran (memory_w > memory); the next pass's start counts that level,
    # but ``actions`` may stop at a B.
    return max(peak, level)
