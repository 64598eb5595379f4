"""Building blocks: a schedule as one microbatch's passes repeated every T slots (Qi et al., 2024).

A building block fixes, for one microbatch, the start slot of every pass
(F, B and W of every stage) and the stage-to-device placement. Repeating it
every ``interval`` slots schedules any number of microbatches; the repeat is
collision-free when no two passes of one device share a slot modulo T.

Time is counted in slots: one slot is one pass of one stage under unit costs
(with V placement, half of a device's share: F = B = W = 0.5). A device with
n stages runs 3n passes per microbatch, so T = 3n keeps it fully busy in the
steady state.

The lifespan of a stage is the time from its F start to the end of its W,
when its activation is freed. At most ceil(lifespan / T) microbatches of that
stage are alive at once, so a device's peak memory is predicted by

    sum over its stages of ceil(lifespan / T) x (memory of the stage)

Turning a block into a schedule (``BuildingBlock.to_schedule``):

    1. repeat the block for m microbatches, microbatch j shifted by j*T;
    2. squeeze: keep each device's order, run every pass as early as its inputs allow;
    3. move F and B passes earlier into idle slots (warm-up and cool-down have
       many) when that does not raise the schedule's peak memory, the peak of
       its busiest device (a lighter device may fill up to it), and let each W
       fill the first idle slot after its B.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pipefold.errors import ConfigError
from pipefold.ir import Action, Kind, Schedule, v_placement

__all__ = ["BuildingBlock", "v_block"]


@dataclass(frozen=True, kw_only=True)
class BuildingBlock:
    """Start slots of one microbatch's F, B and W on every stage, repeated every ``interval`` slots."""

    devices: int
    stage_to_device: tuple[int, ...]
    f: tuple[int, ...]
    """Start slot of each stage's forward."""
    b: tuple[int, ...]
    """Start slot of each stage's input-gradient backward."""
    w: tuple[int, ...]
    """Start slot of each stage's weight-gradient backward."""
    interval: int
    """T: slots between two consecutive microbatches' blocks."""

    def __post_init__(self) -> None:
        S = len(self.stage_to_device)
        if not (len(self.f) == len(self.b) == len(self.w) == S):
            raise ConfigError(f"a building block needs one F, B and W slot per stage ({S} stages)")
        for s in range(S):
            if s > 0 and self.f[s] < self.f[s - 1] + 1:
                raise ConfigError(f"block: F of stage {s} starts at {self.f[s]}, before F of stage {s - 1} ends")
            after = self.b[s + 1] if s + 1 < S else self.f[s]
            if self.b[s] < after + 1:
                raise ConfigError(f"block: B of stage {s} starts at {self.b[s]}, before its input gradient exists")
            if self.w[s] < self.b[s] + 1:
                raise ConfigError(f"block: W of stage {s} starts at {self.w[s]}, before its B ends")
        for d in range(self.devices):
            residues = [t % self.interval for t in self._slots_of(d)]
            if len(set(residues)) != len(residues):
                raise ConfigError(f"block: two passes of device {d} share a slot modulo T={self.interval}, "
                                  "so repeating the block would make them collide")

    @property
    def stages(self) -> int:
        return len(self.stage_to_device)

    def _stages_of(self, device: int) -> list[int]:
        return [s for s, d in enumerate(self.stage_to_device) if d == device]

    def _slots_of(self, device: int) -> list[int]:
        return [t for s in self._stages_of(device) for t in (self.f[s], self.b[s], self.w[s])]

    def lifespan(self, stage: int) -> int:
        """Slots from the start of the stage's F to the end of its W."""
        return self.w[stage] + 1 - self.f[stage]

    def stage_memory(self) -> float:
        """Activation memory of one stage in M: a device's share split over its stages."""
        return self.devices / self.stages

    def lifespan_bound(self) -> list[float]:
        """Per device, sum over its stages of ceil(lifespan / T) x stage memory, in M (the paper's bound)."""
        mem = self.stage_memory()
        return [sum(math.ceil(self.lifespan(s) / self.interval) for s in self._stages_of(d)) * mem
                for d in range(self.devices)]

    def _alive(self, device: int) -> list[int]:
        """Stage activations a device holds in each slot of one steady-state period."""
        T = self.interval
        base = T * (max(self.w) // T + 1)  # far enough in that every earlier repeat has started
        return [
            sum((t - self.f[s]) // T - (t - self.w[s] - 1) // T for s in self._stages_of(device))
            for t in range(base, base + T)
        ]

    def predicted_peak(self) -> list[float]:
        """Per device, the most activation memory the repeated block holds at once, in M.

        Exact for the steady state; never more than :meth:`lifespan_bound`, and
        equal to it when the stages' busiest moments coincide.
        """
        mem = self.stage_memory()
        return [max(self._alive(d)) * mem for d in range(self.devices)]

    def to_schedule(self, microbatches: int, name: str, options: dict[str, int] | None = None) -> Schedule:
        """Repeat the block for ``microbatches`` microbatches and pull passes into idle slots (module docstring)."""
        bound = max(max(self._alive(d)) for d in range(self.devices))  # in stage activations
        slots = _squeeze(self, self._repeat(microbatches))
        slots = _pull_forward(self, slots, bound)
        rows: list[list[tuple[int, Action]]] = [[] for _ in range(self.devices)]
        for action, t in slots.items():
            rows[self.stage_to_device[action.stage]].append((t, action))
        actions = [[a for _, a in sorted(row)] for row in rows]
        return Schedule(name, self.devices, self.stages, microbatches, self.stage_to_device,
                        tuple(map(tuple, actions)), options or {})

    def _repeat(self, m: int) -> dict[Action, int]:
        out: dict[Action, int] = {}
        for j in range(m):
            shift = j * self.interval
            for s in range(self.stages):
                out[Action(s, Kind.F, j)] = self.f[s] + shift
                out[Action(s, Kind.B, j)] = self.b[s] + shift
                out[Action(s, Kind.W, j)] = self.w[s] + shift
        return out


def _inputs(a: Action, stages: int) -> list[Action]:
    """Passes whose results ``a`` needs (see the dependency chain in pipefold.ir)."""
    s, j = a.stage, a.microbatch
    if a.kind is Kind.F:
        return [Action(s - 1, Kind.F, j)] if s > 0 else []
    if a.kind is Kind.W:
        return [Action(s, Kind.B, j)]
    return [Action(s, Kind.F, j)] + ([Action(s + 1, Kind.B, j)] if s + 1 < stages else [])


def _squeeze(block: BuildingBlock, slots: dict[Action, int]) -> dict[Action, int]:
    """Keep each device's order; start every pass at the first slot its device and inputs allow."""
    free = [0] * block.devices
    out: dict[Action, int] = {}
    for a in sorted(slots, key=lambda x: (slots[x], x.stage)):  # inputs always come earlier in slot order
        d = block.stage_to_device[a.stage]
        t = max([free[d]] + [out[x] + 1 for x in _inputs(a, block.stages)])
        out[a] = t
        free[d] = t + 1
    return out


def _earliest(a: Action, slots: dict[Action, int], stages: int) -> int:
    """First slot ``a`` may start: after its inputs, and after the same pass of the previous microbatch."""
    ready = max([slots[x] + 1 for x in _inputs(a, stages)], default=0)
    if a.microbatch > 0:
        ready = max(ready, slots[Action(a.stage, a.kind, a.microbatch - 1)] + 1)
    return ready


def _grid(block: BuildingBlock, slots: dict[Action, int]) -> list[list[Action | None]]:
    horizon = max(slots.values()) + 1
    grid: list[list[Action | None]] = [[None] * horizon for _ in range(block.devices)]
    for a, t in slots.items():
        grid[block.stage_to_device[a.stage]][t] = a
    return grid


def _peak_with_fillers(row: Sequence[Action | None]) -> int:
    """Peak stage activations of a device's F/B slots when each W takes the first idle slot after its B."""
    level = peak = pending = 0
    for a in row:
        if a is None:
            if pending:
                pending -= 1
                level -= 1
        elif a.kind is Kind.F:
            level += 1
            peak = max(peak, level)
        else:
            pending += 1
    return peak


def _pull_forward(block: BuildingBlock, slots: dict[Action, int], bound: int) -> dict[Action, int]:
    """Lift the W passes out, move each F and B to the earliest idle slot it may take, then fill in the Ws.

    Nothing waits on a W, so it is the natural filler: with the Ws out of the
    way, F and B can take the idle slots of the warm-up and cool-down (and slots
    the Ws held), and the Ws then drop into the first idle slot after their B.
    Passes are visited in slot order, so a pass's inputs are final when it
    moves. Memory is counted as if each W already sat where it will be filled,
    and a move is kept only if the device stays within ``bound`` activations.
    """
    fb = {a: t for a, t in slots.items() if a.kind is not Kind.W}
    grid = _grid(block, fb)
    bound = max([bound] + [_peak_with_fillers(row) for row in grid])
    for a in sorted(fb, key=lambda x: (fb[x], x.stage)):
        d, old = block.stage_to_device[a.stage], fb[a]
        row = grid[d]
        for t in range(_earliest(a, fb, block.stages), old):
            if row[t] is not None:
                continue
            row[old], row[t] = None, a
            # An earlier F holds memory longer; an earlier B takes an idle slot a W would have filled.
            if _peak_with_fillers(row) > bound:
                row[old], row[t] = a, None
                continue
            fb[a] = t
            break
    out: dict[Action, int] = {}
    for row in grid:
        pending: deque[Action] = deque()
        for t, cell in enumerate(row):
            if cell is not None:
                out[cell] = t
                if cell.kind is Kind.B:
                    pending.append(Action(cell.stage, Kind.W, cell.microbatch))
            elif pending:
                out[pending.popleft()] = t
        for t, w in enumerate(pending, start=len(row)):
            out[w] = t
    return out


# --------------------------------------------------------------------------- V-shape blocks


def v_block(devices: int, *, f_gaps: Sequence[int] = (1, 1), b_gaps: Sequence[int] = (1, 1),
            b_turn: int = 1) -> BuildingBlock:
    """A V-shape building block: device d holds stages d and 2p-1-d.

    One microbatch goes down the devices (chunk 0: stages 0..p-1), turns on the
    last device, comes back up (chunk 1: stages p..2p-1), then its gradient
    goes down chunk 1 and back up chunk 0::

        F chain: stage s+1 starts f_gaps[chunk] slots after stage s (1 = at once)
        B chain: stage s-1 starts b_gaps[chunk] slots after stage s
                 (b_turn slots at the turn, on the last device)

    Wider gaps stretch lifespans, so the block holds more memory; the smallest
    delay before the first B that keeps every device's passes on distinct
    slots modulo T is chosen, and each W goes in the first free slot after its B.
    """
    p = devices
    S, T = 2 * p, 6
    placement = v_placement(p)
    f = [0] * S
    for s in range(1, S):
        # The turn (stage p-1 -> p) stays on one device: no gap is worth having there.
        f[s] = f[s - 1] + (1 if s == p else f_gaps[0] if s < p else f_gaps[1])
    b_rel = [0] * S  # B starts relative to the first B (stage 2p-1)
    for s in range(S - 2, -1, -1):
        b_rel[s] = b_rel[s + 1] + (b_turn if s == p - 1 else b_gaps[1] if s >= p else b_gaps[0])
    for delay in range(T):
        first_b = f[S - 1] + 1 + delay
        b = [first_b + x for x in b_rel]
        w = _place_weights(placement, p, f, b, T)
        if w is not None:
            return BuildingBlock(devices=p, stage_to_device=placement, f=tuple(f), b=tuple(b), w=tuple(w),
                                 interval=T)
    raise ConfigError(f"no collision-free V block with f_gaps={tuple(f_gaps)}, b_gaps={tuple(b_gaps)}, "
                      f"b_turn={b_turn} on {p} devices; try other gaps")


def _place_weights(placement: Sequence[int], p: int, f: list[int], b: list[int], T: int) -> list[int] | None:
    """Give each W the first slot after its B whose residue mod T is free on its device; None if F/B collide."""
    w = [0] * len(placement)
    for d in range(p):
        stages = [s for s, dev in enumerate(placement) if dev == d]
        used = {f[s] % T for s in stages} | {b[s] % T for s in stages}
        if len(used) != 2 * len(stages):
            return None
        for s in sorted(stages, key=lambda x: b[x]):
            t = b[s] + 1
            while t % T in used:
                t += 1
            used.add(t % T)
            w[s] = t
    return w
