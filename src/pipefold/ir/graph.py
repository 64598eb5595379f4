"""The dependency graph of a schedule: what each action waits for and gives, the transfers between devices,
validation (a schedule that can run to the end, each action once, in a place it may run), and the grid that shows
where a schedule goes wrong."""

from __future__ import annotations

import bisect
import functools
import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pipefold.errors import ScheduleError
from pipefold.ir.kinds import BW, KINDS, NO_MICROBATCH, PASSES, Action, B, F, Kind, W
from pipefold.ir.schedule import Schedule

# --------------------------------------------------------------------------- the dependency graph
#
# Every microbatch goes through the stage chain (S stages) by the rules of KINDS:
#
#     F(0) -> F(1) -> ... -> F(S-1) -> B(S-1) -> B(S-2) -> ... -> B(0)
#                                        |          |               |
#                                        W          W               W
#
# (BW gives B and W at once; an overlapped pair gives what its parts give.) A device
# runs its list strictly in order, so a schedule can run iff a traversal that always
# takes each device's next action, when what it waits for is done, reaches the end
# of every list. One graph, built here, is what validation, the simulator and the
# runtime all read.


@dataclass(frozen=True)
class Graph:
    """A validated schedule's dependencies, a runnable order of its actions and, given durations, their times.

    Actions are numbered globally, device after device (:meth:`gid`); ``inputs[g]`` are the
    actions that action g waits for besides the one before it on its device.
    """

    schedule: Schedule
    offsets: tuple[int, ...]
    """Global number of each device's first action."""
    inputs: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    """Every action in an order that respects all dependencies; the members of a collective come together."""
    peers: Mapping[int, tuple[int, ...]]
    """For each collective action, every member of its collective (itself included)."""
    starts: list[float]
    ends: list[float]
    """With durations: when each action starts and ends (see :func:`dependency_graph`)."""

    def gid(self, device: int, position: int) -> int:
        return self.offsets[device] + position

    def where(self, gid: int) -> tuple[int, int]:
        """(device, position) of action ``gid``."""
        device = bisect.bisect_right(self.offsets, gid) - 1
        return device, gid - self.offsets[device]

    def action(self, gid: int) -> Action:
        d, i = self.where(gid)
        return self.schedule.actions[d][i]

    def transfers(self) -> list[Transfer]:
        """Every input that crosses devices: the messages of a step, in the order their senders run.

        Each names the pass it carries (``F``: an activation, ``B``: a gradient), the stage that
        gives it and the stage that takes it. A composite sends its parts' outputs in part order.
        Worked out once per graph: the runtime asks for it once per peer and kind of step.
        """
        return list(self._transfers)

    @functools.cached_property
    def _transfers(self) -> tuple[Transfer, ...]:
        S = self.schedule.stages
        out = []
        for d, row in enumerate(self.schedule.actions):
            for i, act in enumerate(row):
                gid = self.gid(d, i)
                for a in act.passes:
                    spec = KINDS[a.kind]
                    if not spec.microbatch:
                        continue
                    for name, offset in spec.needs:
                        t = a.stage + offset
                        if not 0 <= t < S:
                            continue
                        src = self.schedule.device_of(t, a.microbatch)
                        if src == d:
                            continue
                        g, part = next((g, k) for g in self.inputs[gid]
                                       for k, p in enumerate(self.action(g).passes)
                                       if (p.stage, p.microbatch) == (t, a.microbatch) and name in KINDS[p.kind].gives)
                        out.append(Transfer(*self.where(g), d, i, name, t, a.stage, a.microbatch, part))
        out.sort(key=lambda x: (x.src, x.src_position, x.part))
        return tuple(out)


class Transfer(NamedTuple):
    """One message of a step: pass ``pass_`` of (``stage``, ``microbatch``), from one action to another device's."""

    src: int
    src_position: int
    dst: int
    dst_position: int
    pass_: str
    stage: int
    """The stage that gives it."""
    to_stage: int
    """The stage that takes it."""
    microbatch: int
    part: int
    """Which part of the sending action gives it (0 unless that action is a composite)."""


def dependency_graph(schedule: Schedule, durations: Sequence[float] | None = None, transfer: float = 0.0,
                     idle: frozenset[str] = frozenset()) -> Graph:
    """Check ``schedule`` and return its :class:`Graph`; raise :class:`ScheduleError` for the first violation.

    Checked, in this order: every action's kind, stage and microbatch are known and in range,
    and it runs on the device its (replica of the) stage is placed on; each pass of each
    (stage, microbatch) is given exactly once; a replicated stage has one all-reduce on each
    holder; then that all per-device orders run together without deadlock.

    With ``durations`` (per action, by global number) the traversal also times the actions:
    each starts when its device is free and its inputs are done, ``transfer`` later for an
    input from another device; a collective's members start together; an action whose kind is
    in ``idle`` (communication) leaves its device free at once.
    """
    rows = schedule.actions
    offsets = tuple(itertools.accumulate((len(r) for r in rows[:-1]), initial=0))
    givers, names = _givers(schedule, offsets)
    inputs = _inputs(schedule, givers, names, offsets)
    return _traverse(schedule, offsets, inputs, durations, transfer, idle)


def _pass_names() -> dict[str, int]:
    names = {name: k for k, name in enumerate(PASSES)}
    for spec in KINDS.values():
        for name in (*spec.gives, *(n for n, _ in spec.needs)):
            names.setdefault(name, len(names))
    return names


def _givers(schedule: Schedule, offsets: Sequence[int]) -> tuple[list[int], dict[str, int]]:
    """Who gives each pass: a flat list over (pass * S + stage) * M + microbatch of global action numbers
    (-1: nobody), stage-wide passes after them at (pass * S + stage) * D + device."""
    S, M, D = schedule.stages, schedule.microbatches, schedule.devices
    placement, routes = schedule.placement, schedule.routes
    names = _pass_names()
    P = len(names)
    wide0 = P * S * M
    giver = [-1] * (wide0 + P * S * D)
    info = {code: (spec.microbatch, tuple((names[g] * S) * M for g in spec.gives),
                   tuple(wide0 + names[g] * S * D for g in spec.gives)) for code, spec in KINDS.items()}
    # The common case first: a one-replica schedule's simple action of a known per-microbatch kind that gives
    # one pass; anything else goes through the general loop below.
    one = {code: gives[0] for code, (per_mb, gives, _) in info.items() if per_mb and len(gives) == 1}
    home = placement[0] if len(placement) == 1 else None
    gid = 0
    for device, row in enumerate(schedule.actions):
        for position, act in enumerate(row):
            s, kind, m, parts = act
            base = one.get(kind, -1)
            if base >= 0 and home is not None and not parts and 0 <= s < S and 0 <= m < M and home[s] == device:
                at = base + s * M + m
                if giver[at] >= 0:
                    _duplicate(schedule, device, position, act, giver[at], offsets)
                giver[at] = gid
                gid += 1
                continue
            for a in (parts or (act,)):
                s, kind, m = a[0], a[1], a[2]
                got = info.get(kind)
                if got is None:
                    _fail(schedule, f"device {device}, position {position}: action {act} is of kind {kind}, "
                          f"which is not registered (kinds: {', '.join(KINDS)})", device=device, position=position)
                per_mb, gives, wide = got  # type: ignore[misc]
                if per_mb:
                    if not (0 <= s < S and 0 <= m < M and placement[routes[m]][s] == device):
                        _check_action_place(schedule, device, position, a)
                    at = s * M + m
                    for base in gives:
                        if giver[base + at] >= 0:
                            _duplicate(schedule, device, position, a, giver[base + at], offsets)
                        giver[base + at] = gid
                else:
                    if not (0 <= s < S and m == NO_MICROBATCH and device in schedule.holders(s)):
                        _check_action_place(schedule, device, position, a)
                    if KINDS[kind].collective and len(schedule.holders(s)) < 2:
                        _fail(schedule, f"device {device}, position {position}: {a} runs between the replicas of "
                              f"stage {s}, but the placement holds it once (device {device}): remove it",
                              device=device, position=position)
                    for base in wide:
                        if giver[base + s * D + device] >= 0:
                            _duplicate(schedule, device, position, a, giver[base + s * D + device], offsets)
                        giver[base + s * D + device] = gid
            gid += 1
    _check_complete(schedule, giver, offsets)
    r_base = wide0 + names[Kind.R] * S * D
    for s in range(S):
        holders = schedule.holders(s)
        if len(holders) > 1:
            for d in holders:
                if giver[r_base + s * D + d] < 0:
                    _fail(schedule, f"device {d}: stage {s} has replicas on devices "
                          f"{', '.join(map(str, holders))}, so each needs an all-reduce of its gradients "
                          f"({s}{Kind.R}) after its last backward", device=d, position=len(schedule.actions[d]))
    return giver, names


def _where(offsets: Sequence[int], gid: int) -> tuple[int, int]:
    device = bisect.bisect_right(offsets, gid) - 1
    return device, gid - offsets[device]


def _duplicate(schedule: Schedule, device: int, position: int, a: Action, first_gid: int,
               offsets: Sequence[int]) -> None:
    d0, at = _where(offsets, first_gid)
    first = schedule.actions[d0][at]
    firsts = first.passes
    if a in firsts:
        _fail(schedule, f"device {device}, position {position}: {a} appears twice (first at position {at})",
              device=device, position=position)
    fused = next((x for x in (a, *firsts) if x.kind == Kind.BW), None)
    label = f"stage {a.stage} microbatch {a.microbatch}"
    if fused is not None:
        other = first if fused == a else a
        _fail(schedule, f"device {device}, position {position}: {label} has both a fused backward {fused} and "
              f"{other}", device=device, position=position)
    _fail(schedule, f"device {device}, position {position}: {label}: {a} and {first} (device {d0}, position {at}) "
          "both compute the same pass", device=device, position=position)


def _check_complete(schedule: Schedule, giver: list[int], offsets: Sequence[int]) -> None:
    """Every (stage, microbatch) has its forward, its input gradient and its weight gradient."""
    SM = schedule.stages * schedule.microbatches
    f, b, w = giver[:SM], giver[SM:2 * SM], giver[2 * SM:3 * SM]
    if min(f) >= 0 and min(b) >= 0 and min(w) >= 0:
        return
    M = schedule.microbatches
    for idx in range(SM):
        s, m = divmod(idx, M)
        device = schedule.device_of(s, m)
        end = dict(device=device, position=len(schedule.actions[device]))
        label = f"stage {s} microbatch {m}"
        if f[idx] < 0:
            _fail(schedule, f"device {device}: {label} has no forward ({F(s, m)})", **end)
        if b[idx] < 0 and w[idx] < 0:
            _fail(schedule, f"device {device}: {label} has no backward ({B(s, m)} or {BW(s, m)})", **end)
        if w[idx] < 0:
            _fail(schedule, f"device {device}: {label} has {B(s, m)} but no {W(s, m)}", **end)
        if b[idx] < 0:
            pos = _where(offsets, w[idx])[1]
            _fail(schedule, f"device {device}, position {pos}: {W(s, m)} has no {B(s, m)} before it",
                  device=device, position=pos)


def _inputs(schedule: Schedule, giver: list[int], names: Mapping[str, int],
            offsets: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    S, M, D = schedule.stages, schedule.microbatches, schedule.devices
    wide0 = len(names) * S * M
    by_replica: dict[int, list[int]] = {}
    for m, r in enumerate(schedule.routes):
        by_replica.setdefault(r, []).append(m)
    # Per kind: (stage offset, index of that pass at stage offset 0) for each need.
    needs = {code: tuple((off, names[n] * S * M + off * M) for n, off in spec.needs) for code, spec in KINDS.items()}
    # Per-microbatch kinds that also wait for stage-wide passes (a forward for its stage's FSDP all-gather), where
    # the schedule has any of those passes at all.
    wide_afters = {code: tuple(wide0 + names[n] * S * D for n in spec.after) for code, spec in KINDS.items()
                   if spec.microbatch and spec.after}
    wide_afters = {code: bases for code, bases in wide_afters.items()
                   if any(g >= 0 for base in bases for g in giver[base:base + S * D])}
    out: list[tuple[int, ...]] = []
    append = out.append
    for device, row in enumerate(schedule.actions):
        for act in row:
            if not act[3] and act[2] >= 0 and act[1] not in wide_afters:  # the common case: one pass of one
                # microbatch, one or two needs
                s, kind, m = act[0], act[1], act[2]
                at = s * M + m
                nd = needs[kind]
                off, base = nd[0] if nd else (-S, 0)
                g = giver[base + at] if 0 <= s + off < S else -1
                if len(nd) == 2:
                    off, base = nd[1]
                    g2 = giver[base + at] if 0 <= s + off < S else -1
                    append((g, g2) if g >= 0 and g2 >= 0 else (g,) if g >= 0 else (g2,) if g2 >= 0 else ())
                elif len(nd) < 2:
                    append((g,) if g >= 0 else ())
                else:
                    append(tuple(g for off, base in nd if 0 <= s + off < S and (g := giver[base + at]) >= 0))
                continue
            got: list[int] = []
            for a in act.passes:
                s, kind, m = a[0], a[1], a[2]
                if m >= 0:
                    at = s * M + m
                    got += [g for off, base in needs[kind] if 0 <= s + off < S and (g := giver[base + at]) >= 0]
                    got += [g for base in wide_afters.get(kind, ()) if (g := giver[base + s * D + device]) >= 0]
                    continue
                spec = KINDS[kind]
                replica = schedule.replica_on(s, device)
                for n in spec.gathers:
                    got += [g for mb in by_replica.get(replica, ()) if (g := giver[names[n] * S * M + s * M + mb]) >= 0]
                for n in spec.after:
                    if (g := giver[wide0 + names[n] * S * D + s * D + device]) >= 0:
                        got.append(g)
            append(tuple(got))
    return tuple(out)


def _traverse(schedule: Schedule, offsets: tuple[int, ...], inputs: tuple[tuple[int, ...], ...],
              durations: Sequence[float] | None, transfer: float, idle: frozenset[str]) -> Graph:
    """A runnable order: each device runs on until an action waits for one not yet run, and is woken then.

    The members of a collective start together, once every member is at the head of its device.
    """
    rows = schedule.actions
    D = schedule.devices
    N = schedule.num_actions
    peers: dict[int, tuple[int, ...]] = {}
    members: dict[tuple[str, int], list[int]] = {}
    quiet: set[int] = set()  # actions that leave their device free (communication)
    for d, row in enumerate(rows):
        for i, a in enumerate(row):
            if not a.parts and a.microbatch < 0:
                if KINDS[a.kind].collective:
                    members.setdefault((a.kind, a.stage), []).append(offsets[d] + i)
                if a.kind in idle:
                    quiet.add(offsets[d] + i)
    for together in members.values():
        for member in together:
            peers[member] = tuple(together)
    dev_of = [d for d, row in enumerate(rows) for _ in row]
    dur = durations if durations is not None else [0.0] * N
    done = bytearray(N)
    starts = [0.0] * N
    ends = [0.0] * N
    free = [0.0] * D
    heads = [0] * D
    lengths = [len(r) for r in rows]
    waiting: dict[int, list[int]] = {}
    order: list[int] = []
    queue = deque(range(D))
    while queue:
        device = queue.popleft()
        pos, n = heads[device], lengths[device]
        gid = offsets[device] + pos
        ready0 = free[device]
        while pos < n:
            ready = ready0
            blocker = -1
            for g in inputs[gid]:
                if not done[g]:
                    blocker = g
                    break
                t = ends[g] + transfer if dev_of[g] != device else ends[g]
                if t > ready:
                    ready = t
            if blocker >= 0:
                waiting.setdefault(blocker, []).append(device)
                break
            if peers and gid in peers:
                group = peers[gid]
                late = next((m for m in group if m != gid and heads[dev_of[m]] + offsets[dev_of[m]] != m), -1)
                if late >= 0:
                    break  # the last member to arrive runs them all
                for m in group:
                    md = dev_of[m]
                    t = max([free[md]] + [ends[g] + (transfer if dev_of[g] != md else 0.0) for g in inputs[m]])
                    ready = max(ready, t)
                for m in group:
                    md = dev_of[m]
                    starts[m], ends[m] = ready, ready + dur[m]
                    done[m] = 1
                    order.append(m)
                    free[md] = ready if m in quiet else ready + dur[m]
                    if md != device:
                        heads[md] += 1
                        queue.append(md)
                    queue.extend(waiting.pop(m, ()))
                ready0 = free[device]
                pos += 1
                gid += 1
                continue
            end = ready + dur[gid]
            starts[gid] = ready
            ends[gid] = end
            done[gid] = 1
            order.append(gid)
            ready0 = ready if quiet and gid in quiet else end
            woken = waiting.pop(gid, None)
            if woken:
                queue.extend(woken)
            pos += 1
            gid += 1
        free[device] = ready0
        heads[device] = pos
    if len(order) != N:
        _report_stuck(schedule, offsets, heads, inputs, peers)
    return Graph(schedule, offsets, inputs, tuple(order), peers, starts, ends)


def _report_stuck(schedule: Schedule, offsets: Sequence[int], heads: list[int],
                  inputs: tuple[tuple[int, ...], ...], peers: Mapping[int, tuple[int, ...]]) -> None:
    """Explain why the traversal stopped: a local order violation, or a cross-device deadlock."""
    rows = schedule.actions

    def done(g: int) -> bool:
        d, i = _where(offsets, g)
        return heads[d] > i

    blocked: dict[int, tuple[int, int]] = {}
    for device, row in enumerate(rows):
        pos = heads[device]
        if pos < len(row):
            gid = offsets[device] + pos
            waits = [g for g in inputs[gid] if not done(g)]
            waits += [m for m in peers.get(gid, ()) if m != gid and heads[_where(offsets, m)[0]] + offsets[
                _where(offsets, m)[0]] != m]
            blocked[device] = _where(offsets, waits[0])
    # A dependency that sits later on the same device is an ordering mistake of that device alone.
    for device, (dep_device, dep_pos) in blocked.items():
        pos = heads[device]
        if dep_device == device:
            _fail(schedule, f"device {device}, position {pos}: {rows[device][pos]} comes before "
                  f"{rows[dep_device][dep_pos]} (position {dep_pos}), which it depends on", device=device, position=pos)
    # Otherwise follow who-waits-for-whom until a device repeats: that is the cycle.
    device = min(blocked)
    chain: list[int] = []
    while device not in chain:
        chain.append(device)
        device = blocked[device][0]
    cycle = chain[chain.index(device):]
    parts = [
        f"device {d} at position {heads[d]} ({rows[d][heads[d]]}) waits for {rows[blocked[d][0]][blocked[d][1]]} "
        f"on device {blocked[d][0]} (position {blocked[d][1]})"
        for d in cycle
    ]
    first = cycle[0]
    _fail(schedule, "deadlock: " + "; ".join(parts), device=first, position=heads[first])


def _check_action_place(schedule: Schedule, device: int, position: int, a: Action) -> None:
    where = dict(device=device, position=position)
    S, M = schedule.stages, schedule.microbatches
    if not 0 <= a.stage < S:
        _fail(schedule, f"device {device}, position {position}: action {a} names stage {a.stage}, "
              f"but stages are 0..{S - 1}", **where)
    if KINDS[a.kind].microbatch and not 0 <= a.microbatch < M:
        _fail(schedule, f"device {device}, position {position}: action {a} names microbatch "
              f"{a.microbatch}, but microbatches are 0..{M - 1}", **where)
    if not KINDS[a.kind].microbatch:
        _fail(schedule, f"device {device}, position {position}: action {a} runs for stage {a.stage}, "
              f"which the placement puts on device(s) {', '.join(map(str, schedule.holders(a.stage)))}", **where)
    home = schedule.device_of(a.stage, a.microbatch)
    route = f" for microbatch {a.microbatch}" if schedule.replicas > 1 else ""
    _fail(schedule, f"device {device}, position {position}: action {a} runs stage {a.stage}, "
          f"which the placement puts on device {home}{route}", **where)


def validate(schedule: Schedule) -> Schedule:
    """Check ``schedule``; return it unchanged or raise :class:`ScheduleError` for the first violation.

    Checked: kinds, ranges and placement; each (stage, microbatch) has exactly one F and
    exactly one backward (B then W, or BW); a replicated stage has an all-reduce on each
    holder; every action after what it waits for (:data:`KINDS`); and all per-device orders
    run together without deadlock.
    """
    dependency_graph(schedule)
    return schedule


def _fail(schedule: Schedule, message: str, *, device: int, position: int) -> None:
    raise ScheduleError(message, render_grid(schedule, device, position), device=device, position=position)


def render_grid(schedule: Schedule, device: int | None = None, position: int | None = None,
                width: int = 12) -> str:
    """A device-by-step grid of the schedule; the cell at (device, position) is marked ``>..<``.

    Long schedules show a window of ``width`` steps around the marked position.
    """
    longest = max((len(r) for r in schedule.actions), default=0)
    centre = position if position is not None else 0
    lo = max(0, min(centre - width // 2, longest - width))
    hi = min(max(longest, (position or 0) + 1), lo + width)
    cells = [[str(a) for a in row[lo:hi]] for row in schedule.actions]
    if device is not None and position is not None:
        row = cells[device]
        while len(row) <= position - lo:
            row.append("")
        row[position - lo] = f">{row[position - lo] or '(end)'}<"
    col_w = max([len("step " + str(hi - 1))] + [len(c) for row in cells for c in row]) + 1
    header = "        " + ("... " if lo > 0 else "") + "".join(f"{lo + i:<{col_w}}" for i in range(hi - lo))
    lines = [header.rstrip()]
    for d, row in enumerate(cells):
        prefix = f"dev {d:<3} " + ("... " if lo > 0 else "")
        suffix = " ..." if hi < len(schedule.actions[d]) else ""
        lines.append((prefix + "".join(f"{c:<{col_w}}" for c in row)).rstrip() + suffix)
    return "\n".join(lines)
