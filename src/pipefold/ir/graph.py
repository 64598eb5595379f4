"""The dependency graph of a schedule: what each action waits for and gives, the transfers between devices,
validation (a schedule that can run to the end, each action once, in a place it may run), and the grid that shows
where a schedule goes wrong."""

from __future__ import annotations

import array
import bisect
import functools
import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from pipefold.errors import ScheduleError
from pipefold.ir.kinds import BW, KINDS, NO_MICROBATCH, PASSES, Action, B, F, Kind, KindSpec, W
from pipefold.ir.schedule import ActionRows, Schedule, row_lengths

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
#
# Speed: a schedule has up to hundreds of thousands of actions, so the rules of KINDS
# are compiled once into small integer tables (_Rules; again when a kind is
# registered), the actions into flat arrays (ActionTable), and who gives and who
# waits for what is worked out on those arrays with numpy. Only the traversal walks
# action by action, on flat lists, and looks at one input of most actions (those
# that ran earlier on the same device cannot hold it up). A schedule that breaks a
# rule goes through the detailed path (_givers_in_order), which stops at the first
# violation in device order and names it.

Ints = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Graph:
    """A validated schedule's dependencies, a runnable order of its actions and, given durations, their times.

    Actions are numbered globally, device after device (:meth:`gid`); ``inputs[g]`` are the
    actions that action g waits for besides the one before it on its device.
    """

    schedule: Schedule
    offsets: tuple[int, ...]
    """Global number of each device's first action."""
    peers: Mapping[int, tuple[int, ...]]
    """For each collective action, every member of its collective (itself included)."""
    starts: list[float]
    ends: list[float]
    """With durations: when each action starts and ends (see :func:`dependency_graph`)."""
    table: ActionTable = field(repr=False, compare=False)
    """The actions as flat arrays."""
    links: Links = field(repr=False, compare=False)
    """What each action waits for, compactly (:attr:`inputs` spells it out)."""
    runs: list[int] = field(repr=False, compare=False)
    """:attr:`order` as ranges of global numbers: first, end, first, end, ..."""

    @functools.cached_property
    def inputs(self) -> tuple[tuple[int, ...], ...]:
        """For each action, the actions it waits for besides the one before it on its device."""
        return self.links.spelled()

    def message_ends(self) -> npt.NDArray[np.int64]:
        """For each action, the messages it takes part in: the inputs it waits for from another device, and the
        actions on another device that wait for it (stage-wide dependencies, as a collective's, left out)."""
        return _message_ends(self.links, self.table.device)

    @functools.cached_property
    def order(self) -> tuple[int, ...]:
        """Every action in an order that respects all dependencies; the members of a collective come together."""
        return tuple(itertools.chain.from_iterable(map(range, self.runs[0::2], self.runs[1::2])))

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


def dependency_graph(schedule: Schedule, durations: Sequence[float] | npt.NDArray[np.float64] | None = None,
                     transfer: float | Sequence[Sequence[float]] = 0.0, idle: frozenset[str] = frozenset(), *,
                     table: ActionTable | None = None, message_cost: float = 0.0) -> Graph:
    """Check ``schedule`` and return its :class:`Graph`; raise :class:`ScheduleError` for the first violation.

    Checked, in this order: every action's kind, stage and microbatch are known and in range,
    and it runs on the device its (replica of the) stage is placed on; each pass of each
    (stage, microbatch) is given exactly once; a replicated stage has one all-reduce on each
    holder; then that all per-device orders run together without deadlock.

    With ``durations`` (per action, by global number; a list or an array) the traversal also times the actions:
    each starts when its device is free and its inputs are done, ``transfer`` later for an
    input from another device (one time for every pair of devices, or ``transfer[a][b]`` from device a to b; an
    output taken on several other devices arrives on all of them when the slowest crossing ends); a collective's
    members start together; an action whose kind is
    in ``idle`` (communication) leaves its device free at once; each action lasts ``message_cost`` longer per
    message it sends or receives (:meth:`Graph.message_ends`). ``table`` is the schedule's
    :func:`action_table`, when the caller has it already.
    """
    offsets = tuple(itertools.accumulate(row_lengths(schedule.actions)[:-1], initial=0))
    table = action_table(schedule) if table is None else table
    links = _links(schedule, table, offsets)
    if durations is not None and message_cost:
        durations = np.asarray(durations, dtype=np.float64) + message_cost * _message_ends(links, table.device)
    return _traverse(schedule, offsets, table, links, durations, transfer, idle)


_LINKS = "_links"
"""Where a schedule keeps its checked :class:`Links`, with the table and rules they were made from."""


def _links(schedule: Schedule, table: ActionTable, offsets: tuple[int, ...]) -> Links:
    """What each action of ``schedule`` waits for, its givers checked first (:func:`_givers`): made once and kept
    with the schedule, which is frozen, while ``table`` is the one it keeps (:func:`action_table`) and no kind has
    been registered since. A planner times one schedule on many splits of the layers (thousands of graphs): the
    timing is all that changes. The arrays are read-only, so that no graph's user can change another's."""
    rules = _rules()
    made = schedule.__dict__.get(_LINKS)
    if made is not None and made[0] is table and made[1] is rules:
        return made[2]
    links = _inputs(schedule, table, rules, _givers(schedule, table, rules, offsets))
    for slot in links.slots:
        slot.setflags(write=False)
    if schedule.__dict__.get(_TABLE) is table:
        object.__setattr__(schedule, _LINKS, (table, rules, links))
    return links


# --------------------------------------------------------------------------- the kind table, compiled


def _pass_names() -> dict[str, int]:
    names = {name: k for k, name in enumerate(PASSES)}
    for spec in KINDS.values():
        for name in (*spec.gives, *(n for n, _ in spec.needs)):
            names.setdefault(name, len(names))
    return names


class _Rules(NamedTuple):
    """:data:`KINDS` as integer tables by kind number (a kind's place in KINDS) and pass number
    (:func:`_pass_names`), each row padded with -1: what the graph's array code reads of the kind specs."""

    codes: tuple[str, ...]
    names: dict[str, int]
    per_microbatch: npt.NDArray[np.bool_]
    composite: npt.NDArray[np.bool_]
    gives: Ints
    """[kind, j]: the j-th pass the kind gives."""
    need_pass: Ints
    """[kind, j]: the pass of its j-th need (``KindSpec.needs``)..."""
    need_offset: Ints
    """... and that need's stage offset."""
    after: Ints
    """[kind, j]: for a per-microbatch kind, the j-th stage-wide pass of its stage and device it waits for."""
    shard: npt.NDArray[np.bool_]
    """Kinds whose stage field is a device's shard of the vocabulary layer (``KindSpec.shard``)."""


_compiled: list[tuple[tuple[tuple[str, KindSpec], ...], _Rules]] = []
"""The last compilation of KINDS, with the table it was made from."""


def _rules() -> _Rules:
    """:data:`KINDS` compiled: once, and again only after it changes (a kind registered)."""
    kinds = tuple(KINDS.items())
    if not _compiled or _compiled[0][0] != kinds:
        _compiled[:] = [(kinds, _compile())]
    return _compiled[0][1]


def _compile() -> _Rules:
    names = _pass_names()
    specs = list(KINDS.values())

    def padded(rows: list[list[int]]) -> Ints:
        width = max(map(len, rows))
        return np.array([row + [-1] * (width - len(row)) for row in rows], dtype=np.int64).reshape(len(rows), width)

    return _Rules(
        codes=tuple(KINDS), names=names,
        per_microbatch=np.array([spec.microbatch for spec in specs], dtype=bool),
        composite=np.array([spec.composite for spec in specs], dtype=bool),
        gives=padded([[names[n] for n in spec.gives] for spec in specs]),
        need_pass=padded([[names[n] for n, _ in spec.needs] for spec in specs]),
        need_offset=padded([[offset for _, offset in spec.needs] for spec in specs]),
        after=padded([[names[n] for n in spec.after] if spec.microbatch else [] for spec in specs]),
        shard=np.array([spec.shard for spec in specs], dtype=bool))


def _of_kinds(numbers: Ints, picked: list[bool]) -> npt.NDArray[np.bool_]:
    """Whether each of ``numbers`` (of kinds, or of passes) is one of those ``picked`` marks; -1 (none) never is."""
    return np.array([*picked, False])[numbers]


class ActionTable(NamedTuple):
    """A schedule's actions as flat integer arrays by global number (:meth:`Graph.gid`): what the graph and the
    simulator read instead of the Action tuples.

    ``kind`` numbers index ``kinds`` (the codes of :data:`KINDS` when the table was made; -1: not registered).
    Each action runs one pass, or one per part when it has parts (an overlapped pair): the ``pass_*`` arrays list
    them in the actions' order, ``owner`` the action of each; without parts they are the action arrays.
    """

    kinds: tuple[str, ...]
    device: Ints
    kind: Ints
    stage: Ints
    microbatch: Ints
    composite: Ints
    """The actions that have parts, in order."""
    owner: Ints
    pass_kind: Ints
    pass_stage: Ints
    pass_microbatch: Ints


def _device_column(schedule: Schedule) -> Ints:
    """The device of every action, by global number."""
    return np.repeat(np.arange(schedule.devices, dtype=np.int64), row_lengths(schedule.actions))


_TABLE = "_action_table"
"""Where a schedule keeps its :class:`ActionTable`."""


def action_table(schedule: Schedule) -> ActionTable:
    """The :class:`ActionTable` of ``schedule``, made once and kept with it: the schedule is frozen, so the table
    stays true until a kind is registered (then it is made again; a copy made with ``dataclasses.replace`` makes
    its own). Where the rows are :class:`ActionRows` it is made from their columns, without making an Action."""
    codes = tuple(KINDS)
    made = schedule.__dict__.get(_TABLE)
    if made is None or made.kinds != codes:
        made = _read_table(schedule, codes)
        object.__setattr__(schedule, _TABLE, made)
    return made


def _read_table(schedule: Schedule, codes: tuple[str, ...]) -> ActionTable:
    rows = schedule.actions
    if isinstance(rows, ActionRows):
        number = {code: k for k, code in enumerate(codes)}  # (-1: not registered, which the graph reports)
        numbers = np.array([number.get(code, -1) for code in rows.codes], dtype=np.int64)
        owner, kind, stage, microbatch = rows.parts
        composite, sizes = np.unique(owner, return_counts=True)
        return _with_parts(codes, _device_column(schedule), numbers[rows.kind], rows.stage, rows.microbatch,
                           composite, sizes, numbers[kind], stage, microbatch)
    number = {code: k for k, code in enumerate(codes)}
    flat = list(itertools.chain.from_iterable(schedule.actions))
    n = len(flat)
    kind = np.fromiter(map(number.get, map(operator.itemgetter(1), flat), itertools.repeat(-1)), np.int64, n)
    stage = np.fromiter(map(operator.itemgetter(0), flat), np.int64, n)
    microbatch = np.fromiter(map(operator.itemgetter(2), flat), np.int64, n)
    # The actions with parts are those of a composite kind, unless some action says otherwise (parts of its own or
    # none): then they are read one by one.
    composite = np.flatnonzero(_of_kinds(kind, [KINDS[code].composite for code in codes]))
    if operator.countOf(map(operator.itemgetter(3), flat), ()) != n - len(composite):
        composite = np.fromiter(itertools.compress(itertools.count(), map(operator.itemgetter(3), flat)), np.int64)
    of_parts = list(map(operator.itemgetter(3), map(flat.__getitem__, composite.tolist())))
    parts = list(itertools.chain.from_iterable(of_parts))
    return _with_parts(codes, _device_column(schedule), kind, stage, microbatch, composite,
                       np.fromiter(map(len, of_parts), np.int64, len(of_parts)),
                       np.fromiter(map(number.get, map(operator.itemgetter(1), parts), itertools.repeat(-1)), np.int64,
                                   len(parts)),
                       np.fromiter(map(operator.itemgetter(0), parts), np.int64, len(parts)),
                       np.fromiter(map(operator.itemgetter(2), parts), np.int64, len(parts)))


def _with_parts(codes: tuple[str, ...], device: Ints, kind: Ints, stage: Ints, microbatch: Ints, composite: Ints,
                sizes: Ints, part_kind: Ints, part_stage: Ints, part_microbatch: Ints) -> ActionTable:
    """The table of actions whose ``composite`` ones have ``sizes`` parts each, the parts' columns in order."""
    n = len(kind)
    if not len(composite):
        return ActionTable(codes, device, kind, stage, microbatch, composite, np.arange(n), kind, stage, microbatch)
    every = np.ones(n, np.int64)
    every[composite] = sizes
    owner = np.repeat(np.arange(n), every)
    at = np.cumsum(every) - every  # each action's first pass
    simple = np.ones(n, dtype=bool)
    simple[composite] = False
    where = at[simple]
    into = np.repeat(at[composite], sizes)
    into += np.arange(len(into)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    columns = []
    for whole, of_part in ((kind, part_kind), (stage, part_stage), (microbatch, part_microbatch)):
        column = np.empty(len(owner), np.int64)
        column[where] = whole[simple]
        column[into] = of_part
        columns.append(column)
    return ActionTable(codes, device, kind, stage, microbatch, composite, owner, *columns)


# --------------------------------------------------------------------------- who gives each pass


def _givers(schedule: Schedule, table: ActionTable, rules: _Rules, offsets: Sequence[int]) -> Ints:
    """Who gives each pass: a flat array over (pass * S + stage) * M + microbatch of global action numbers
    (-1: nobody), stage-wide passes after them at (pass * S + stage) * D + device."""
    giver = _givers_at_once(schedule, table, rules)
    if giver is None:
        giver = np.array(_givers_in_order(schedule, offsets, rules.names), dtype=np.int64)
    _check_complete(schedule, giver, offsets)
    S, M, D = schedule.stages, schedule.microbatches, schedule.devices
    _check_required(schedule, giver, offsets, rules.names)
    _check_vocab(schedule, giver, offsets, rules)
    r_base = len(rules.names) * S * M + rules.names[Kind.R] * S * D
    trains = bool(np.any(giver[S * M:3 * S * M] >= 0))  # a forward-only schedule has no gradients to reduce
    for s in range(S if trains else 0):
        holders = schedule.holders(s)
        if len(holders) > 1:
            for d in holders:
                if giver[r_base + s * D + d] < 0:
                    _fail(schedule, f"device {d}: stage {s} has replicas on devices "
                          f"{', '.join(map(str, holders))}, so each needs an all-reduce of its gradients "
                          f"({s}{Kind.R}) after its last backward", device=d, position=len(schedule.actions[d]))
    return giver


def _check_required(schedule: Schedule, giver: Ints, offsets: Sequence[int], names: Mapping[str, int]) -> None:
    """Each pass of a kind with ``requires`` (an offload and its reload) comes with the passes it requires, of the
    same (stage, microbatch)."""
    SM, M = schedule.stages * schedule.microbatches, schedule.microbatches
    for spec in KINDS.values():
        for name in spec.requires if spec.microbatch else ():
            for own in spec.gives:
                have = giver[names[own] * SM:(names[own] + 1) * SM]
                lack = giver[names[name] * SM:(names[name] + 1) * SM]
                missing = np.flatnonzero((have >= 0) & (lack < 0))
                if len(missing):
                    at = int(missing[0])
                    d, i = _where(offsets, int(have[at]))
                    s, m = divmod(at, M)
                    act = schedule.actions[d][i]
                    _fail(schedule, f"device {d}, position {i}: {act} needs a {name} of stage {s} microbatch {m} "
                          f"as well ({s}{name}{m}: {KINDS[name].doc}), and the schedule has none",
                          device=d, position=i)


def _check_vocab(schedule: Schedule, giver: Ints, offsets: Sequence[int], rules: _Rules) -> None:
    """With the output layer split by vocabulary (:attr:`Schedule.vocab`), every device runs the vocabulary
    forward and backward of its shard for every microbatch, in the same microbatch order as every other device
    (the runtime shares their statistics and gradients in collectives, which pair up by order); without it, none.
    """
    SM, M, D = schedule.stages * schedule.microbatches, schedule.microbatches, schedule.devices
    codes = [code for code, spec in KINDS.items() if spec.shard]
    trains = bool(np.any(giver[SM:3 * SM] >= 0))  # a forward-only schedule runs the shards' forwards alone
    for code in codes:
        given = giver[rules.names[code] * SM:rules.names[code] * SM + D * M]
        if schedule.vocab and not trains and code == Kind.T and not (given >= 0).any():
            continue
        if not schedule.vocab:
            if (given >= 0).any():
                d, i = _where(offsets, int(given[given >= 0].min()))
                _fail(schedule, f"device {d}, position {i}: {schedule.actions[d][i]} runs a shard of the vocabulary "
                      f"layer, but {schedule.name} does not split it: give the schedule the option vocab=1, or "
                      f"remove its {', '.join(codes)} actions", device=d, position=i)
            continue
        missing = np.flatnonzero(given < 0)
        if len(missing):
            d, m = divmod(int(missing[0]), M)
            _fail(schedule, f"device {d}: microbatch {m} has no {code} of device {d}'s shard of the vocabulary layer "
                  f"({d}{code}{m}: {KINDS[code].doc}); with vocab=1 every device runs one for every microbatch",
                  device=d, position=len(schedule.actions[d]))
        orders = given.reshape(D, M).argsort(axis=1)  # each device's microbatches in the order it runs them
        for d in range(1, D):
            if (orders[d] != orders[0]).any():
                at = int(np.flatnonzero(orders[d] != orders[0])[0])
                m0, m1 = int(orders[0][at]), int(orders[d][at])
                pos = _where(offsets, int(given[d * M + m1]))[1]
                _fail(schedule, f"device {d}, position {pos}: its {code} number {at + 1} is of microbatch {m1}, device "
                      f"0's of microbatch {m0}: every device runs its {code} actions in one microbatch order (their "
                      "collectives pair up by order)", device=d, position=pos)


def _givers_at_once(schedule: Schedule, table: ActionTable, rules: _Rules) -> Ints | None:
    """:func:`_givers` on the arrays, for a schedule whose every pass is of a registered simple kind, in range, on
    its device and given once; None otherwise (then :func:`_givers_in_order` finds the first that is not)."""
    S, M, D = schedule.stages, schedule.microbatches, schedule.devices
    wide0 = len(rules.names) * S * M
    kind, stage, mb, owner = table.pass_kind, table.pass_stage, table.pass_microbatch, table.owner
    if len(kind) and (kind.min() < 0 or rules.composite[kind].any()):
        return None
    per = rules.per_microbatch[kind]
    giver = np.full(wide0 + len(rules.names) * S * D, -1, dtype=np.int64)
    # Per-microbatch passes: in range (as unsigned, a negative number is out of range too), on the device that the
    # placement of their microbatch's replica gives their stage, and each pass of a (stage, microbatch) given once.
    k, s, m, g = (kind, stage, mb, owner) if per.all() else (kind[per], stage[per], mb[per], owner[per])
    if not ((s.view(np.uint64) < S).all() and (m.view(np.uint64) < M).all()):
        return None
    placed = np.array(schedule.placement)
    placed = placed[0][s] if len(placed) == 1 else placed[np.array(schedule.routes)[m], s]
    on_shard = rules.shard[k]
    if on_shard.any():  # a vocabulary pass runs on the device its shard names
        placed = np.where(on_shard, s, placed)
    if (placed != table.device[g]).any():
        return None
    at = s * M + m
    given = 0
    for j in range(rules.gives.shape[1]):
        p = rules.gives[k, j]
        has = p >= 0
        if has.all():
            giver[p * (S * M) + at] = g
        else:
            giver[p[has] * (S * M) + at[has]] = g[has]
        given += int(np.count_nonzero(has))
    if np.count_nonzero(giver[:wide0] >= 0) != given:
        return None
    # Stage-wide passes (all-reduces, optimizer steps, ...): few, one by one.
    holders = [schedule.holders(st) for st in range(S)]
    for g1, k1, s1, m1, d1 in zip(*(x[~per].tolist() for x in (owner, kind, stage, mb, table.device[owner])),
                                  strict=True):
        spec = KINDS[rules.codes[k1]]
        if not (0 <= s1 < S and m1 == NO_MICROBATCH and d1 in holders[s1]) or \
                (spec.collective and len(holders[s1]) < 2):
            return None
        for name in spec.gives:
            at1 = wide0 + (rules.names[name] * S + s1) * D + d1
            if giver[at1] >= 0:
                return None
            giver[at1] = g1
    return giver


def _givers_in_order(schedule: Schedule, offsets: Sequence[int], names: Mapping[str, int]) -> list[int]:
    """:func:`_givers`, action by action in device order: raises :class:`ScheduleError` at the first action of an
    unregistered kind, out of range or in the wrong place, or that gives a pass given before."""
    S, M, D = schedule.stages, schedule.microbatches, schedule.devices
    placement, routes = schedule.placement, schedule.routes
    P = len(names)
    wide0 = P * S * M
    giver = [-1] * (wide0 + P * S * D)
    info = {code: (spec.microbatch, tuple((names[g] * S) * M for g in spec.gives),
                   tuple(wide0 + names[g] * S * D for g in spec.gives), spec.shard) for code, spec in KINDS.items()}
    gid = 0
    for device, row in enumerate(schedule.actions):
        for position, act in enumerate(row):
            for a in (act[3] or (act,)):
                s, kind, m = a[0], a[1], a[2]
                got = info.get(kind)
                if got is None:
                    _fail(schedule, f"device {device}, position {position}: action {act} is of kind {kind}, "
                          f"which is not registered (kinds: {', '.join(KINDS)})", device=device, position=position)
                per_mb, gives, wide, on_shard = got  # type: ignore[misc]
                if per_mb:
                    if not (0 <= s < S and 0 <= m < M and (s == device if on_shard else
                                                           placement[routes[m]][s] == device)):
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
    return giver


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


def _check_complete(schedule: Schedule, giver: Ints, offsets: Sequence[int]) -> None:
    """Every (stage, microbatch) has its forward, its input gradient and its weight gradient; a forward-only
    schedule (no backward anywhere: evaluation, inference) has every forward and nothing else needs one."""
    SM = schedule.stages * schedule.microbatches
    if np.all(giver[:3 * SM] >= 0):
        return
    f, b, w = giver[:SM].tolist(), giver[SM:2 * SM].tolist(), giver[2 * SM:3 * SM].tolist()
    forward_only = all(x < 0 for x in b) and all(x < 0 for x in w)
    M = schedule.microbatches
    for idx in range(SM):
        s, m = divmod(idx, M)
        device = schedule.device_of(s, m)
        end = dict(device=device, position=len(schedule.actions[device]))
        label = f"stage {s} microbatch {m}"
        if f[idx] < 0:
            _fail(schedule, f"device {device}: {label} has no forward ({F(s, m)})", **end)
        if forward_only:
            continue
        if b[idx] < 0 and w[idx] < 0:
            _fail(schedule, f"device {device}: {label} has no backward ({B(s, m)} or {BW(s, m)})", **end)
        if w[idx] < 0:
            _fail(schedule, f"device {device}: {label} has {B(s, m)} but no {W(s, m)}", **end)
        if b[idx] < 0:
            pos = _where(offsets, w[idx])[1]
            _fail(schedule, f"device {device}, position {pos}: {W(s, m)} has no {B(s, m)} before it",
                  device=device, position=pos)


# --------------------------------------------------------------------------- what each action waits for


class Links(NamedTuple):
    """What each of ``size`` actions waits for, by global number: its k-th input in ``slots[k]`` (-1: none, and then
    in no later slot either), or, for an action in ``more`` (a stage-wide one, or one with a stage-wide part), all of
    them there."""

    size: int
    slots: tuple[Ints, ...]
    more: dict[int, tuple[int, ...]]

    def tuples(self, actions: Ints) -> dict[int, tuple[int, ...]]:
        """The inputs of ``actions`` (global numbers), as tuples by action in the order given."""
        out = _as_tuples(self.slots, actions)
        for g, ins in self.more.items():
            if g in out:
                out[g] = ins
        return out

    def spelled(self) -> tuple[tuple[int, ...], ...]:
        """Every action's inputs as a tuple (:attr:`Graph.inputs`)."""
        return tuple(self.tuples(np.arange(self.size)).values())


def _message_ends(links: Links, device: Ints) -> Ints:
    """:meth:`Graph.message_ends` from the links and each action's device."""
    out = np.zeros(links.size, dtype=np.int64)
    for slot in links.slots:
        cross = (slot >= 0) & (device[np.maximum(slot, 0)] != device)
        out += cross
        np.add.at(out, slot[cross], 1)
    return out


def _packed(columns: Sequence[Ints], n: int) -> tuple[Ints, ...]:
    """``columns`` of inputs of ``n`` actions (-1: none) packed to the front: the k-th is each one's k-th input."""
    columns = [column for column in columns if column.max(initial=-1) >= 0]
    if len(columns) < 2:
        return tuple(columns)
    if len(columns) == 2:
        one, two = columns
        both = (one >= 0) & (two >= 0)
        packed = (np.where(one >= 0, one, two), np.where(both, two, -1))
        return packed if both.any() else packed[:1]
    count = np.zeros(n, dtype=np.int64)  # each action's inputs so far
    slots: list[Ints] = []
    for column in columns:
        has = column >= 0
        if (has & (count == len(slots))).any():
            slots.append(np.full(n, -1, dtype=np.int64))
        for k, slot in enumerate(slots):
            np.copyto(slot, column, where=has & (count == k))
        count += has
    return tuple(slots)


def _as_tuples(slots: Sequence[Ints], actions: Ints) -> dict[int, tuple[int, ...]]:
    """The inputs in packed ``slots`` of ``actions`` (global numbers), as tuples by action in the order given."""
    count = np.zeros(len(actions), dtype=np.int64)
    for slot in slots:
        count += slot[actions] >= 0
    out: dict[int, tuple[int, ...]] = dict.fromkeys(actions.tolist(), ())
    for k in range(1, len(slots) + 1):
        got = actions[count == k]
        out.update(zip(got.tolist(), zip(*(slot[got].tolist() for slot in slots[:k]), strict=True), strict=True))
    return out


def _inputs(schedule: Schedule, table: ActionTable, rules: _Rules, giver: Ints) -> Links:
    """What each action waits for besides the one before it on its device, from :data:`KINDS`: per pass, the givers
    of its needs, then the stage-wide passes it comes after; a composite's passes in part order."""
    S, M, D = schedule.stages, schedule.microbatches, schedule.devices
    wide0 = len(rules.names) * S * M
    kind, stage, mb, owner = table.pass_kind, table.pass_stage, table.pass_microbatch, table.owner
    per = rules.per_microbatch[kind]
    n = len(table.kind)
    # Per pass, one column per need and per stage-wide pass waited for: its giver, -1 for none (an offset that
    # leaves the model, a pass nobody gives, a stage-wide kind). Columns nobody has are left out.
    columns = []
    for j in range(rules.need_pass.shape[1]):
        p, t = rules.need_pass[kind, j], stage + rules.need_offset[kind, j]
        ok = per & (p >= 0) & (t.view(np.uint64) < S)
        if ok.any():
            columns.append(np.where(ok, giver[np.where(ok, (p * S + t) * M + mb, 0)], -1))
    columns += _chunk_columns(schedule, rules, giver, kind, stage, mb, per)
    for j in range(rules.after.shape[1]):
        present = [q for q in set(rules.after[:, j].tolist()) - {-1}
                   if (giver[wide0 + q * S * D:wide0 + (q + 1) * S * D] >= 0).any()]
        if present:
            p = rules.after[kind, j]
            ok = per & _of_kinds(p, [q in present for q in range(len(rules.names))])
            columns.append(np.where(ok, giver[np.where(ok, wide0 + (p * S + stage) * D + table.device[owner], 0)],
                                    -1))
    # Per action: its passes' columns one after the other.
    sizes = np.bincount(owner, minlength=n)
    first_pass = np.cumsum(sizes) - sizes
    candidates = columns
    if len(table.composite):
        part = np.arange(len(owner)) - first_pass[owner]
        candidates = []
        for j in range(int(sizes.max())):
            of = part == j
            for column in columns:
                joined = np.full(n, -1, dtype=np.int64)
                joined[owner[of]] = column[of]
                candidates.append(joined)
    more: dict[int, tuple[int, ...]] = {}
    # Stage-wide passes: every microbatch's pass that they gather (of their replica), then the stage-wide passes
    # of their stage and device that they come after. Few: worked out one by one, with their actions' other passes.
    wide = np.flatnonzero(~per)
    if len(wide):
        by_replica: dict[int, list[int]] = {}
        for m, r in enumerate(schedule.routes):
            by_replica.setdefault(r, []).append(m)
        actions = np.unique(owner[wide])
        passes = np.concatenate([np.arange(a, a + b) for a, b in zip(first_pass[actions].tolist(),
                                                                     sizes[actions].tolist(), strict=True)])
        ins_of = zip(*(column[passes].tolist() for column in columns), strict=True) if columns else itertools.repeat(())
        at = iter(zip(per[passes].tolist(), stage[passes].tolist(), kind[passes].tolist(), ins_of, strict=False))
        for g, d, n_passes in zip(actions.tolist(), table.device[actions].tolist(), sizes[actions].tolist(),
                                  strict=True):
            got: list[int] = []
            for per_e, s, k, ins in itertools.islice(at, n_passes):
                if per_e:
                    got += [x for x in ins if x >= 0]
                    continue
                spec = KINDS[rules.codes[k]]
                mbs = np.array(by_replica.get(schedule.replica_on(s, d), []), dtype=np.int64)
                for name in spec.gathers:
                    got += [x for x in giver[rules.names[name] * S * M + s * M + mbs].tolist() if x >= 0]
                for name in spec.after:
                    if (x := int(giver[wide0 + (rules.names[name] * S + s) * D + d])) >= 0:
                        got.append(x)
            more[g] = tuple(got)
    links = Links(n, _packed(candidates, n), more)
    return _vocab_inputs(schedule, table, rules, giver, links) if schedule.vocab else links


def _vocab_inputs(schedule: Schedule, table: ActionTable, rules: _Rules, giver: Ints, links: Links) -> Links:
    """``links`` with what the vocabulary passes wait for and what waits for them (:attr:`Schedule.vocab`): device
    d's ``S`` of microbatch m for the last stage's forward of m (its output, sent to every device); its ``T`` for
    every device's ``S`` of m (the per-token statistics the shards share); the last stage's input gradient of m
    (B or BW) for every device's ``T`` of m (the gradient of its output, summed over the shards). Each such action
    lists all its inputs in ``more``."""
    S, M, D = schedule.stages, schedule.microbatches, schedule.devices
    SM, last = S * M, S - 1
    names = rules.names
    kind, stage, mb, owner = table.pass_kind, table.pass_stage, table.pass_microbatch, table.owner
    number = {code: k for k, code in enumerate(rules.codes)}
    extra: dict[int, list[int]] = {}
    shards = np.arange(D) * M
    for code, what, on_last in ((Kind.S, None, False), (Kind.T, Kind.S, False), (Kind.B, Kind.T, True),
                                (Kind.BW, Kind.T, True)):
        picked = kind == number[code]
        if on_last:
            picked &= stage == last
        for q in np.flatnonzero(picked).tolist():
            m = int(mb[q])
            if what is None:
                ins = [int(giver[names[Kind.F] * SM + last * M + m])]
            else:
                ins = giver[names[what] * SM + shards + m].tolist()
            extra.setdefault(int(owner[q]), []).extend(ins)
    if not extra:
        return links
    base = links.tuples(np.array(sorted(extra), dtype=np.int64))
    more = dict(links.more)
    for g, ins in extra.items():
        more[g] = tuple(dict.fromkeys([*base[g], *ins]))
    return Links(links.size, links.slots, more)


def _chunk_columns(schedule: Schedule, rules: _Rules, giver: Ints, kind: Ints, stage: Ints, mb: Ints,
                   per: npt.NDArray[np.bool_]) -> list[Ints]:
    """With sequence chunks (:attr:`Schedule.seq_chunks`), what a pass waits for on its own stage: a forward the
    forward of the chunk before it (whose keys and values its attention reads), an input gradient the input
    gradient of the chunk after it (which gives the gradients of this chunk's keys and values)."""
    c, S, M = schedule.seq_chunks, schedule.stages, schedule.microbatches
    if c == 1:
        return []
    chunk = np.where(per, mb, 0) % c
    columns = []
    for name, step, first in ((Kind.F, -1, 0), (Kind.B, 1, c - 1)):
        p = rules.names[name]
        ok = per & (rules.gives[kind] == p).any(axis=1) & (chunk != first)
        if ok.any():
            columns.append(np.where(ok, giver[np.where(ok, (p * S + stage) * M + mb + step, 0)], -1))
    return columns


# --------------------------------------------------------------------------- the traversal


def _traverse(schedule: Schedule, offsets: tuple[int, ...], table: ActionTable, links: Links,
              durations: Sequence[float] | npt.NDArray[np.float64] | None,
              transfer: float | Sequence[Sequence[float]], idle: frozenset[str]) -> Graph:
    """A runnable order: each device runs on until an action waits for one not yet run, and is woken then.

    The members of a collective start together, once every member is at the head of its device.
    """
    D, N = schedule.devices, len(table.kind)
    device = table.device
    # Stage-wide actions without parts: the collectives' members (by kind and stage) and the communication that
    # leaves its device free.
    alone = table.microbatch < 0
    alone[table.composite] = False
    members: dict[tuple[int, int], list[int]] = {}
    for g in np.flatnonzero(alone & _of_kinds(table.kind, [KINDS[code].collective for code in table.kinds])).tolist():
        members.setdefault((int(table.kind[g]), int(table.stage[g])), []).append(g)
    peers = {m: tuple(together) for together in members.values() for m in together}
    plain = np.ones(N, dtype=bool)
    plain[table.composite] = False
    quiet = set(np.flatnonzero(plain & _of_kinds(table.kind, [code in idle for code in table.kinds])).tolist())
    # Communication on a lane (a host link's copies): one at a time per device and kind, in the device's order.
    lanes = _lanes(table, quiet)
    lane_free = dict.fromkeys(lanes.values(), 0.0)
    # The inputs the loop looks at: not those that ran earlier on the same device and keep it busy until they end
    # (all but communication), as the device is free only after they end: they can neither hold it up nor start it
    # later. (Unless a duration is below 0: then a device's free time can go back, and the loop looks at all.)
    durations = np.zeros(N) if durations is None else np.asarray(durations, dtype=np.float64)
    slots, more = links.slots, links.more
    if not N or durations.min() >= 0:
        busy = np.ones(N, dtype=bool)
        busy[list(quiet)] = False
        gid = np.arange(N)

        def needless(inputs: Ints, of: Ints = gid) -> npt.NDArray[np.bool_]:  # (an input -1 is masked out after)
            drop = (device[inputs] == device[of]) & (inputs < of)
            return drop & busy[inputs] if quiet else drop

        slots = _packed([np.where(needless(slot), -1, slot) for slot in slots], N)
        if more:
            which = np.repeat(np.arange(len(more)), [len(ins) for ins in more.values()])
            every = np.fromiter(itertools.chain.from_iterable(more.values()), np.int64, len(which))
            keep = ~needless(every, np.fromiter(more, np.int64, len(more))[which])
            kept, counts = every[keep].tolist(), np.bincount(which[keep], minlength=len(more)).tolist()
            more = {g: tuple(kept[end - n:end]) for g, n, end in zip(more, counts, itertools.accumulate(counts),
                                                                      strict=True)}
    first = slots[0] if slots else np.full(N, -1, dtype=np.int64)
    # The actions the loop hands to its general path, with the inputs it looks at: the collectives' members, the
    # communication, the stage-wide actions and those with three inputs or more.
    special = slots[2] >= 0 if len(slots) > 2 else np.zeros(N, dtype=bool)
    special[list(itertools.chain(peers, quiet))] = True
    special[list(more)] = False
    general = _as_tuples(slots, np.flatnonzero(special))
    general.update(more)
    # Those with two (an overlapped pair: its forward's activation and its backward's gradient).
    pair = np.zeros(N, dtype=bool)
    if len(slots) > 1:
        pair[slots[1] >= 0] = True
        pair[list(general)] = False
    # What the loop reads of each action, in flat arrays of machine numbers (not the hundreds of thousands of Python
    # objects a list would hold): the input it looks at, as an index into ``ends`` (N: none, which ended at -inf;
    # N + 1: go to the general path, N + 2: to the two inputs below, neither ever ended), and its duration. With a
    # transfer time, ``ends`` also holds, from ``arrive`` on, when each output reaches another device, which is where
    # an input from another device is looked up.
    send = _send_times(transfer, slots, more, device, N)
    arrive = N + 3 if any(send) else 0
    remote = (device[first] != device) * arrive  # (where there is a first input)
    look = np.where(first >= 0, first + remote, N)
    look[pair] = N + 2
    look[list(general)] = N + 1
    look_at = array.array("q", look.tobytes())
    pair_in = (array.array("q"), array.array("q"))
    if pair.any():  # the first and the second input of the actions with two
        second = slots[1]
        pair_in = (array.array("q", (first + remote).tobytes()),
                   array.array("q", (second + (device[second] != device) * arrive).tobytes()))
    dur = array.array("d", durations.tobytes())
    dev_of: list[int] = device.tolist() if general else []
    ends: list[float | None] = [None] * (N + 3 + (N if arrive else 0))  # None: not run yet
    ends[N] = -math.inf
    starts = [0.0] * N
    waiter = [-1] * N  # the device that waits for each action (-1: none) ...
    later: dict[int, list[int]] = {}  # ... and any more, in the order they came
    free = [0.0] * D
    heads = list(offsets)  # each device's next action, by global number
    stops = [*offsets[1:], N]
    runs: list[int] = []  # the order, as [first, end) ranges
    queue = list(range(D))  # devices to run, first come first served: the loop below reads it as it grows
    wake = queue.append
    note = runs.append
    to_general, two_inputs = N + 1, N + 2
    for device_ in queue:
        g = g0 = heads[device_]
        stop = stops[device_]
        ready = free[device_]  # when the device is free
        while g < stop:
            i = look_at[g]
            e = ends[i]
            if e is None:
                if i == two_inputs:  # the later arrival counts
                    i = pair_in[0][g]
                    e = ends[i]
                    if e is not None:
                        j = pair_in[1][g]
                        e2 = ends[j]
                        if e2 is None:
                            i, e = j, None
                        elif e2 > e:
                            e = e2
                if e is None:
                    if i == to_general:  # more inputs, a collective, communication
                        start = ready
                        blocker = -1
                        for x in general[g]:
                            e = ends[x]
                            if e is None:
                                blocker = x
                                break
                            if dev_of[x] != device_:
                                e += send[x]
                            if e > start:
                                start = e
                        if blocker >= 0:
                            i = blocker
                        elif g in peers:
                            group = peers[g]
                            if any(m != g and heads[dev_of[m]] != m for m in group):
                                break  # the last member to arrive runs them all
                            for m in group:
                                md = dev_of[m]
                                # (an input not run yet counts as ending at 0, as the group goes ahead without it)
                                t = max([free[md]] + [(ends[x] or 0.0) + (send[x] if dev_of[x] != md else 0.0)
                                                      for x in general[m]])
                                start = max(start, t)
                            if g > g0:
                                note(g0)
                                note(g)
                            for m in group:
                                md = dev_of[m]
                                starts[m] = start
                                ends[m] = end = start + dur[m]
                                if arrive:
                                    ends[m + arrive] = end + send[m]
                                note(m)
                                note(m + 1)
                                free[md] = start if m in quiet else end
                                if md != device_:
                                    heads[md] += 1
                                    queue.append(md)
                                w = waiter[m]
                                if w >= 0:
                                    wake(w)
                                    queue.extend(later.pop(m, ()))
                            ready = free[device_]
                            g += 1
                            g0 = g
                            continue
                        else:
                            lane = lanes.get(g)
                            if lane is not None:
                                start = max(start, lane_free[lane])
                            starts[g] = start
                            ends[g] = end = start + dur[g]
                            if lane is not None:
                                lane_free[lane] = end
                            if arrive:
                                ends[g + arrive] = end + send[g]
                            if lane is None:  # a copy on a lane is issued and left: the device goes on as it was
                                ready = start if g in quiet else end
                            w = waiter[g]
                            if w >= 0:
                                wake(w)
                                queue.extend(later.pop(g, ()))
                            g += 1
                            continue
                    if i > N:  # an arrival: wait for the action it is of
                        i -= arrive
                    if waiter[i] < 0:
                        waiter[i] = device_
                    else:
                        later.setdefault(i, []).append(device_)
                    break
            if e > ready:
                ready = e
            starts[g] = ready
            ends[g] = ready = ready + dur[g]
            if arrive:
                ends[g + arrive] = ready + send[g]
            w = waiter[g]
            if w >= 0:
                wake(w)
                if later:
                    queue.extend(later.pop(g, ()))
            g += 1
        if g > g0:
            note(g0)
            note(g)
        free[device_] = ready
        heads[device_] = g
    if heads != stops:
        _report_stuck(schedule, offsets, [h - o for h, o in zip(heads, offsets, strict=True)], links.spelled(),
                      peers)
    return Graph(schedule, offsets, peers, starts, ends[:N], table, links, runs)  # type: ignore[arg-type]


def _send_times(transfer: float | Sequence[Sequence[float]], slots: Sequence[Ints], more: Mapping[int, tuple[int, ...]],
                device: Ints, n: int) -> list[float]:
    """Per action, how long its output takes to reach another device: ``transfer`` itself, or with a time per pair
    of devices, the slowest crossing to a device that takes the output (0 where none does)."""
    if isinstance(transfer, (int, float)):
        return [float(transfer)] * n
    matrix = np.asarray(transfer, dtype=np.float64)
    send = np.zeros(n)
    for slot in slots:
        taker = np.flatnonzero(slot >= 0)
        giver = slot[taker]
        crossing = device[giver] != device[taker]
        np.maximum.at(send, giver[crossing], matrix[device[giver[crossing]], device[taker[crossing]]])
    for g, inputs in more.items():
        for x in inputs:
            if device[x] != device[g]:
                send[x] = max(send[x], matrix[device[x], device[g]])
    return send.tolist()


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
    if KINDS[a.kind].shard:
        _fail(schedule, f"device {device}, position {position}: action {a} runs device {a.stage}'s shard of the "
              f"vocabulary layer, on device {a.stage}: device {device} runs {device}{a.kind}{a.microbatch}", **where)
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


def _lanes(table: ActionTable, quiet: set[int]) -> dict[int, tuple[int, int]]:
    """The communication actions among ``quiet`` whose kind queues on a lane (``KindSpec.lane``), with their lane:
    (device, kind number)."""
    on_lane = [KINDS[code].lane for code in table.kinds]
    if not any(on_lane):
        return {}
    return {g: (int(table.device[g]), int(table.kind[g])) for g in sorted(quiet) if on_lane[table.kind[g]]}


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
