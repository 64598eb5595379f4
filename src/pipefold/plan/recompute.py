"""Stage-aware recomputation (Merak): how many layers each stage recomputes so every device fits a budget.

In 1F1B-like schedules the first stages hold the most microbatches at once, so
they need recomputation (activation checkpointing) most; the last stages,
holding one or two, often need none. Recomputing the same fraction everywhere
wastes time on stages that already fit. Here each stage gets its own count r
of recomputed layers, the cheapest (by measured rerun time) that bring every device's
peak under the budget::

    measure   for each stage and each r = 0..L: bytes kept between F and B, bytes while
              its backward runs, and the seconds its backward takes beyond r = 0's (the rerun)
    predict   a device's peak = its weights, gradients and optimizer state
              + the activation peak of its pass order (simulate.peak_by_order)
    choose    per device, the cheapest counts for its stages whose peak fits

The measurements come from the runtime's own stage runner on a sample
microbatch, so the predicted activation peak is what the runtime then measures.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pipefold.errors import ConfigError
from pipefold.ir import Kind, Schedule
from pipefold.sim.simulate import CostModel, StageCost, StageOverride, peak_by_order, simulate
from pipefold.units import format_bytes

__all__ = ["MODES", "RecomputePlan", "StageProfile", "choose_recompute", "device_peaks", "plan_recompute",
           "smallest_budget"]

MODES = ("none", "full", "auto")
"""``none`` keeps every activation, ``full`` recomputes every layer, ``auto`` fits a budget."""

OPTIMIZER_STATE = {"sgd": 0.0, "adamw": 2.0}
"""Optimizer state per parameter, in parameter sizes (AdamW keeps two moments; plain SGD nothing)."""

_EXHAUSTIVE = 4096  # a device with more combinations of counts than this is planned greedily (64 x 64 is not)


@dataclass(frozen=True)
class StageProfile:
    """What recomputing the first r layers of one stage costs and saves, for r = 0..layers."""

    layers: int
    kept: tuple[int, ...]
    """Bytes one microbatch holds from its F until its backward starts, for each r."""
    total: tuple[int, ...]
    """The most bytes it holds while B and then W run (kept, the rebuilt activations, the gradient it got, what
    B captures), for each r."""
    held_w: tuple[int, ...]
    """Bytes it holds between B and W (what W reads), for each r."""
    rerun: tuple[float, ...]
    """Seconds its backward spends rebuilding the first r layers' activations, for each r (measured)."""
    times: tuple[float, float, float]
    """Seconds of the stage's F, B and W without recomputation (medians)."""
    static: int
    """Bytes of its weights, their gradients and the optimizer state."""
    message: int = 0
    """Bytes of its output for one microbatch: what it sends on, and the size of the gradient it gets back."""
    total_fused: tuple[int, ...] = ()
    """The most bytes it holds while a fused backward (BW) runs, for each r; empty: as ``total``."""
    fused_time: float | None = None
    """Seconds of its fused backward (BW) without recomputation (median); None: B + W."""


@dataclass(frozen=True)
class RecomputePlan:
    """Recomputed layers per stage and the peaks they lead to."""

    mode: str
    layers: tuple[int, ...]
    """For each stage, how many of its first layers recompute their activations."""
    stage_layers: tuple[int, ...]
    """For each stage, how many layers it has."""
    static: list[int]
    """Per device: bytes of weights, gradients and optimizer state."""
    activation_peak: list[int]
    """Per device: predicted peak bytes the step holds (its stages' activations, a receive buffer posted ahead
    and a gradient on its way back), as the runtime's meter counts them."""
    budget: float | None
    step_time: float
    """Simulated step time with this recomputation, from each stage's measured F, B, W and rerun."""
    step_time_without: float
    """The same without recomputation."""
    profiles: tuple[StageProfile, ...] = ()
    """What each stage's measurement found, from which the plan was made."""

    @property
    def peak(self) -> list[int]:
        """Per device: predicted peak bytes in all (static plus activations)."""
        return [s + a for s, a in zip(self.static, self.activation_peak, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "layers": list(self.layers), "stage_layers": list(self.stage_layers),
                "budget": self.budget, "static_bytes": self.static, "activation_peak_bytes": self.activation_peak,
                "peak_bytes": self.peak, "step_time": self.step_time, "step_time_without": self.step_time_without}


# --------------------------------------------------------------------------- planning


def _memory(profiles: Sequence[StageProfile], stages: Sequence[int], counts: Sequence[int],
            fused: Collection[int] = ()) -> dict[int, StageCost]:
    """The memory each of ``stages`` holds with its count of recomputed layers (times play no part); the
    ``fused`` stages run their backward as BW."""
    return {s: StageCost(f=0, b=0, w=0, memory=_total(profiles[s], r, s in fused), kept=profiles[s].kept[r],
                         memory_w=profiles[s].held_w[r])
            for s, r in zip(stages, counts, strict=True)}


def _total(profile: StageProfile, r: int, fused: bool) -> float:
    """What the stage holds at most during its backward: fused (BW) or split into B and W."""
    return profile.total_fused[r] if fused and profile.total_fused else profile.total[r]


def _fused(actions: Iterable[Any]) -> set[int]:
    return {a.stage for a in actions if a.kind == Kind.BW}


def _step_time(schedule: Schedule, profiles: Sequence[StageProfile], layers: Sequence[int]) -> float:
    """Simulated step time from the measured F, B and W of each stage plus its rerun."""
    fused = _fused(a for row in schedule.actions for a in row)
    over = {s: StageOverride(f=p.times[0], b=p.times[1], w=p.times[2], bw=p.fused_time,
                             memory=float(_total(p, r, s in fused)),
                             kept=float(p.kept[r]), memory_w=float(p.held_w[r]), recompute=p.rerun[r])
            for s, (p, r) in enumerate(zip(profiles, layers, strict=True))}
    return simulate(schedule, CostModel(stage_overrides=over)).makespan


def plan_recompute(schedule: Schedule, profiles: Sequence[StageProfile], mode: str,
                   budget: float | None = None) -> RecomputePlan:
    """Recomputed layers per stage: none, all, or (``auto``) the cheapest that fit ``budget`` bytes per device;
    with the peaks they lead to and the simulated step time with and without them."""
    layers = choose_recompute(schedule, profiles, mode, budget)
    static, peaks = device_peaks(schedule, profiles, layers)
    return RecomputePlan(mode, layers, tuple(p.layers for p in profiles), static, [int(x) for x in peaks], budget,
                         _step_time(schedule, profiles, layers),
                         _step_time(schedule, profiles, (0,) * schedule.stages), tuple(profiles))


def choose_recompute(schedule: Schedule, profiles: Sequence[StageProfile], mode: str,
                     budget: float | None = None) -> tuple[int, ...]:
    """:func:`plan_recompute`'s choice alone (no step times): how many layers each stage recomputes."""
    if mode not in MODES:
        raise ConfigError(f"unknown recomputation {mode!r}: choose one of {', '.join(MODES)}")
    if len(profiles) != schedule.stages:
        raise ValueError(f"{len(profiles)} stage profiles for {schedule.stages} stages")
    if mode == "auto" and budget is None:
        raise ConfigError("--recompute auto needs --memory-budget BYTES, the memory each device may use")
    if mode != "auto" and budget is not None:
        raise ConfigError(f"--memory-budget is what --recompute auto fits; with --recompute {mode} drop it")
    devices = range(schedule.devices)
    owned = [schedule.stages_of(d) for d in devices]
    static = [sum(profiles[s].static for s in owned[d]) for d in devices]
    every = tuple(p.layers for p in profiles)
    if mode == "none":
        layers: tuple[int, ...] = (0,) * schedule.stages
    elif mode == "full":
        layers = every
    else:
        assert budget is not None
        chosen = [0] * schedule.stages
        short = []  # (device, least total it can reach) for devices that cannot fit
        for d in devices:
            margin = _message_margin(schedule, profiles, d)
            counts, least = _fit_device(schedule.actions[d], owned[d], profiles, budget - static[d] - margin)
            if counts is None:
                short.append((d, static[d] + margin + least))
                continue
            for s, r in zip(owned[d], counts, strict=True):
                chosen[s] = r
        if short:
            d, need = max(short, key=lambda x: x[1])
            reachable = smallest_budget(schedule, profiles)
            raise ConfigError(
                f"no recomputation fits {budget:.0f} bytes per device: device {d} needs at least {need:.0f} "
                f"({static[d]} of them weights, gradients and optimizer state) however many layers it recomputes; "
                f"the smallest reachable budget is {reachable:.0f} bytes ({format_bytes(reachable)})")
        layers = tuple(chosen)
    return layers


def smallest_budget(schedule: Schedule, profiles: Sequence[StageProfile]) -> float:
    """The least bytes per device that some recomputation fits: the largest device's least reachable total."""
    out = 0.0
    for d in range(schedule.devices):
        owned = schedule.stages_of(d)
        least = _fit_device(schedule.actions[d], owned, profiles, 0.0)[1]
        out = max(out, sum(profiles[s].static for s in owned) + _message_margin(schedule, profiles, d) + least)
    return out


def device_peaks(schedule: Schedule, profiles: Sequence[StageProfile],
                 layers: Sequence[int]) -> tuple[list[int], list[float]]:
    """Per device, with ``layers`` recomputed per stage: its static bytes (weights, gradients, optimizer state) and
    its predicted activation peak (its stages' activations in its pass order, a receive buffer posted ahead and a
    gradient on its way back: :func:`_message_margin`)."""
    static = [sum(profiles[s].static for s in schedule.stages_of(d)) for d in range(schedule.devices)]
    return static, _peaks(schedule, profiles, layers)


def _peaks(schedule: Schedule, profiles: Sequence[StageProfile], layers: Sequence[int]) -> list[float]:
    costs = _memory(profiles, range(schedule.stages), layers, _fused(a for row in schedule.actions for a in row))
    return [peak_by_order(row, costs) + _message_margin(schedule, profiles, d)
            for d, row in enumerate(schedule.actions)]


def _message_margin(schedule: Schedule, profiles: Sequence[StageProfile], device: int) -> int:
    """What ``device`` holds of messages beside everything its stages hold: the largest message it receives (the
    runtime posts a receive one action before the action that reads it, so one such buffer can exist ahead) and
    the largest gradient it sends back (a backward's input gradient, which the link keeps until it is delivered:
    until the previous device has posted its receive, which may be after this device's next pass has begun)."""
    S = schedule.stages
    mine = [(place, s) for place in schedule.placement for s in range(S) if place[s] == device]  # every replica's
    back = [profiles[s - 1].message for place, s in mine if s > 0 and place[s - 1] != device]
    sizes = back + [profiles[s].message for place, s in mine if s + 1 < S and place[s + 1] != device]
    return max(sizes, default=0) + max(back, default=0)


def _fit_device(actions: Sequence[Any], stages: list[int], profiles: Sequence[StageProfile],
                room: float) -> tuple[list[int] | None, float]:
    """For one device's stages: the counts with the least rerun time whose activation peak fits ``room``
    (None if none does), and the least peak any counts reach.

    Recomputing more does not always hold less: a stage with one microbatch in flight keeps its
    input and rebuilds the rest anyway, so every combination is tried where there are few enough.
    """
    fused = _fused(actions)

    def peak(counts: Sequence[int]) -> float:
        return peak_by_order(actions, _memory(profiles, stages, counts, fused))

    def rerun(counts: Sequence[int]) -> float:
        return sum(profiles[s].rerun[r] for s, r in zip(stages, counts, strict=True))

    ranges = [range(profiles[s].layers + 1) for s in stages]
    if math.prod(len(r) for r in ranges) <= _EXHAUSTIVE:
        # Every combination, cheapest first (fewer layers breaks ties): the first that fits is optimal.
        peaks = {c: peak(c) for c in itertools.product(*ranges)}
        fits = [c for c in peaks if peaks[c] <= room]
        best = min(fits, key=lambda c: (rerun(c), sum(c))) if fits else None
        return (None if best is None else list(best)), min(peaks.values())
    # Too many combinations: recompute one more layer at a time where it frees the most bytes per
    # second of rerun, and keep the best point met on the way.
    counts = [0] * len(stages)
    least = peak(counts)
    while peak(counts) > room:
        options = []
        for i, s in enumerate(stages):
            if counts[i] < profiles[s].layers:
                trial = counts.copy()
                trial[i] += 1
                cost = profiles[s].rerun[trial[i]] - profiles[s].rerun[counts[i]]
                options.append(((peak(counts) - peak(trial)) / max(cost, 1e-12), trial))
        if not options:
            return None, least
        counts = max(options, key=lambda o: o[0])[1]
        least = min(least, peak(counts))
    return counts, least


