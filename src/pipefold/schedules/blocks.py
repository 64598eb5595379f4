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

import functools
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipefold.errors import ConfigError
from pipefold.ir import KINDS, Action, Kind, Schedule, v_placement

__all__ = ["BuildingBlock", "v_block"]


@dataclass(frozen=True, kw_only=True)
class BuildingBlock:
    """Start slots of one microbatch's F, B and W on every stage, repeated every ``interval`` slots."""

    devices: int
    placement: tuple[int, ...]
    f: tuple[int, ...]
    """Start slot of each stage's forward."""
    b: tuple[int, ...]
    """Start slot of each stage's input-gradient backward."""
    w: tuple[int, ...]
    """Start slot of each stage's weight-gradient backward."""
    interval: int
    """T: slots between two consecutive microbatches' blocks."""

    def __post_init__(self) -> None:
        S = len(self.placement)
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
        return len(self.placement)

    def _stages_of(self, device: int) -> list[int]:
        return [s for s, d in enumerate(self.placement) if d == device]

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
        """Repeat the block for ``microbatches`` microbatches, squeeze, and pull passes into idle slots."""
        return _Expansion(self, microbatches).schedule(name, options or {})


# Passes are numbered (kind * S + stage) * m + microbatch, kinds F=0, B=1, W=2, so the expansion
# below runs on flat integer arrays: a V schedule at p=64, m=1024 has 393,216 passes.
_F, _B, _W = 0, 1, 2
_KINDS = (Kind.F, Kind.B, Kind.W)


class _Expansion:
    """One block expanded to m microbatches: the slot of every pass, refined step by step.

    Whatever has no sequential dependency (numbering, repeating, sorting, building the
    actions) is done on numpy arrays; the steps where each pass depends on earlier ones walk lists.
    """

    def __init__(self, block: BuildingBlock, m: int) -> None:
        self.block, self.m = block, m
        S = block.stages
        self.S = S
        ids = np.arange(3 * S * m)
        kind, self.stage = ids // (S * m), (ids // m) % S
        self.device: list[int] = np.asarray(block.placement)[self.stage].tolist()
        offsets = np.array([block.f, block.b, block.w])
        # 1. Repeat: microbatch j's passes are the block's, j*T slots later.
        self.slot: list[int] = (offsets[kind, self.stage] + block.interval * (ids % m)).tolist()
        # The passes whose results each pass needs (by the kinds' rules, pipefold.ir.KINDS), at most
        # two, with len(ids) for none: that index holds a slot of -1, which never delays anything.
        none = len(ids)
        inputs = [np.full(len(ids), none) for _ in range(2)]
        for k, code in enumerate(_KINDS):
            for slot_no, (name, offset) in enumerate(KINDS[code].needs):
                mine = kind == k
                target = self.stage + offset
                dep = np.where(mine & (target >= 0) & (target < S), (_KINDS.index(name) * S + target) * m + ids % m,
                               none)
                inputs[slot_no] = np.where(mine, dep, inputs[slot_no])
        self.inputs: tuple[list[int], list[int]] = (inputs[0].tolist(), inputs[1].tolist())
        self.slot.append(-1)

    def _in_slot_order(self, count: int) -> list[int]:
        """The first ``count`` passes by slot; inputs always sit in earlier slots, ties (other devices) by stage."""
        key = np.asarray(self.slot[:count]) * self.S + self.stage[:count]
        return np.argsort(key, kind="stable").tolist()

    def squeeze(self) -> None:
        """2. Keep each device's order; start every pass at the first slot its device and inputs allow."""
        free = [0] * self.block.devices
        slot, device = self.slot, self.device
        first, second = self.inputs
        for i in self._in_slot_order(len(device)):
            d = device[i]
            t = max(free[d], slot[first[i]] + 1, slot[second[i]] + 1)
            slot[i] = t
            free[d] = t + 1

    def pull_forward(self) -> None:
        """3. Lift the Ws out, move each F and B to the earliest idle slot it may take, then fill in the Ws.

        Nothing waits on a W, so it is the natural filler: with the Ws out of
        the way, F and B can take the idle slots of the warm-up and cool-down,
        and each W then drops into the first idle slot after its B. Passes are
        visited in slot order, so a pass's inputs are final when it moves.
        Memory is counted as if each W already sat where it will be filled
        (:class:`_FillerMemory`), and a move is kept only while no device goes
        above the schedule's peak: the block's, in stage activations.
        """
        S, m, slot, device = self.S, self.m, self.slot, self.device
        fb = range(2 * S * m)  # F and B passes come first in the numbering
        horizon = max(slot[i] for i in fb) + 1
        rows: list[list[int]] = [[-1] * horizon for _ in range(self.block.devices)]
        for i in fb:
            rows[device[i]][slot[i]] = i
        memory = [_FillerMemory(row, S * m) for row in rows]
        bound = max([max(max(self.block._alive(d)) for d in range(self.block.devices))]
                    + [mem.peak for mem in memory])
        first, second = self.inputs
        none = len(device)
        for i in self._in_slot_order(len(fb)):
            old = slot[i]
            previous = i - 1 if i % m else none  # the previous microbatch's same pass stays first
            ready = max(slot[previous] + 1, slot[first[i]] + 1, slot[second[i]] + 1)
            row, mem = rows[device[i]], memory[device[i]]
            for t in range(ready, old):
                if row[t] < 0 and mem.try_move(i, old, t, bound):
                    slot[i] = t
                    break
        for row in rows:
            pending: deque[int] = deque()
            for t, i in enumerate(row):
                if i >= 0:
                    if i >= S * m:
                        pending.append(i + S * m)  # its W
                elif pending:
                    slot[pending.popleft()] = t
            for t, w in enumerate(pending, start=len(row)):
                slot[w] = t

    def schedule(self, name: str, options: dict[str, int]) -> Schedule:
        self.squeeze()
        self.pull_forward()
        S, m, D = self.S, self.m, self.block.devices
        device = np.asarray(self.device)
        order = np.lexsort((np.asarray(self.slot[:-1]), device))  # by device, then slot
        # tuple.__new__ over zipped columns makes the Actions without a Python call each.
        make = functools.partial(tuple.__new__, Action)
        kinds = map(_KINDS.__getitem__, (order // (S * m)).tolist())
        flat = list(map(make, zip(self.stage[order].tolist(), kinds, (order % m).tolist(), itertools.repeat(()))))
        ends = np.cumsum(np.bincount(device, minlength=D)).tolist()
        actions = tuple(tuple(flat[a:b]) for a, b in zip([0, *ends], ends, strict=False))
        return Schedule(name, D, S, m, (self.block.placement,), actions, options)


class _FillerMemory:
    """Stage activations one device holds, slot by slot, when each W fills the first idle slot after its B.

    ``level[t]`` and ``pending[t]`` are the state at the start of slot t: activations held, and Bs
    whose W still waits for an idle slot. A cell holds a pass number (F below ``first_b``, B from
    it) or -1 for an idle slot. A move changes the state from its new slot on, and only until the
    state meets the old one again, so a trial move recomputes just that stretch. The walk is the
    hot loop of a V schedule's expansion, hence written out inline.
    """

    def __init__(self, row: list[int], first_b: int) -> None:
        self.row, self.first_b = row, first_b
        self.level = [0] * (len(row) + 1)
        self.pending = [0] * (len(row) + 1)
        self.peak = self._run(0, len(row))

    def _run(self, start: int, stop: int) -> int:
        level, pending, peak = self.level[start], self.pending[start], 0
        row, first_b = self.row, self.first_b
        for t in range(start, stop):
            cell = row[t]
            if cell < 0:
                if pending:  # an idle slot takes the oldest waiting W, which frees one activation
                    level -= 1
                    pending -= 1
            elif cell < first_b:
                level += 1
            else:
                pending += 1
            if level > peak:
                peak = level
            self.level[t + 1], self.pending[t + 1] = level, pending
        return peak

    def try_move(self, i: int, old: int, new: int, bound: int) -> bool:
        """Move pass ``i`` from slot ``old`` to the idle slot ``new`` if the level stays within ``bound``.

        The new states are written as they are found (most moves succeed); a move that fails puts
        the row back and recomputes the stretch it overwrote.
        """
        row, first_b, levels, pendings = self.row, self.first_b, self.level, self.pending
        row[old], row[new] = -1, i
        level, pending = levels[new], pendings[new]
        t, n = new, len(row)
        while t < n:
            cell = row[t]
            if cell < 0:
                if pending:
                    level -= 1
                    pending -= 1
            elif cell < first_b:
                level += 1
                if level > bound:
                    row[old], row[new] = i, -1
                    self._run(new, t)  # the states before slot t as they were
                    return False
            else:
                pending += 1
            t += 1
            if t > old and level == levels[t] and pending == pendings[t]:
                break  # back in step with the old profile: nothing later changes
            levels[t], pendings[t] = level, pending
        return True


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
            return BuildingBlock(devices=p, placement=placement, f=tuple(f), b=tuple(b), w=tuple(w),
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
