"""The schedule IR: actions, placements, per-device action lists, their text/JSON/CSV forms, validation.

An action is one pass of one microbatch through one stage::

    0F3    forward of stage 0, microbatch 3
    2B3    backward of stage 2 for its input only (the input gradient)
    2W3    backward of stage 2 for its weights only
    1BW0   fused full backward (B and W at once)

A schedule lists, for each device, the actions it runs in order. Stages form a
chain 0 -> 1 -> ... -> S-1 for every microbatch; the placement says which device
holds which stage.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from pipefold.errors import ScheduleError

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "describe_placement",
    "check_structure",
    "execution_order",
    "linear_placement",
    "looped_placement",
    "parse_placement",
    "render_grid",
    "v_placement",
    "validate",
]


class Kind(str, Enum):
    """The kind of pass an action runs."""

    F = "F"  # forward
    B = "B"  # backward for the stage input only
    W = "W"  # backward for the weights only
    BW = "BW"  # fused backward: B and W together

    def __str__(self) -> str:
        return self.value


_ACTION_RE = re.compile(r"^(\d+)(BW|F|B|W)(\d+)$")


class Action(NamedTuple):
    """One pass (``kind``) of ``microbatch`` through ``stage``.

    A named tuple: immutable, hashable, ordered, and cheap to make by the
    hundred thousand, which schedule generation does.
    """

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact form, e.g. ``"2BW5"``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot read action {text!r}: expected <stage><F|B|W|BW><microbatch>, e.g. 0F3 or 1BW0"
            )
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


def F(stage: int, microbatch: int) -> Action:
    """Forward of ``stage`` for ``microbatch``."""
    return Action(stage, Kind.F, microbatch)


def B(stage: int, microbatch: int) -> Action:
    """Input-gradient backward of ``stage`` for ``microbatch``."""
    return Action(stage, Kind.B, microbatch)


def W(stage: int, microbatch: int) -> Action:
    """Weight-gradient backward of ``stage`` for ``microbatch``."""
    return Action(stage, Kind.W, microbatch)


def BW(stage: int, microbatch: int) -> Action:
    """Fused backward of ``stage`` for ``microbatch``."""
    return Action(stage, Kind.BW, microbatch)


# --------------------------------------------------------------------------- placements


def linear_placement(devices: int) -> tuple[int, ...]:
    """Stage d on device d."""
    return tuple(range(devices))


def looped_placement(devices: int, v: int) -> tuple[int, ...]:
    """Stage s on device s mod p: each device holds v stages, p apart (Megatron's interleaving)."""
    return tuple(s % devices for s in range(devices * v))


def v_placement(devices: int) -> tuple[int, ...]:
    """Device d holds stages d and 2p-1-d: down the devices and back up."""
    return tuple(range(devices)) + tuple(reversed(range(devices)))


def describe_placement(stage_to_device: Sequence[int], devices: int) -> str:
    """Name a placement: ``linear``, ``looped``, ``v`` or the explicit list of devices."""
    mapping = tuple(stage_to_device)
    stages = len(mapping)
    if mapping == linear_placement(devices):
        return "linear"
    if stages > devices and stages % devices == 0 and mapping == looped_placement(devices, stages // devices):
        return "looped"
    if stages == 2 * devices and mapping == v_placement(devices):
        return "v"
    return " ".join(str(d) for d in mapping)


def parse_placement(text: str, devices: int, stages: int) -> tuple[int, ...]:
    """Inverse of :func:`describe_placement`."""
    text = text.strip()
    if text == "linear":
        return linear_placement(devices)
    if text == "looped":
        if stages % devices:
            raise ValueError(f"looped placement needs stages to be a multiple of devices ({stages} % {devices} != 0)")
        return looped_placement(devices, stages // devices)
    if text == "v":
        return v_placement(devices)
    try:
        return tuple(int(tok) for tok in text.replace(",", " ").split())
    except ValueError:
        raise ValueError(
            f"cannot read placement {text!r}: use linear, looped, v, or one device number per stage"
        ) from None


# --------------------------------------------------------------------------- schedule


@dataclass(frozen=True, eq=True)
class Schedule:
    """Per-device ordered action lists plus the shape of the pipeline they run on."""

    name: str
    devices: int
    stages: int
    microbatches: int
    stage_to_device: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_to_device", tuple(self.stage_to_device))
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        object.__setattr__(self, "options", dict(self.options))
        for label, value in (("devices", self.devices), ("stages", self.stages),
                             ("microbatches", self.microbatches)):
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{label} must be a positive integer (got {value!r})")
        if len(self.stage_to_device) != self.stages:
            raise ScheduleError(
                f"placement lists {len(self.stage_to_device)} devices but the schedule has {self.stages} stages"
            )
        for stage, device in enumerate(self.stage_to_device):
            if not 0 <= device < self.devices:
                raise ScheduleError(f"placement puts stage {stage} on device {device}, "
                                    f"but devices are 0..{self.devices - 1}")
        if len(self.actions) != self.devices:
            raise ScheduleError(f"schedule has {self.devices} devices but {len(self.actions)} action lists")

    # -- derived views

    @property
    def placement(self) -> str:
        """Human name of the placement (see :func:`describe_placement`)."""
        return describe_placement(self.stage_to_device, self.devices)

    def stages_of(self, device: int) -> list[int]:
        """Stages held by ``device``, in increasing order."""
        return [s for s, d in enumerate(self.stage_to_device) if d == device]

    def chunk_of(self, stage: int) -> int:
        """Index of ``stage`` among the stages of its device (0 for the first)."""
        return self.stages_of(self.stage_to_device[stage]).index(stage)

    @property
    def num_actions(self) -> int:
        return sum(len(row) for row in self.actions)

    def with_actions(self, actions: Iterable[Iterable[Action]]) -> Schedule:
        """A copy with other action lists (same shape, name and options)."""
        return Schedule(self.name, self.devices, self.stages, self.microbatches,
                        self.stage_to_device, tuple(tuple(r) for r in actions), self.options)

    # -- text form

    def to_text(self) -> str:
        """Compact, line-based text form; :meth:`from_text` reads it back exactly."""
        lines = [
            "# pipefold schedule",
            f"name: {self.name}",
            f"options: {json.dumps(dict(self.options), sort_keys=True)}",
            f"devices: {self.devices}",
            f"stages: {self.stages}",
            f"microbatches: {self.microbatches}",
            f"placement: {self.placement}",
        ]
        for device, row in enumerate(self.actions):
            lines.append(f"device {device}: " + " ".join(str(a) for a in row))
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Parse :meth:`to_text` output. Errors name the offending line."""
        header: dict[str, tuple[int, str]] = {}
        rows: dict[int, tuple[int, str]] = {}
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition(":")
            if not sep:
                raise ScheduleError(f"line {lineno}: expected 'key: value' or 'device N: actions', got {raw!r}")
            key = key.strip()
            if key.startswith("device "):
                try:
                    device = int(key.split()[1])
                except (IndexError, ValueError):
                    raise ScheduleError(f"line {lineno}: cannot read device number in {key!r}") from None
                if device in rows:
                    raise ScheduleError(f"line {lineno}: device {device} is listed twice")
                rows[device] = (lineno, value)
            elif key in ("name", "options", "devices", "stages", "microbatches", "placement"):
                header[key] = (lineno, value.strip())
            else:
                raise ScheduleError(f"line {lineno}: unknown key {key!r}")
        for key in ("devices", "stages", "microbatches"):
            if key not in header:
                raise ScheduleError(f"schedule text has no '{key}:' line")
        counts = {}
        for key in ("devices", "stages", "microbatches"):
            lineno, value = header[key]
            try:
                counts[key] = int(value)
            except ValueError:
                raise ScheduleError(f"line {lineno}: {key} must be an integer, got {value!r}") from None
        devices, stages = counts["devices"], counts["stages"]
        lineno, placement_text = header.get("placement", (0, "linear"))
        try:
            placement = parse_placement(placement_text, devices, stages)
        except ValueError as exc:
            raise ScheduleError(f"line {lineno}: {exc}") from None
        options: dict[str, Any] = {}
        if "options" in header:
            lineno, value = header["options"]
            try:
                options = json.loads(value)
            except json.JSONDecodeError:
                raise ScheduleError(f"line {lineno}: options must be a JSON object, got {value!r}") from None
            if not isinstance(options, dict):
                raise ScheduleError(f"line {lineno}: options must be a JSON object, got {value!r}")
        if set(rows) - set(range(devices)):
            bad = min(set(rows) - set(range(devices)))
            raise ScheduleError(f"line {rows[bad][0]}: device {bad} is out of range 0..{devices - 1}")
        actions = []
        for device in range(devices):
            lineno, value = rows.get(device, (0, ""))
            actions.append(_parse_actions(value.split(), f"line {lineno}"))
        name = header.get("name", (0, "custom"))[1]
        return cls(name, devices, stages, counts["microbatches"], placement, tuple(actions), options)

    # -- JSON form

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_json` reads it back exactly."""
        return {
            "format": "pipefold-schedule",
            "version": 1,
            "name": self.name,
            "options": dict(self.options),
            "devices": self.devices,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "placement": list(self.stage_to_device),
            "actions": [[str(a) for a in row] for row in self.actions],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> Schedule:
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise ScheduleError(f"line {exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, Mapping):
            raise ScheduleError("schedule JSON must be an object")
        missing = [k for k in ("devices", "stages", "microbatches", "placement", "actions") if k not in data]
        if missing:
            raise ScheduleError(f"schedule JSON lacks the key(s) {', '.join(missing)}")
        rows = data["actions"]
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            raise ScheduleError("schedule JSON 'actions' must be a list of lists of strings, one per device")
        actions = tuple(_parse_actions(row, f"device {d}") for d, row in enumerate(rows))
        placement = data["placement"]
        if isinstance(placement, str):
            try:
                placement = parse_placement(placement, int(data["devices"]), int(data["stages"]))
            except ValueError as exc:
                raise ScheduleError(str(exc)) from None
        return cls(str(data.get("name", "custom")), data["devices"], data["stages"], data["microbatches"],
                   tuple(placement), actions, data.get("options", {}))

    # -- CSV form (one row per device, one action per cell, as torch.distributed.pipelining)

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for row in self.actions:
            writer.writerow([str(a) for a in row])
        return buf.getvalue()

    @classmethod
    def from_csv(cls, text: str, *, name: str = "custom", options: Mapping[str, Any] | None = None,
                 stage_to_device: Sequence[int] | None = None) -> Schedule:
        """Read one row of actions per device.

        The CSV holds only actions: stages and microbatches are counted from them
        and, unless ``stage_to_device`` is given, each stage is placed on the
        device whose row runs it.
        """
        rows = [
            _parse_actions([cell for cell in row if cell.strip()], f"line {lineno}")
            for lineno, row in enumerate(csv.reader(io.StringIO(text)), start=1)
        ]
        while rows and not rows[-1]:
            rows.pop()  # trailing blank lines
        if not rows:
            raise ScheduleError("CSV schedule is empty: expected one row of actions per device")
        stages = 1 + max((a.stage for row in rows for a in row), default=0)
        microbatches = 1 + max((a.microbatch for row in rows for a in row), default=0)
        if stage_to_device is None:
            placement: dict[int, int] = {}
            for device, row in enumerate(rows):
                for position, action in enumerate(row):
                    if placement.setdefault(action.stage, device) != device:
                        raise ScheduleError(
                            f"line {device + 1}: action {action} at position {position} is for stage "
                            f"{action.stage}, which line {placement[action.stage] + 1} also runs"
                        )
            absent = [s for s in range(stages) if s not in placement]
            if absent:
                raise ScheduleError(f"CSV schedule never runs stage {absent[0]}: cannot tell its device")
            stage_to_device = [placement[s] for s in range(stages)]
        return cls(name, len(rows), stages, microbatches, tuple(stage_to_device), tuple(rows), options or {})

    # -- files

    def save(self, path: str) -> None:
        """Write the schedule, in the format named by the file's suffix (.json, .csv, else text)."""
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(self.dumps(_format_of(path)))

    def dumps(self, fmt: str = "text") -> str:
        if fmt == "json":
            return json.dumps(self.to_json(), indent=1) + "\n"
        if fmt == "csv":
            return self.to_csv()
        if fmt == "text":
            return self.to_text()
        raise ValueError(f"unknown schedule format {fmt!r}: use text, json or csv")

    @classmethod
    def load(cls, path: str) -> Schedule:
        """Read a schedule file written by :meth:`save` (or by hand)."""
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        fmt = _format_of(path)
        try:
            if fmt == "json":
                return cls.from_json(text)
            if fmt == "csv":
                return cls.from_csv(text)
            return cls.from_text(text)
        except ScheduleError as exc:
            raise ScheduleError(f"{path}: {exc.message}", exc.report) from None


def _format_of(path: str) -> str:
    lower = path.lower()
    if lower.endswith(".json"):
        return "json"
    if lower.endswith(".csv"):
        return "csv"
    return "text"


def _parse_actions(tokens: Iterable[Any], where: str) -> tuple[Action, ...]:
    out = []
    for token in tokens:
        try:
            out.append(Action.parse(str(token)))
        except ValueError as exc:
            raise ScheduleError(f"{where}: {exc}") from None
    return tuple(out)


# --------------------------------------------------------------------------- validation
#
# Dependencies of one microbatch through the stage chain (S stages):
#
#     F(0) -> F(1) -> ... -> F(S-1) -> B(S-1) -> B(S-2) -> ... -> B(0)
#                                        |          |               |
#                                        W          W               W
#
# (BW stands for B and W together.) A device runs its list strictly in order,
# so a schedule can run iff a topological traversal that always takes each
# device's next action, when that action's inputs are done, reaches the end of
# every list.


def _backward_of(schedule: Schedule) -> dict[tuple[int, int], Kind]:
    """Which backward kind (B or BW) each (stage, microbatch) uses, for dependency lookup."""
    out: dict[tuple[int, int], Kind] = {}
    for row in schedule.actions:
        for a in row:
            if a.kind in (Kind.B, Kind.BW):
                out[(a.stage, a.microbatch)] = a.kind
    return out


def _dependencies(action: Action, stages: int, backward: Mapping[tuple[int, int], Kind]) -> list[Action]:
    """Actions that must finish before ``action`` may start."""
    s, m = action.stage, action.microbatch
    if action.kind is Kind.F:
        return [Action(s - 1, Kind.F, m)] if s > 0 else []
    if action.kind is Kind.W:
        return [Action(s, Kind.B, m)]
    # B or BW: needs its own forward, and the gradient from the next stage.
    deps = [Action(s, Kind.F, m)]
    if s + 1 < stages:
        deps.append(Action(s + 1, backward.get((s + 1, m), Kind.B), m))
    return deps


def _position_of(schedule: Schedule, action: Action) -> tuple[int, int]:
    """(device, position) of ``action``; only used to word error messages."""
    for device, row in enumerate(schedule.actions):
        for position, a in enumerate(row):
            if a == action:
                return device, position
    raise LookupError(action)


def check_structure(schedule: Schedule) -> None:
    """Ranges, placement and counts: each (stage, microbatch) has one F and one backward."""
    S, M = schedule.stages, schedule.microbatches
    seen = {kind: bytearray(S * M) for kind in Kind}  # indexed by stage * M + microbatch
    for device, row in enumerate(schedule.actions):
        for position, a in enumerate(row):
            s, m = a.stage, a.microbatch
            if not (0 <= s < S and 0 <= m < M and schedule.stage_to_device[s] == device):
                _check_action_place(schedule, device, position, a)
            flags = seen[a.kind]
            if flags[s * M + m]:
                p0 = _position_of(schedule, a)[1]
                _fail(schedule, f"device {device}, position {position}: {a} appears twice "
                      f"(first at position {p0})", device=device, position=position)
            flags[s * M + m] = 1
    f, b, w, bw = seen[Kind.F], seen[Kind.B], seen[Kind.W], seen[Kind.BW]
    # Complete iff F everywhere and, per (stage, microbatch), either BW alone or B and W together.
    if f.find(0) == -1 and all(x ^ y for x, y in zip(bw, b, strict=True)) and b == w:
        return
    for idx in range(S * M):
        s, m = divmod(idx, M)
        device = schedule.stage_to_device[s]
        end = dict(device=device, position=len(schedule.actions[device]))
        label = f"stage {s} microbatch {m}"
        if not f[idx]:
            _fail(schedule, f"device {device}: {label} has no forward ({F(s, m)})", **end)
        if bw[idx] and (b[idx] or w[idx]):
            extra = B(s, m) if b[idx] else W(s, m)
            pos = _position_of(schedule, extra)[1]
            _fail(schedule, f"device {device}, position {pos}: {label} has both a fused "
                  f"backward {BW(s, m)} and {extra}", device=device, position=pos)
        if not (bw[idx] or b[idx]):
            _fail(schedule, f"device {device}: {label} has no backward ({B(s, m)} or {BW(s, m)})", **end)
        if b[idx] and not w[idx]:
            _fail(schedule, f"device {device}: {label} has {B(s, m)} but no {W(s, m)}", **end)
        if w[idx] and not b[idx]:
            pos = _position_of(schedule, W(s, m))[1]
            _fail(schedule, f"device {device}, position {pos}: {W(s, m)} has no {B(s, m)} before it",
                  device=device, position=pos)


def _check_action_place(schedule: Schedule, device: int, position: int, a: Action) -> None:
    where = dict(device=device, position=position)
    S, M = schedule.stages, schedule.microbatches
    if not 0 <= a.stage < S:
        _fail(schedule, f"device {device}, position {position}: action {a} names stage {a.stage}, "
              f"but stages are 0..{S - 1}", **where)
    if not 0 <= a.microbatch < M:
        _fail(schedule, f"device {device}, position {position}: action {a} names microbatch "
              f"{a.microbatch}, but microbatches are 0..{M - 1}", **where)
    home = schedule.stage_to_device[a.stage]
    _fail(schedule, f"device {device}, position {position}: action {a} runs stage {a.stage}, "
          f"which the placement puts on device {home}", **where)


def execution_order(schedule: Schedule) -> list[tuple[int, int]]:
    """Validate ``schedule`` and return its actions as (device, position) in a runnable order.

    The order respects every dependency and each device's own order, so a
    simulator can compute times by visiting actions in it. Raises
    :class:`ScheduleError` for the first violation found.
    """
    check_structure(schedule)
    S, M = schedule.stages, schedule.microbatches
    SM = S * M
    rows = schedule.actions
    # Done flags indexed by stage * M + microbatch: forwards, and backwards (B or BW) that send a
    # gradient upstream. Waiting devices are keyed by the pass they wait for: idx, or SM + idx.
    f_done, b_done = bytearray(SM), bytearray(SM)
    heads = [0] * schedule.devices
    waiting: dict[int, list[int]] = {}
    order: list[tuple[int, int]] = []
    queue = deque(range(schedule.devices))
    F_, W_ = Kind.F, Kind.W
    while queue:
        device = queue.popleft()
        row, pos, n = rows[device], heads[device], len(rows[device])
        while pos < n:
            stage, kind, mb = row[pos]
            idx = stage * M + mb
            if kind is F_:
                blocker = idx - M if stage > 0 and not f_done[idx - M] else -1
            elif kind is W_:
                blocker = -1 if b_done[idx] else SM + idx
            elif not f_done[idx]:
                blocker = idx
            else:
                blocker = SM + idx + M if stage + 1 < S and not b_done[idx + M] else -1
            if blocker >= 0:
                waiting.setdefault(blocker, []).append(device)
                break
            order.append((device, pos))
            pos += 1
            if kind is F_:
                f_done[idx] = 1
                key = idx
            elif kind is W_:
                continue
            else:
                b_done[idx] = 1
                key = SM + idx
            woken = waiting.pop(key, None)
            if woken:
                queue.extend(woken)
        heads[device] = pos
    if len(order) != schedule.num_actions:
        _report_stuck(schedule, heads, _backward_of(schedule), _finished(schedule, heads))
    return order


def _finished(schedule: Schedule, heads: list[int]) -> set[Action]:
    return {a for d, row in enumerate(schedule.actions) for a in row[:heads[d]]}


def _report_stuck(schedule: Schedule, heads: list[int], backward: Mapping[tuple[int, int], Kind],
                  done: set[Action]) -> None:
    """Explain why the traversal stopped: a local order violation, or a cross-device deadlock."""
    position_of = {a: (d, p) for d, row in enumerate(schedule.actions) for p, a in enumerate(row)}
    blocked: dict[int, Action] = {}
    for device, row in enumerate(schedule.actions):
        if heads[device] < len(row):
            action = row[heads[device]]
            blocked[device] = next(d for d in _dependencies(action, schedule.stages, backward) if d not in done)
    # A dependency that sits later on the same device is an ordering mistake of that device alone.
    for device, dep in blocked.items():
        pos = heads[device]
        action = schedule.actions[device][pos]
        dep_device, dep_pos = position_of[dep]
        if dep_device == device:
            _fail(schedule, f"device {device}, position {pos}: {action} comes before {dep} "
                  f"(position {dep_pos}), which it depends on", device=device, position=pos)
    # Otherwise follow who-waits-for-whom until a device repeats: that is the cycle.
    device = min(blocked)
    chain: list[int] = []
    while device not in chain:
        chain.append(device)
        device = position_of[blocked[device]][0]
    cycle = chain[chain.index(device):]
    parts = [
        f"device {d} at position {heads[d]} ({schedule.actions[d][heads[d]]}) waits for {blocked[d]} "
        f"on device {position_of[blocked[d]][0]} (position {position_of[blocked[d]][1]})"
        for d in cycle
    ]
    first = cycle[0]
    _fail(schedule, "deadlock: " + "; ".join(parts), device=first, position=heads[first])


def validate(schedule: Schedule) -> Schedule:
    """Check ``schedule``; return it unchanged or raise :class:`ScheduleError` for the first violation.

    Checked: ranges and placement; each (stage, microbatch) has exactly one F
    and exactly one backward (B then W, or BW); W after its B; F of stage s+1
    after F of stage s; B of stage s after the backward of stage s+1 (after F
    on the last stage); and all per-device orders run together without deadlock.
    """
    execution_order(schedule)
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
