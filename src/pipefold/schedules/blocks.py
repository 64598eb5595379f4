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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from pipefold.errors import ConfigError
from pipefold.ir import KINDS, ActionRows, Kind, Schedule, v_placement

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
        T, stages = self.interval, self._stages_of(device)
        base = T * (max(self.w) // T + 1)  # far enough in that every earlier repeat has started
        return [sum((t - self.f[s]) // T - (t - self.w[s] - 1) // T for s in stages) for t in range(base, base + T)]

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
# A cell of a device's row in pull_forward.
_IDLE, _FWD, _BWD = 0, 1, 2


class _Expansion:
    """One block expanded to m microbatches: the slot of every pass, refined step by step.

    Squeeze and pull_forward visit the passes one by one, each visit reading what earlier ones
    wrote. Done literally that costs seconds at p=64, m=1024; two things make it fast:

    * The steady state repeats. Both steps visit the passes by slot, which in the middle of the
      schedule runs one period (one pass of each (kind, stage), T slots) after another, each the
      previous one a microbatch later. Once the walk has reached that regime, the visits of the
      following periods are copied from the last one, T slots later each time, instead of being
      walked: ``_squeeze_jump`` and ``_pull_jump`` say why the copy is exactly what the walk would
      have computed (proved from the state the walk has reached, never assumed; where the proof
      fails the walk goes on). Only the warm-up and cool-down, O(p^2) passes, are walked.
    * pull_forward keeps each device's memory lazily and only at its passes (``_DeviceRow``),
      and never looks at the passes it has not visited yet; the W fill and the sorts are numpy.
    """

    def __init__(self, block: BuildingBlock, m: int) -> None:
        self.block, self.m = block, m
        S, T = block.stages, block.interval
        self.S, self.T, self.D = S, T, block.devices
        n = 3 * S * m
        self.n = n
        # Arrays over (group, microbatch), raveled: a group is kind * S + stage.
        microbatch = np.arange(m)
        self.stage = np.repeat(np.tile(np.arange(S), 3), m)
        self.device = np.repeat(np.tile(np.asarray(block.placement), 3), m)
        # 1. Repeat: microbatch j's passes are the block's, j*T slots later. The slot array has one more
        # cell, at index n, holding -1: the input of a pass that needs none, which never delays anything.
        self.slot = np.empty(n + 1, dtype=np.int64)
        self.slot[:n] = (np.array([block.f, block.b, block.w]).reshape(-1, 1) + T * microbatch).ravel()
        self.slot[n] = -1
        # The passes whose results each pass needs (by the kinds' rules, pipefold.ir.KINDS), at most
        # two, with n for none: the same microbatch of one group. A block has F, B and W only: a need of another
        # pass (a reload, which an offloading transform adds later) is none here.
        needs = np.full((2, 3 * S, 1), -1)
        for k, code in enumerate(_KINDS):
            within = [(name, offset) for name, offset in KINDS[code].needs if name in _KINDS]
            for slot_no, (name, offset) in enumerate(within):
                target = np.arange(S) + offset
                needs[slot_no, k * S:(k + 1) * S, 0] = np.where((target >= 0) & (target < S),
                                                                _KINDS.index(name) * S + target, -1)
        first, second = (np.where(g >= 0, g * m + microbatch, n).ravel() for g in needs)
        self.inputs: tuple[np.ndarray, np.ndarray] = (first, second)

    def schedule(self, name: str, options: dict[str, int]) -> Schedule:
        self.squeeze()
        self.pull_forward()
        S, m, D = self.S, self.m, self.D
        slot = self.slot[:-1]
        order = _sorted_by_key(self.device * (int(slot.max()) + 1) + slot)  # by device, then slot
        rows = ActionRows(np.bincount(self.device, minlength=D).tolist(), _KINDS, order // (S * m),
                          self.stage[order], order % m)
        return Schedule(name, D, S, m, (self.block.placement,), rows, options)

    def _visit(self, count: int, period: int) -> _Visit:
        """The first ``count`` passes by their slot now (ties, on other devices, by stage)."""
        return _Visit(self.slot[:count] * self.S + self.stage[:count], self.S, self.m, self.T, period)

    # ------------------------------------------------------------------ 2. squeeze

    def squeeze(self) -> None:
        """2. Keep each device's order; start every pass at the first slot its device and inputs allow.

        Passes are visited by slot: inputs always sit in earlier slots, so each pass's slot is final
        when a later one reads it.
        """
        visit = self._visit(self.n, 3 * self.S)
        free = [0] * self.D  # the first slot each device has free
        slot = self.slot.data  # a memoryview: single items without numpy's overhead
        device, (first, second) = self.device, self.inputs

        def walk(start: int, stop: int) -> None:
            ids = visit.order[start:stop]
            columns = (ids.tolist(), device[ids].tolist(), first[ids].tolist(), second[ids].tolist())
            for i, d, a, b in zip(*columns, strict=True):
                t = free[d] - 1
                if slot[a] > t:
                    t = slot[a]
                if slot[b] > t:
                    t = slot[b]
                slot[i] = t + 1
                free[d] = t + 2

        visit.walk(walk, lambda v: self._squeeze_jump(visit, v, free))

    def _squeeze_jump(self, visit: _Visit, v: int, free: list[int]) -> int:
        """Squeeze the periods from position ``v`` on as copies of the last one; the position reached (v: none).

        The squeezed slot of the pass at position y is max(free slot of its device, inputs + 1): the
        walk computes the one solution of that recurrence, so candidate slots that satisfy it at
        every position, in order, are the walk's. The candidates repeat the last period, T slots
        later each time. They are checked at the first positions, as far back as the inputs of a
        position reach (``_Visit.reach``); past those, a position's device predecessor and inputs
        are candidates one period after those of the position a period earlier, so it satisfies
        the recurrence exactly when that position does.
        """
        period, T, slot, order = visit.period, self.T, self.slot, visit.order
        if v < 2 * period:
            return v
        template, before = order[v - period:v], order[v - 2 * period:v - period]
        # A cheap filter, not the proof: the last period must have repeated the one before.
        if not visit.repeats[v - period:v].all() or not np.array_equal(slot[template], slot[before] + T):
            return v
        periods = (visit.run_end(v) - v) // period
        if periods < 1:
            return v
        _repeat_values(slot, template, periods, T)
        reach = max(visit.reach(v - period, needs[template]) for needs in self.inputs)
        checked = order[v:v + min(periods * period, max(period, -(-reach // period) * period))]
        device = self.device[checked]
        expected = np.maximum(slot[self.inputs[0][checked]], slot[self.inputs[1][checked]]) + 1
        # The device predecessor: the previous checked pass of the device, or the walk's free slot.
        by_device = np.argsort(device, kind="stable")
        devices, slots = device[by_device], slot[checked][by_device]
        starts = np.r_[True, devices[1:] != devices[:-1]]
        after = np.empty_like(slots)
        after[by_device] = np.where(starts, np.asarray(free)[devices], np.r_[0, slots[:-1] + 1])
        good = np.maximum(expected, after) == slot[checked]
        if not good.all():
            periods = int(np.argmin(good)) // period
            if periods < 1:
                return v
        for d, t in zip(self.device[template].tolist(), slot[template].tolist(), strict=True):
            free[d] = t + periods * T + 1  # the device's last pass in the template, periods later
        return v + periods * period

    # ------------------------------------------------------------------ 3. pull forward

    def pull_forward(self) -> None:
        """3. Lift the Ws out, move each F and B to the earliest idle slot it may take, then fill in the Ws.

        Nothing waits on a W, so it is the natural filler: with the Ws out of
        the way, F and B can take the idle slots of the warm-up and cool-down,
        and each W then drops into the first idle slot after its B. Passes are
        visited in slot order, so a pass's inputs are final when it moves; a pass
        takes the first idle slot from the one its inputs (and the previous
        microbatch's same pass) allow. Memory is counted as if each W already sat
        where it will be filled (:class:`_DeviceRow`), and a move is kept only while
        no device goes above the schedule's peak: the block's, in stage activations,
        or the squeezed schedule's if higher.
        """
        S, m = self.S, self.m
        fb = 2 * S * m  # F and B passes come first in the numbering
        squeezed = self.slot[:fb].copy()
        horizon = int(squeezed.max()) + 1
        visit = self._visit(fb, 2 * S)
        alive = max(max(self.block._alive(d)) for d in range(self.D))
        bound = max(alive, _squeezed_peak(self.device[:fb], squeezed, S * m, self.D, horizon))
        rows = [_DeviceRow(horizon) for _ in range(self.D)]
        ready = np.zeros(fb, dtype=np.int64)  # each visited pass's first allowed slot
        slot, ready_of, device = self.slot.data, ready.data, self.device

        def walk(start: int, stop: int) -> None:
            ids = visit.order[start:stop]
            columns = (ids, device[ids], ids >= S * m, squeezed[ids], *self._needs(ids))
            for i, d, is_b, old, p, a, b in zip(*(column.tolist() for column in columns), strict=True):
                r = slot[p]
                if slot[a] > r:
                    r = slot[a]
                if slot[b] > r:
                    r = slot[b]
                r += 1
                ready_of[i] = r
                row, cell, new = rows[d], _BWD if is_b else _FWD, old
                busy = row.busy
                for t in range(r, old):
                    if not busy[t] and row.try_move(t, old, cell, bound):
                        new = t
                        break
                else:
                    row.place(old, cell)
                slot[i] = new

        visit.walk(walk, lambda v: self._pull_jump(visit, ready, rows, v))
        self._fill_weights(horizon)

    def _pull_jump(self, visit: _Visit, ready: np.ndarray, rows: list[_DeviceRow], v: int) -> int:
        """Pull the periods from position ``v`` on forward as copies of the last one; the position reached (v: none).

        Where a pass moves depends only on: its ready slot r (from its inputs' final slots), its own
        slot, the memory state at the start of slot r, and which cells of [r, own slot) hold an F, a
        B or nothing (cells there hold visited passes only: the others sit at or after their own
        slot). Let G be the least ready slot of the last period (the template). If

        (a) every visited pass with a squeezed slot from G on sits one period after the same pass of
            the previous microbatch, and the visit order repeats from there on (so the cells from
            G on are the cells from G - T, one period on),
        (b) every device's memory state is the same at the start of slot G + T as of slot G, and
        (c) each pass of the next periods is ready exactly T slots after the same pass one period
            earlier (checked as far as its inputs reach back, then implied as for the squeeze),

        then by induction each next period sees what the last one saw, T slots later, and moves
        the same: its passes land T slots later, no move lands before G + T, and the cells and
        states from G + kT on after k periods are those from G on now, k*T slots later.
        """
        period, T, slot, order = visit.period, self.T, self.slot, visit.order
        if v < 2 * period:
            return v
        template = order[v - period:v]
        low = int(ready[template].min())
        front = int(visit.slot(v))  # every pass not yet visited sits at or after this slot
        if low + T > front:
            return v
        start = visit.first_at(low) + period
        if not visit.repeats[start:v].all() or not np.array_equal(slot[order[start:v]],
                                                                  slot[order[start - period:v - period]] + T):
            return v  # not (a)
        if not all(row.repeats(low, T) for row in rows):
            return v  # not (b)
        # Stop a period short of the repeating stretch's end: the pass at position v + periods * period is then
        # the template's first, periods microbatches later, so the passes left to visit sit from front + periods*T on.
        periods = (visit.run_end(v) - 1 - v) // period
        if periods < 1:
            return v
        _repeat_values(slot, template, periods, T)
        _repeat_values(ready, template, periods, T)
        reach = max(visit.reach(v - period, needs) for needs in self._needs(template))
        ids = order[v:v + min(periods * period, max(period, -(-reach // period) * period))]
        previous, first, second = self._needs(ids)
        good = np.maximum(np.maximum(slot[previous], slot[first]), slot[second]) + 1 == ready[ids]
        if not good.all():  # not (c) from there on
            periods = int(np.argmin(good)) // period
            if periods < 1:
                return v
        for row in rows:
            row.repeat_forward(low, T, periods, front + 1)
        return v + periods * period

    def _needs(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What a visit in pull_forward reads the slots of: the previous microbatch's same pass and the inputs."""
        return np.where(ids % self.m > 0, ids - 1, self.n), self.inputs[0][ids], self.inputs[1][ids]

    def _fill_weights(self, horizon: int) -> None:
        """Each W takes the first idle slot after its B that no earlier W took, device by device.

        A device's Ws are taken first in, first out, in the order of their Bs: the k-th takes idle
        slot number n_k = max(n_{k-1} + 1, c_k), c_k the number of idle slots before its B, so
        n_k = k + max over l <= k of (c_l - l), a running maximum. Past the last F or B the
        device is idle, so Ws left over run one a slot from the horizon on.
        """
        S, m, D = self.S, self.m, self.D
        fb = 2 * S * m
        device = self.device[:fb]
        table = np.full(D * horizon, -1, dtype=np.int32)  # device by slot: the F or B there
        table[device * horizon + self.slot[:fb]] = np.arange(fb, dtype=np.int32)
        busy = np.flatnonzero(table >= 0)  # by device, then slot
        per_device = np.bincount(device, minlength=D)
        rank = np.arange(fb) - np.repeat(np.cumsum(per_device) - per_device, per_device)
        is_b = table[busy] >= S * m
        cell, owner = busy[is_b], table[busy[is_b]]
        on = cell // horizon
        idle_before = cell % horizon - rank[is_b]
        bs = np.bincount(on, minlength=D)
        k = np.arange(len(cell)) - np.repeat(np.cumsum(bs) - bs, bs)
        # A running maximum per device: each device's values are lifted above every earlier device's.
        lift = on * (horizon + fb + 1)
        taken = k + np.maximum.accumulate(idle_before - k + lift) - lift
        idle = np.flatnonzero(table < 0)  # by device, then slot
        idle_count = horizon - per_device
        first_idle = np.cumsum(idle_count) - idle_count
        spot = horizon + taken - idle_count[on]
        inside = spot < horizon
        spot[inside] = idle[first_idle[on[inside]] + taken[inside]] % horizon
        self.slot[owner + S * m] = spot


class _DeviceRow:
    """One device's F and B passes during pull_forward, slot by slot, with its memory.

    Memory is counted as if each W already sat in the first idle slot after its B: the state is
    the stage activations held and the Bs whose W still waits for an idle slot. An F adds an
    activation, a B a waiting W, an idle slot runs the oldest waiting W, which frees one.
    ``cells`` (F, B or idle) holds only the passes already visited: the others all sit at or after
    the slot being decided, which no decision reads; ``busy`` marks the same cells, for
    ``bytearray.find``. ``after[c]`` is the state (level, pending) just after the pass in slot c,
    kept for passes only (idle slots between two passes follow from the first one's state), and
    right for the passes before ``valid``; the others are computed when read.
    """

    __slots__ = ("cells", "busy", "after", "valid")

    def __init__(self, horizon: int) -> None:
        self.cells = bytearray(horizon)
        self.busy = bytearray(horizon)
        self.after: list[tuple[int, int]] = [(0, 0)] * horizon
        self.valid = 0

    def _state(self, t: int) -> tuple[int, int]:
        """The state at the start of slot t (the passes before t must be valid)."""
        c = self.busy.rfind(1, 0, t)
        if c < 0:
            return 0, 0
        level, pending = self.after[c]
        idle = t - c - 1
        if idle >= pending:
            return level - pending, 0
        return level - idle, pending - idle

    def _walk(self, start: int, stop: int, level: int, pending: int, bound: float) -> bool:
        """Go over the passes in [start, stop) from the state before ``start``, keeping their states; False at
        an F going over ``bound``, which leaves them unkept from ``start`` on."""
        cells, after, find = self.cells, self.after, self.busy.find
        t, at = start, find(1, start, stop)
        while at >= 0:
            idle = at - t  # idle slots before the pass run waiting Ws
            if idle >= pending:
                level -= pending
                pending = 0
            else:
                level -= idle
                pending -= idle
            if cells[at] == _FWD:
                level += 1
                if level > bound:
                    self.valid = min(self.valid, start)
                    return False
            else:
                pending += 1
            after[at] = level, pending
            t = at + 1
            at = find(1, t, stop)
        return True

    def _extend(self, upto: int) -> None:
        if self.valid < upto:
            self._walk(self.valid, upto, *self._state(self.valid), bound=math.inf)
            self.valid = upto

    def place(self, t: int, cell: int) -> None:
        """Put a pass that stays in slot t."""
        self.cells[t] = cell
        self.busy[t] = 1
        self.valid = min(self.valid, t)

    def try_move(self, new: int, old: int, cell: int, bound: int) -> bool:
        """Move a pass (``cell``: F or B) from slot ``old`` to the idle slot ``new`` if levels stay within ``bound``.

        Only the slots in [new, old) can go over: after ``old`` the move only frees Ws earlier, so
        the level there is at most what it was, and it was within the bound (the squeezed
        schedule's peak is, and every kept move kept it so).
        """
        if self.valid < new:
            self._extend(new)
        level, pending = self._state(new)
        if cell == _FWD:
            level += 1
            if level > bound:
                return False
        else:
            pending += 1
        if not self._walk(new + 1, old, level, pending, bound):
            return False
        self.cells[new], self.busy[new] = cell, 1
        self.after[new] = level, pending
        self.valid = old  # no visited pass lies after the slot being decided
        return True

    def repeats(self, start: int, period: int) -> bool:
        """Whether the state at the start of slot ``start + period`` is the one at the start of ``start``."""
        self._extend(start + period)
        return self._state(start) == self._state(start + period)

    def repeat_forward(self, start: int, period: int, times: int, end: int) -> None:
        """Cells [start, end) and their states again ``times`` periods later, [start, start + period) in between.

        What the jump in ``_Expansion._pull_jump`` proves: the cells before ``start + period`` stay,
        each later period repeats the first, and the visited part ends ``times`` periods later.
        """
        _repeat_forward(self.cells, start, period, times, end)
        _repeat_forward(self.busy, start, period, times, end)
        _repeat_forward(self.after, start, period, times, end)
        self.valid = min(self.valid, end) + times * period


_Cells = TypeVar("_Cells", bytearray, list[tuple[int, int]])


def _repeat_forward(cells: _Cells, start: int, period: int, times: int, end: int) -> None:
    shift = times * period
    tail = cells[start:end]
    cells[start + period:start + shift] = cells[start:start + period] * (times - 1)
    cells[start + shift:end + shift] = tail


class _Visit:
    """The order a step visits passes in: by ``key`` (slot * S + stage, distinct), and where it repeats."""

    def __init__(self, key: np.ndarray, stages: int, m: int, interval: int, period: int) -> None:
        self.key, self.stages, self.period = key, stages, period
        self.order = _sorted_by_key(key)
        self.sorted = key[self.order]
        # Position y repeats position y - period a microbatch later (in the middle, every position does).
        order, slot = self.order, self.sorted // stages
        self.repeats = np.zeros(len(key), dtype=bool)
        self.repeats[period:] = ((order[period:] == order[:-period] + 1) & (order[period:] % m != 0)
                                 & (slot[period:] == slot[:-period] + interval))

    def slot(self, y: int) -> int:
        """The slot the pass at position y had when the visit was sorted."""
        return int(self.sorted[y]) // self.stages

    def first_at(self, slot: int) -> int:
        """The first position whose pass sits at ``slot`` or later."""
        return int(np.searchsorted(self.sorted, slot * self.stages))

    def reach(self, start: int, needs: np.ndarray) -> int:
        """How many positions back the passes ``needs`` (past the last pass: none) of the passes at positions
        start, start + 1, ... lie, at most."""
        real = needs < len(self.key)
        where = np.searchsorted(self.sorted, self.key[needs[real]])
        return int(np.max(start + np.flatnonzero(real) - where, initial=0))

    def run_end(self, v: int) -> int:
        """The first position from v on that does not repeat the one a period before."""
        off = np.flatnonzero(~self.repeats[v:])
        return v + int(off[0]) if len(off) else len(self.repeats)

    def walk(self, step: Callable[[int, int], None], jump: Callable[[int], int]) -> None:
        """Visit all positions in order: ``step`` over a stretch, then ``jump``, which skips what it proves,
        at each repeating position a period or more further on."""
        total, y, starts = len(self.key), 0, np.flatnonzero(self.repeats)
        while y < total:
            k = int(np.searchsorted(starts, y + self.period))
            stop = int(starts[k]) if k < len(starts) else total
            step(y, stop)
            y = jump(stop) if stop < total else stop


def _repeat_values(values: np.ndarray, template: np.ndarray, periods: int, step: int) -> None:
    """The value of each pass in ``template`` for its next ``periods`` microbatches, ``step`` more each time.

    In a repeating stretch the pass k periods after pass i is pass i + k (see the ``repeats`` arrays).
    """
    later = step * np.arange(1, periods + 1)
    for i, value in zip(template.tolist(), values[template].tolist(), strict=True):
        values[i + 1:i + periods + 1] = value + later  # contiguous: no large temporary


def _sorted_by_key(key: np.ndarray) -> np.ndarray:
    """The indices that sort ``key``, distinct non-negative integers: a counting sort through a table."""
    table = np.full(int(key.max()) + 1, -1, dtype=np.int32)
    table[key] = np.arange(len(key), dtype=np.int32)
    return table[table >= 0]


def _squeezed_peak(device: np.ndarray, slot: np.ndarray, first_b: int, devices: int, horizon: int) -> int:
    """The most stage activations any device holds in the squeezed schedule, W filling idle slots.

    Per device, with X the running count of Bs minus idle slots (each idle slot runs a waiting W
    if there is one), the waiting Ws are X - min X so far (a queue's length), and the activations
    held are Fs - frees = Fs - (Bs - waiting) = Fs - idle slots - min X so far.
    """
    cells = np.zeros((devices, horizon), dtype=np.int8)
    cells[device, slot] = np.where(np.arange(len(slot)) < first_b, _FWD, _BWD)
    idle = np.cumsum(cells == _IDLE, axis=1, dtype=np.int32)
    lowest = np.minimum(np.minimum.accumulate(np.cumsum(cells == _BWD, axis=1, dtype=np.int32) - idle, axis=1), 0)
    return max(0, int((np.cumsum(cells == _FWD, axis=1, dtype=np.int32) - idle - lowest).max()))


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
