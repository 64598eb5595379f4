"""A schedule: per-device ordered action lists plus the shape of the pipeline they run on (stages, microbatches,
the placement of stages on devices, replicas and routes), and its text, JSON and CSV forms."""

from __future__ import annotations

import csv
import functools
import io
import itertools
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from pipefold.errors import ScheduleError
from pipefold.ir.kinds import NO_MICROBATCH, Action, Kind, check_size

SEQ_CHUNKS = "seq_chunks"
"""The schedule option that cuts each microbatch into sequence chunks (:attr:`Schedule.seq_chunks`)."""

VOCAB = "vocab"
"""The schedule option that splits the output layer by vocabulary over every device (:attr:`Schedule.vocab`)."""

# --------------------------------------------------------------------------- placements
#
# A placement is, per replica, the device of every stage. One replica is the usual case.


def linear_placement(devices: int) -> tuple[int, ...]:
    """Stage d on device d."""
    return tuple(range(devices))


def reversed_placement(devices: int) -> tuple[int, ...]:
    """Stage d on device p-1-d: the pipeline that runs up the devices (Chimera's and DualPipe's second replica)."""
    return tuple(reversed(range(devices)))


def looped_placement(devices: int, v: int) -> tuple[int, ...]:
    """Stage s on device s mod p: each device holds v stages, p apart (Megatron's interleaving)."""
    return tuple(s % devices for s in range(devices * v))


def v_placement(devices: int) -> tuple[int, ...]:
    """Device d holds stages d and 2p-1-d: down the devices and back up."""
    return tuple(range(devices)) + tuple(reversed(range(devices)))


def describe_placement(stage_to_device: Sequence[int], devices: int) -> str:
    """Name one replica's placement: ``linear``, ``reversed``, ``looped``, ``v`` or the explicit list of devices."""
    mapping = tuple(stage_to_device)
    stages = len(mapping)
    if mapping == linear_placement(devices):
        return "linear"
    if mapping == reversed_placement(devices):
        return "reversed"
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
    if text == "reversed":
        return reversed_placement(devices)
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
            f"cannot read placement {text!r}: use linear, reversed, looped, v, or one device number per stage"
        ) from None


# --------------------------------------------------------------------------- action rows


class ActionRows(Sequence[tuple[Action, ...]]):
    """Per device, its actions in order, kept as flat columns until a row is read: then every :class:`Action` is
    made at once, and kept. A builder that works on arrays hands over its columns instead of hundreds of
    thousands of Actions, and what reads only the columns (:func:`pipefold.ir.graph.action_table`, so the
    dependency graph and the simulator) never makes them: a search over large schedules makes none. Reads,
    compares and pickles as the tuple of tuples it stands for.

    ``kind`` indexes ``codes``; each column has one entry per action, the devices' rows one after the other,
    ``lengths`` actions each. ``parts``, where some actions have parts (an overlapped pair), are the (owner,
    kind, stage, microbatch) columns of those parts in order, ``owner`` the index of the action each belongs to.
    """

    __slots__ = ("_rows", "codes", "kind", "lengths", "microbatch", "parts", "stage")

    def __init__(self, lengths: Sequence[int], codes: Sequence[str], kind: npt.ArrayLike, stage: npt.ArrayLike,
                 microbatch: npt.ArrayLike,
                 parts: tuple[npt.ArrayLike, npt.ArrayLike, npt.ArrayLike, npt.ArrayLike] | None = None) -> None:
        self.lengths = tuple(int(n) for n in lengths)
        self.codes = tuple(codes)
        if not all(isinstance(code, str) for code in self.codes):
            raise TypeError(f"action kinds are codes such as 'F' (pipefold.ir.Kind), got {self.codes!r}")
        self.kind, self.stage, self.microbatch = (np.array(c, dtype=np.int64) for c in (kind, stage, microbatch))
        n = sum(self.lengths)
        if any(len(c) != n for c in (self.kind, self.stage, self.microbatch)) or min(self.lengths, default=0) < 0:
            raise ValueError(f"action columns of {len(self.kind)}, {len(self.stage)} and {len(self.microbatch)} "
                             f"entries for rows of {n} actions in all")
        empty = np.zeros(0, dtype=np.int64)
        self.parts = tuple(np.array(c, dtype=np.int64) for c in parts) if parts is not None else (empty,) * 4
        owner = self.parts[0]
        if len({len(c) for c in self.parts}) != 1 or len(self.parts) != 4:
            raise ValueError("parts are (owner, kind, stage, microbatch) columns of one length")
        if len(owner) and (int(owner.min()) < 0 or int(owner.max()) >= n or bool(np.any(np.diff(owner) < 0))):
            raise ValueError(f"the owners of parts must be action indices 0..{n - 1} in order")
        for column in (self.kind, self.parts[1]):
            if len(column) and not 0 <= int(column.min()) <= int(column.max()) < len(self.codes):
                raise ValueError(f"an action's kind number is outside the {len(self.codes)} codes given")
        for column in (self.kind, self.stage, self.microbatch, *self.parts):
            column.setflags(write=False)  # the schedule is frozen: its columns too
        self._rows: tuple[tuple[Action, ...], ...] | None = None

    @property
    def made(self) -> bool:
        """Whether the Actions have been made (some row was read)."""
        return self._rows is not None

    def rows(self) -> tuple[tuple[Action, ...], ...]:
        """The rows as a tuple of tuples of :class:`Action`, made the first time."""
        if self._rows is None:
            flat = _actions(self.codes, self.stage, self.kind, self.microbatch)
            owner, kind, stage, microbatch = self.parts
            if len(owner):
                parts = _actions(self.codes, stage, kind, microbatch)
                owners = owner.tolist()
                starts = [0, *(i for i in range(1, len(owners)) if owners[i] != owners[i - 1]), len(owners)]
                for a, b in itertools.pairwise(starts):
                    whole = flat[owners[a]]
                    flat[owners[a]] = Action(whole.stage, whole.kind, whole.microbatch, tuple(parts[a:b]))
            ends = list(itertools.accumulate(self.lengths))
            self._rows = tuple(tuple(flat[a:b]) for a, b in zip([0, *ends], ends, strict=False))
        return self._rows

    def __len__(self) -> int:
        return len(self.lengths)

    @overload
    def __getitem__(self, index: int) -> tuple[Action, ...]: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[tuple[Action, ...], ...]: ...

    def __getitem__(self, index: int | slice) -> Any:
        return self.rows()[index]

    def __iter__(self) -> Iterator[tuple[Action, ...]]:
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ActionRows):
            return self.rows() == other.rows()
        if isinstance(other, tuple):
            return self.rows() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.rows())

    def __repr__(self) -> str:
        return repr(self.rows())

    def __reduce__(self) -> tuple[Any, ...]:
        return tuple, (self.rows(),)


def _actions(codes: tuple[str, ...], stage: npt.NDArray[np.int64], kind: npt.NDArray[np.int64],
             microbatch: npt.NDArray[np.int64]) -> list[Action]:
    # tuple.__new__ over zipped columns makes the Actions without a Python call each.
    columns = zip(stage.tolist(), map(codes.__getitem__, kind.tolist()), microbatch.tolist(), itertools.repeat(()))
    return list(map(tuple.__new__, itertools.repeat(Action), columns))


def row_lengths(rows: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """How many actions each device's row has, without making the Actions of :class:`ActionRows`."""
    return rows.lengths if isinstance(rows, ActionRows) else tuple(map(len, rows))


# --------------------------------------------------------------------------- schedule


@dataclass(frozen=True, eq=True)
class Schedule:
    """Per-device ordered action lists plus the shape of the pipeline they run on.

    ``placement`` gives, per replica, the device of every stage (a flat sequence is one
    replica); ``routes`` the replica each microbatch goes through (all 0 by default). ``actions`` reads as a tuple
    of tuples; a builder may give :class:`ActionRows`, whose Actions are made only when read.
    """

    name: str
    devices: int
    stages: int
    microbatches: int
    placement: tuple[tuple[int, ...], ...]
    actions: Sequence[tuple[Action, ...]]
    options: Mapping[str, Any] = field(default_factory=dict)
    routes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", _as_replicas(self.placement))
        if not isinstance(self.actions, ActionRows):
            object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        object.__setattr__(self, "options", dict(self.options))
        for label, value in (("devices", self.devices), ("stages", self.stages),
                             ("microbatches", self.microbatches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"{label} must be a positive integer (got {value!r})")
        check_size(self.stages, self.microbatches, f"schedule {self.name}", devices=self.devices)
        if not self.placement:
            raise ScheduleError("the placement is empty: give the device of every stage")
        for replica, mapping in enumerate(self.placement):
            of = f" of replica {replica}" if self.replicas > 1 else ""
            if len(mapping) != self.stages:
                raise ScheduleError(f"placement{of} lists {len(mapping)} devices but the schedule has "
                                    f"{self.stages} stages")
            for stage, device in enumerate(mapping):
                if not isinstance(device, int) or not 0 <= device < self.devices:
                    raise ScheduleError(f"placement{of} puts stage {stage} on device {device}, "
                                        f"but devices are 0..{self.devices - 1}")
        for stage in range(self.stages):
            holders = [r[stage] for r in self.placement]
            if len(set(holders)) != len(holders):
                raise ScheduleError(f"two replicas of stage {stage} are on one device ({holders}): a device "
                                    "holds at most one copy of a stage")
        routes = tuple(self.routes) or (0,) * self.microbatches
        object.__setattr__(self, "routes", routes)
        if len(routes) != self.microbatches:
            raise ScheduleError(f"routes name a replica for {len(routes)} microbatches, but the schedule has "
                                f"{self.microbatches}")
        bad = next((r for r in routes if not (isinstance(r, int) and 0 <= r < self.replicas)), None)
        if bad is not None:
            raise ScheduleError(f"a route names replica {bad!r}, but replicas are 0..{self.replicas - 1}")
        if len(self.actions) != self.devices:
            raise ScheduleError(f"schedule has {self.devices} devices but {len(self.actions)} action lists")
        c = self.options.get(SEQ_CHUNKS, 1)
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise ScheduleError(f"option {SEQ_CHUNKS} is the sequence chunks of a microbatch: an integer >= 1 "
                                f"(got {c!r})")
        if self.microbatches % c:
            raise ScheduleError(f"{self.microbatches} microbatch units do not split into microbatches of {c} "
                                f"sequence chunks: with {SEQ_CHUNKS} {c} a schedule has a multiple of {c} units")
        uneven = next((u for u in range(self.microbatches) if routes[u] != routes[u - u % c]), None) if c > 1 \
            else None
        if uneven is not None:
            raise ScheduleError(f"unit {uneven} (microbatch {uneven // c}, chunk {uneven % c}) takes replica "
                                f"{routes[uneven]}, its chunk 0 replica {routes[uneven - uneven % c]}: the chunks "
                                "of a microbatch go through one replica, whose stages keep their keys and values")

        vocab = self.options.get(VOCAB, 0)
        if vocab not in (0, 1) or isinstance(vocab, float):
            raise ScheduleError(f"option {VOCAB} is 1 (the output layer split by vocabulary over every device) or 0 "
                                f"(got {vocab!r})")
        if vocab and self.devices > self.stages:
            raise ScheduleError(f"with option {VOCAB} every device holds a shard of the output layer and a stage: "
                                f"{self.devices} devices but {self.stages} stages")
        if vocab and c > 1:
            raise ScheduleError(f"options {VOCAB} and {SEQ_CHUNKS} do not go together yet: the output layer's shards "
                                "take whole microbatches")

    # -- derived views

    @property
    def replicas(self) -> int:
        """How many copies of the model the placement holds (2 for Chimera and DualPipe)."""
        return len(self.placement)

    @property
    def seq_chunks(self) -> int:
        """How many sequence chunks each microbatch is cut into (Seq1F1B; 1: whole sequences). With c chunks the
        schedule's ``microbatches`` are units, unit u being chunk u mod c of microbatch u // c; a chunk's forward
        waits for the forward of the chunk before it on its stage (its attention reads their keys and values), and
        its backward for the backward of the chunk after it (which gives their gradients)."""
        return int(self.options.get(SEQ_CHUNKS, 1))

    @property
    def vocab(self) -> bool:
        """Whether the output layer (with its softmax and loss) is split by vocabulary over every device (Vocabulary
        Parallelism): then the last stage ends before it, and each microbatch has, on every device d, a vocabulary
        forward ``dS<m>`` after the last stage's forward and a vocabulary backward ``dT<m>`` after every device's
        ``S`` of that microbatch; the last stage's backward waits for every device's ``T``."""
        return bool(self.options.get(VOCAB, 0))

    @property
    def data_microbatches(self) -> int:
        """The microbatches of data: ``microbatches`` divided by :attr:`seq_chunks`."""
        return self.microbatches // self.seq_chunks

    @property
    def placement_name(self) -> str:
        """Human name of the placement, replicas separated by `` | `` (see :func:`describe_placement`)."""
        return " | ".join(describe_placement(r, self.devices) for r in self.placement)

    def device_of(self, stage: int, microbatch: int = NO_MICROBATCH) -> int:
        """The device that runs ``stage`` for ``microbatch`` (any microbatch when there is one replica)."""
        if microbatch >= 0:
            return self.placement[self.routes[microbatch]][stage]
        if self.replicas > 1:
            raise ValueError(f"stage {stage} is on devices {self.holders(stage)}: name a microbatch to pick one")
        return self.placement[0][stage]

    def holders(self, stage: int) -> tuple[int, ...]:
        """The devices holding a replica of ``stage``, by replica."""
        return tuple(r[stage] for r in self.placement)

    def replica_on(self, stage: int, device: int) -> int:
        """Which replica of ``stage`` ``device`` holds."""
        return self.holders(stage).index(device)

    def stages_of(self, device: int) -> list[int]:
        """Stages held by ``device`` (of any replica), in increasing order."""
        return list(self._held.get(device, ()))

    @functools.cached_property
    def _held(self) -> dict[int, tuple[int, ...]]:
        """Each device's stages, read from the placement once (searches ask for them hundreds of thousands of
        times)."""
        held: dict[int, set[int]] = {}
        for replica in self.placement:
            for stage, device in enumerate(replica):
                held.setdefault(device, set()).add(stage)
        return {device: tuple(sorted(stages)) for device, stages in held.items()}

    def chunk_of(self, stage: int, device: int | None = None) -> int:
        """Index of ``stage`` among the stages of its device (0 for the first); ``device``: which holder."""
        device = self.placement[0][stage] if device is None else device
        return self.stages_of(device).index(stage)

    @property
    def num_actions(self) -> int:
        return sum(row_lengths(self.actions))

    def with_actions(self, actions: Iterable[Iterable[Action]]) -> Schedule:
        """A copy with other action lists (same shape, name and options)."""
        return Schedule(self.name, self.devices, self.stages, self.microbatches,
                        self.placement, tuple(tuple(r) for r in actions), self.options, self.routes)

    @property
    def is_forward_only(self) -> bool:
        """Whether the schedule runs forwards only (evaluation, inference): no backward pass anywhere (forwards, and
        the vocabulary shards' forwards where the output layer is split)."""
        return all(a.kind in (Kind.F, Kind.S) for row in self.actions for act in row for a in act.passes)

    def forward_only(self) -> Schedule:
        """The same schedule with its forwards only, in the order each device runs them (an overlapped pair keeps
        its forward; with the output layer split by vocabulary, the shards' forwards ``S`` too, which give the
        loss): what evaluation and inference run, on the same placement and replicas."""
        keep = (Kind.F, Kind.S)
        rows = [[a for act in row for a in act.passes if a.kind in keep] for row in self.actions]
        return Schedule(self.name, self.devices, self.stages, self.microbatches, self.placement,
                        tuple(tuple(r) for r in rows), self.options, self.routes)

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
            f"placement: {self.placement_name}",
        ]
        if self.replicas > 1:
            lines.append(f"routes: {' '.join(map(str, self.routes))}")
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
            elif key in ("name", "options", "devices", "stages", "microbatches", "placement", "routes"):
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
        check_size(stages, counts["microbatches"], "the schedule", devices=devices)
        lineno, placement_text = header.get("placement", (0, "linear"))
        try:
            placement = tuple(parse_placement(part, devices, stages) for part in placement_text.split("|"))
        except ValueError as exc:
            raise ScheduleError(f"line {lineno}: {exc}") from None
        routes: tuple[int, ...] = ()
        if "routes" in header:
            lineno, value = header["routes"]
            try:
                routes = tuple(int(tok) for tok in value.split())
            except ValueError:
                raise ScheduleError(f"line {lineno}: routes are one replica number per microbatch, "
                                    f"got {value!r}") from None
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
        return cls(name, devices, stages, counts["microbatches"], placement, tuple(actions), options, routes)

    # -- JSON form

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_json` reads it back exactly."""
        out: dict[str, Any] = {
            "format": "pipefold-schedule",
            "version": 2,
            "name": self.name,
            "options": dict(self.options),
            "devices": self.devices,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "placement": list(self.placement[0]) if self.replicas == 1 else [list(r) for r in self.placement],
            "actions": [[str(a) for a in row] for row in self.actions],
        }
        if self.replicas > 1:
            out["routes"] = list(self.routes)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> Schedule:
        """Read :meth:`to_json`'s dict (version 1 or 2) or its text."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise ScheduleError(f"line {exc.lineno}: not valid JSON ({exc.msg})") from None
            except RecursionError:
                raise ScheduleError("the JSON nests too deeply to be a schedule") from None
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
        sizes = [data[key] for key in ("devices", "stages", "microbatches")]
        if all(isinstance(n, int) and not isinstance(n, bool) for n in sizes):
            check_size(sizes[1], sizes[2], "the schedule", devices=sizes[0])
        if isinstance(placement, str):
            try:
                placement = tuple(parse_placement(p, int(data["devices"]), int(data["stages"]))
                                  for p in placement.split("|"))
            except ValueError as exc:
                raise ScheduleError(str(exc)) from None
        if not isinstance(placement, (list, tuple)):
            raise ScheduleError("schedule JSON 'placement' must be a list of devices, one per stage "
                                "(or a list of such lists, one per replica)")
        options = data.get("options", {})
        if not isinstance(options, Mapping):
            raise ScheduleError(f"schedule JSON 'options' must be an object, got {options!r}")
        routes = data.get("routes", ())
        if not isinstance(routes, (list, tuple)):
            raise ScheduleError("schedule JSON 'routes' must be a list of replica numbers, one per microbatch")
        return cls(str(data.get("name", "custom")), data["devices"], data["stages"], data["microbatches"],
                   tuple(placement), actions, options, tuple(routes))

    # -- CSV form (one row per device, one action per cell, as torch.distributed.pipelining)

    def to_csv(self) -> str:
        """One row of actions per device; refused for a schedule over sequence chunks or with its output layer split
        by vocabulary, which a CSV cannot say."""
        if self.seq_chunks > 1:
            raise ScheduleError(f"{self.name} cuts its microbatches into {self.seq_chunks} sequence chunks, which a "
                                "CSV file holds no option to say: write it as text or JSON")
        if self.vocab:
            raise ScheduleError(f"{self.name} splits its output layer by vocabulary ({VOCAB}=1), which a CSV file "
                                "holds no option to say: write it as text or JSON")
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for row in self.actions:
            writer.writerow([str(a) for a in row])
        return buf.getvalue()

    @classmethod
    def from_csv(cls, text: str, *, name: str = "custom", options: Mapping[str, Any] | None = None,
                 placement: Sequence[int] | Sequence[Sequence[int]] | None = None) -> Schedule:
        """Read one row of actions per device.

        The CSV holds only actions: stages and microbatches are counted from them
        and, unless ``placement`` is given, each stage is placed on the device whose
        row runs it. Microbatches whose forwards run on different devices go through
        different replicas (one per distinct path, in order of first microbatch).
        """
        rows = [
            _parse_actions([cell for cell in row if cell.strip()], f"line {lineno}")
            for lineno, row in enumerate(csv.reader(io.StringIO(text)), start=1)
        ]
        while rows and not rows[-1]:
            rows.pop()  # trailing blank lines
        if not rows:
            raise ScheduleError("CSV schedule is empty: expected one row of actions per device")
        simple = [(d, a) for d, row in enumerate(rows) for act in row for a in act.passes]
        stages = 1 + max((a.stage for _, a in simple), default=0)
        microbatches = 1 + max((a.microbatch for _, a in simple), default=0)
        check_size(stages, microbatches, f"the CSV schedule (largest stage index {stages - 1:,}, largest "
                                         f"microbatch {microbatches - 1:,})")
        routes: tuple[int, ...] = ()
        if placement is None:
            placement, routes = _infer_placement(rows, stages, microbatches)
        return cls(name, len(rows), stages, microbatches, _as_replicas(placement), tuple(rows), options or {}, routes)


def _as_replicas(placement: Sequence[int] | Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """A placement as one tuple per replica; a flat sequence of devices is one replica."""
    items = tuple(placement)
    if items and not isinstance(items[0], (tuple, list)):
        return (tuple(items),)  # type: ignore[arg-type]
    return tuple(tuple(r) for r in items)  # type: ignore[arg-type]


def _infer_placement(rows: Sequence[Sequence[Action]], stages: int,
                     microbatches: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Replicas and routes from where each microbatch's forwards run."""
    path: dict[int, dict[int, int]] = {}  # microbatch -> stage -> device of its forward
    first: dict[int, tuple[int, int]] = {}  # stage -> (device, position) that first runs it
    for device, row in enumerate(rows):
        for position, act in enumerate(row):
            for a in act.passes:
                first.setdefault(a.stage, (device, position))
                if a.kind == Kind.F:
                    path.setdefault(a.microbatch, {})[a.stage] = device
    absent = [s for s in range(stages) if s not in first]
    if absent:
        raise ScheduleError(f"CSV schedule never runs stage {absent[0]}: cannot tell its device")
    replicas: list[tuple[int, ...]] = []
    routes = []
    for mb in range(microbatches):
        known = path.get(mb, {})
        # A microbatch whose forward of some stage is missing takes the device that first runs that stage:
        # validation then names what is missing.
        devices = tuple(known.get(s, first[s][0]) for s in range(stages))
        if devices not in replicas:
            replicas.append(devices)
        routes.append(replicas.index(devices))
    if len(replicas) > 1:
        # Actions that are not forwards must sit with their microbatch's replica; report the first that does not.
        for device, row in enumerate(rows):
            for position, act in enumerate(row):
                for a in act.passes:
                    if a.microbatch >= 0 and replicas[routes[a.microbatch]][a.stage] != device:
                        raise ScheduleError(
                            f"line {device + 1}: action {a} at position {position} is for stage {a.stage}, "
                            f"whose forward for microbatch {a.microbatch} runs on line "
                            f"{replicas[routes[a.microbatch]][a.stage] + 1}")
    else:
        for device, row in enumerate(rows):
            for position, act in enumerate(row):
                for a in act.passes:
                    home = replicas[0][a.stage]
                    if home != device:
                        raise ScheduleError(f"line {device + 1}: action {a} at position {position} is for stage "
                                            f"{a.stage}, which line {home + 1} also runs")
    return tuple(replicas), tuple(routes) if len(replicas) > 1 else ()


def _parse_actions(tokens: Iterable[Any], where: str) -> tuple[Action, ...]:
    out = []
    for token in tokens:
        try:
            out.append(Action.parse(str(token)))
        except ValueError as exc:
            raise ScheduleError(f"{where}: {exc}") from None
    return tuple(out)
