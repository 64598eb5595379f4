"""Schedules to and from torch.distributed.pipelining: its CSV and its in-memory ``pipeline_order``.

torch writes a schedule as one row per rank and one action per cell (``_Action``'s repr)::

    0F0,0F1,0I0,0W0,...
    1F0,(1F1;2B0)OVERLAP_F_B,...

Its compute actions map one to one onto pipefold's kinds (torch -> pipefold)::

    2F0                    -> 2F0       forward
    2I0                    -> 2B0       backward for the stage input only
    2W0                    -> 2W0       backward for the weights only
    2B0                    -> 2BW0      full backward (input and weights at once)
    (0F1;3B0)OVERLAP_F_B   -> 0F1+3BW0  a forward and a backward run together

A torch stage index is a pipefold stage index, a torch rank a pipefold device.

**On read** (:func:`from_torch_csv`, :func:`from_torch_order`) what torch adds when it lowers a
schedule is skipped: sends and receives (``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``), FSDP's
``UNSHARD`` and ``RESHARD``, and the gradient reduction ``REDUCE_GRAD``; so are empty cells and
``None`` entries (torch's idle steps). Stages are placed on the rank whose row runs them (torch
puts each stage on one rank). The result is not validated: call :func:`pipefold.ir.validate`.

**On write** (:func:`to_torch_csv`, :func:`to_torch_actions`) pipefold's whole-stage actions are
left out: the all-reduce ``R`` (torch reduces gradients itself, after a stage's last backward)
and the optimizer step ``OPT`` (torch runs the optimizer outside the schedule). A schedule
whose placement holds replicas of its stages (Chimera, DualPipe) cannot be written: torch
puts every stage on exactly one rank.

Reading and writing the CSV need no torch; :func:`to_torch_actions` imports it when called.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipefold.errors import ConfigError, ScheduleError
from pipefold.ir.kinds import Action, Kind, check_size, overlap
from pipefold.ir.schedule import Schedule

if TYPE_CHECKING:  # torch is imported only where a torch object is made
    from torch.distributed.pipelining.schedules import _Action

__all__ = ["from_torch_csv", "from_torch_order", "to_torch_actions", "to_torch_csv"]

"""The schedule file formats: pipefold's text, JSON and CSV, and torch.distributed.pipelining's CSV."""

_TO_PIPEFOLD = {"F": Kind.F, "I": Kind.B, "W": Kind.W, "B": Kind.BW}
_TO_TORCH = {v: k for k, v in _TO_PIPEFOLD.items()}
_OVERLAP = "OVERLAP_F_B"
_SKIPPED = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"})
_NOT_WRITTEN = frozenset({Kind.R, Kind.OPT})
_CELL = re.compile(r"(\d+)(F|I|W|B|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)")
_GROUP = re.compile(r"\((.*)\)([A-Z_]+)")
_EXAMPLE = "expected <stage><type><microbatch> with type F, I, W or B (e.g. 2F0, 1I3), or (0F1;3B0)OVERLAP_F_B"

_Torch = tuple[int, str, int | None, tuple[Any, ...] | None]
"""A torch action as plain values: (stage, computation type code, microbatch, sub-actions)."""


# --------------------------------------------------------------------------- read


def from_torch_csv(text: str, *, name: str = "torch", renumber: bool = False) -> Schedule:
    """Read torch.distributed.pipelining's CSV (``_dump_csv``, ``_load_csv``): one row of actions per rank.

    Communication, ``UNSHARD``, ``RESHARD`` and ``REDUCE_GRAD`` cells and empty cells are skipped
    (see the module's docstring); trailing empty rows are dropped. Errors name the rank, its
    line and the cell. ``renumber``: see :func:`from_torch_order`.
    """
    rows: list[list[tuple[Action, str]]] = []
    reader = csv.reader(io.StringIO(text))
    for rank, cells in enumerate(reader):
        row = []
        for column, cell in enumerate(cells):
            where = f"rank {rank} (line {reader.line_num}), cell {column + 1} {cell.strip()!r}"
            action = _to_pipefold(_parse_cell(cell, where), where)
            if action is not None:
                row.append((action, where))
        rows.append(row)
    while rows and not rows[-1]:
        rows.pop()  # trailing blank lines
    if not rows:
        raise ScheduleError("torch CSV schedule is empty: expected one row of actions per rank")
    return _assemble(rows, name, renumber)


def from_torch_order(pipeline_order: Mapping[int, Sequence[Any]], *, name: str = "torch",
                     renumber: bool = False) -> Schedule:
    """A schedule from a torch schedule's ``pipeline_order``: rank -> list of ``_Action`` or ``None``.

    ``None`` entries (idle steps) and communication, ``UNSHARD``, ``RESHARD`` and ``REDUCE_GRAD``
    actions are skipped (see the module's docstring). Ranks must be 0..N-1.

    torch's ``Schedule1F1B`` numbers the forwards of its last rank 1..m instead of 0..m-1 (torch's
    own validator rejects that order). A stage whose forwards (or backwards) are numbered 1..m
    while the rest of the schedule uses 0..m-1 raises :class:`ScheduleError` saying so; with
    ``renumber=True`` they are shifted down by one instead.
    """
    ranks = sorted(pipeline_order)
    if ranks != list(range(len(ranks))):
        raise ScheduleError(f"torch pipeline_order has ranks {ranks}: expected 0..N-1, one list of actions each")
    if not ranks:
        raise ScheduleError("torch pipeline_order is empty: expected one list of actions per rank")
    rows: list[list[tuple[Action, str]]] = []
    for rank in ranks:
        actions = pipeline_order[rank]
        if isinstance(actions, (str, bytes)) or not isinstance(actions, Iterable):
            raise ScheduleError(f"rank {rank}: expected a list of torch _Action or None, got {type(actions).__name__}")
        row = []
        for step, item in enumerate(actions):
            where = f"rank {rank}, step {step} ({item!r})"
            action = _to_pipefold(_from_object(item, where), where)
            if action is not None:
                row.append((action, where))
        rows.append(row)
    return _assemble(rows, name, renumber)


def _parse_cell(cell: str, where: str) -> _Torch | None:
    """One CSV cell as plain values; None for an empty cell."""
    text = cell.strip()
    if not text:
        return None
    group = _GROUP.fullmatch(text)
    if group is not None:
        subs = tuple(_parse_cell(part, where) for part in group[1].split(";") if part.strip())
        return -1, group[2], None, subs
    match = _CELL.fullmatch(text)
    if match is None:
        raise ScheduleError(f"{where}: cannot read it as a torch action: {_EXAMPLE}")
    return int(match[1]), match[2], int(match[3]) if match[3] else None, None


def _from_object(item: Any, where: str) -> _Torch | None:
    """A torch ``_Action`` (read by its fields, so torch need not be imported) as plain values."""
    if item is None:
        return None
    try:
        stage, ctype, microbatch, subs = item.stage_index, item.computation_type, item.microbatch_index, \
            item.sub_actions
    except AttributeError:
        raise ScheduleError(f"{where}: expected a torch _Action or None, got {type(item).__name__}") from None
    code = str(getattr(ctype, "value", ctype))
    if subs is not None:
        subs = tuple(_from_object(sub, where) for sub in subs)
    return stage, code, microbatch, subs


def _to_pipefold(t: _Torch | None, where: str) -> Action | None:
    """The pipefold action for a torch one; None for what is skipped (idle steps, communication, FSDP)."""
    if t is None:
        return None
    stage, code, microbatch, subs = t
    if subs is not None or code == _OVERLAP:
        if code != _OVERLAP:
            raise ScheduleError(f"{where}: torch action {code} with sub-actions: only OVERLAP_F_B groups actions "
                                f"({_EXAMPLE})")
        parts = [_to_pipefold(sub, where) for sub in subs or ()]
        forwards = [a for a in parts if a is not None and a.kind == Kind.F]
        backwards = [a for a in parts if a is not None and a.kind in (Kind.B, Kind.BW)]
        if len(parts) != 2 or len(forwards) != 1 or len(backwards) != 1:
            raise ScheduleError(f"{where}: an OVERLAP_F_B holds one forward and one backward (I or B), "
                                "e.g. (0F1;3B0)OVERLAP_F_B")
        try:
            return overlap(forwards[0], backwards[0])
        except ValueError as exc:
            raise ScheduleError(f"{where}: {exc}") from None
    if code in _SKIPPED:
        return None
    kind = _TO_PIPEFOLD.get(code)
    if kind is None:
        raise ScheduleError(f"{where}: unknown torch computation type {code!r}: {_EXAMPLE}")
    if not isinstance(stage, int) or stage < 0:
        raise ScheduleError(f"{where}: a torch {code} action needs a stage index of 0 or more (got {stage!r})")
    if not isinstance(microbatch, int) or microbatch < 0:
        raise ScheduleError(f"{where}: a torch {code} action names its microbatch, e.g. {stage}{code}0 "
                            f"(got {microbatch!r})")
    return Action(stage, kind, microbatch)


def _assemble(rows: Sequence[Sequence[tuple[Action, str]]], name: str, renumber: bool) -> Schedule:
    """Stages placed where their rows run them, microbatches counted, torch's 1..m numbering caught."""
    home: dict[int, tuple[int, str]] = {}  # stage -> (rank, where) of its first action
    for rank, row in enumerate(rows):
        for action, where in row:
            for a in action.passes:
                first = home.setdefault(a.stage, (rank, where))
                if first[0] != rank:
                    raise ScheduleError(f"{where}: runs stage {a.stage}, which rank {first[0]} also runs "
                                        f"({first[1]}); torch puts each stage on one rank")
    if not home:
        raise ScheduleError("the torch schedule has no compute actions (F, I, W, B or OVERLAP_F_B)")
    stages = 1 + max(home)
    most = 1 + max(a.microbatch for row in rows for action, _ in row for a in action.passes)
    check_size(stages, most, f"the torch schedule (largest stage index {stages - 1:,}, largest microbatch "
                             f"{most - 1:,})", devices=len(rows))
    absent = [s for s in range(stages) if s not in home]
    if absent:
        raise ScheduleError(f"no rank runs stage {absent[0]}, though stage {stages - 1} is run: "
                            f"stages are 0..{stages - 1}")
    shifted = _one_based(rows)
    if shifted:
        if not renumber:
            (stage, kind), (rank, n) = next(iter(shifted.items()))
            what = {Kind.F: "forwards", Kind.B: "input gradients", Kind.W: "weight gradients"}[kind]
            raise ScheduleError(
                f"rank {rank}: stage {stage}'s {what} are numbered 1..{n} where the rest of the schedule uses "
                f"0..{n - 1} (torch's Schedule1F1B numbers its last rank so, and its own validator rejects it); "
                f"give --renumber (renumber=True in Python) to shift them to 0..{n - 1}")
        rows = [[(_shift(action, shifted), where) for action, where in row] for row in rows]
    microbatches = 1 + max(a.microbatch for row in rows for action, _ in row for a in action.passes)
    placement = (tuple(home[s][0] for s in range(stages)),)
    actions = tuple(tuple(action for action, _ in row) for row in rows)
    return Schedule(name, len(rows), stages, microbatches, placement, actions)


_GIVES = {Kind.F: (Kind.F,), Kind.B: (Kind.B,), Kind.W: (Kind.W,), Kind.BW: (Kind.B, Kind.W)}


def _one_based(rows: Sequence[Sequence[tuple[Action, str]]]) -> dict[tuple[int, str], tuple[int, int]]:
    """(stage, pass) groups numbered 1..n where every other group is 0..n-1: -> (rank, n). Empty if none."""
    numbers: dict[tuple[int, str], set[int]] = {}
    rank_of: dict[tuple[int, str], int] = {}
    for rank, row in enumerate(rows):
        for action, _ in row:
            for a in action.passes:
                for given in _GIVES[a.kind]:
                    numbers.setdefault((a.stage, given), set()).add(a.microbatch)
                    rank_of.setdefault((a.stage, given), rank)
    sizes = {len(v) for v in numbers.values()}
    if len(sizes) != 1:
        return {}
    n = sizes.pop()
    zero, one = set(range(n)), set(range(1, n + 1))
    if not all(v in (zero, one) for v in numbers.values()) or zero not in numbers.values():
        return {}
    return {group: (rank_of[group], n) for group, v in numbers.items() if v == one}


def _shift(action: Action, shifted: Mapping[tuple[int, str], Any]) -> Action:
    if action.parts:
        return overlap(*(_shift(a, shifted) for a in action.parts))
    if (action.stage, _GIVES[action.kind][0]) in shifted:
        return action._replace(microbatch=action.microbatch - 1)
    return action


# --------------------------------------------------------------------------- write


def to_torch_csv(schedule: Schedule) -> str:
    """torch.distributed.pipelining's compute-only CSV of ``schedule``: one row per device.

    torch's ``_PipelineScheduleRuntime._load_csv`` reads it (and adds the communication).
    ``R`` and ``OPT`` actions are left out; a replicated placement raises :class:`ConfigError`.
    """
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in _torch_rows(schedule):
        writer.writerow([_cell(t) for t in row])
    return buf.getvalue()


def to_torch_actions(schedule: Schedule) -> dict[int, list[_Action]]:
    """``schedule`` as a torch ``pipeline_order``: device -> list of torch ``_Action`` (imports torch).

    What :func:`to_torch_csv` writes, as objects: give it to ``_load_actions`` or
    ``_prepare_schedule_with_comms`` of a ``_PipelineScheduleRuntime``.
    """
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    def make(t: _Torch) -> _Action:
        stage, code, microbatch, subs = t
        return _Action(stage, _ComputationType(code), microbatch, None if subs is None else tuple(map(make, subs)))

    return {device: [make(t) for t in row] for device, row in enumerate(_torch_rows(schedule))}


def _torch_rows(schedule: Schedule) -> list[list[_Torch]]:
    if schedule.replicas > 1:
        raise ConfigError(f"{schedule.name} holds {schedule.replicas} replicas of its stages (placement "
                          f"{schedule.placement_name}); torch.distributed.pipelining puts each stage on one rank")
    if schedule.seq_chunks > 1:
        raise ConfigError(f"{schedule.name} cuts its microbatches into {schedule.seq_chunks} sequence chunks, which "
                          "torch.distributed.pipelining does not run: write it as text or JSON")
    if schedule.vocab:
        raise ConfigError(f"{schedule.name} splits its output layer by vocabulary over every device, which "
                          "torch.distributed.pipelining does not run: write it as text or JSON")
    rows = []
    for device, row in enumerate(schedule.actions):
        out: list[_Torch] = []
        for position, action in enumerate(row):
            if action.kind in _NOT_WRITTEN and not action.parts:
                continue
            if action.parts:
                out.append((-1, _OVERLAP, None, tuple(_torch_simple(a, device, position) for a in action.parts)))
            else:
                out.append(_torch_simple(action, device, position))
        rows.append(out)
    return rows


def _torch_simple(action: Action, device: int, position: int) -> _Torch:
    code = _TO_TORCH.get(action.kind)
    if code is None:
        raise ConfigError(f"device {device}, position {position}: {action} is a {action.kind} action "
                          f"({action.spec.doc}), which torch.distributed.pipelining has no action for")
    return action.stage, code, action.microbatch, None


def _cell(t: _Torch) -> str:
    stage, code, microbatch, subs = t
    if subs is not None:
        return f"({';'.join(map(_cell, subs))}){code}"
    return f"{stage}{code}{'' if microbatch is None else microbatch}"


# --------------------------------------------------------------------------- files in any format
