"""Schedule files: one :func:`load` for every format (pipefold's text, JSON and CSV, and torch's CSV, told apart
by its content), one :func:`dumps` and :func:`save`."""

from __future__ import annotations

import os
import re

from pipefold.errors import ConfigError, ScheduleError
from pipefold.ir.schedule import Schedule

__all__ = ["FORMATS", "dumps", "format_of", "load", "read_schedule_text", "save", "torch_dialect"]

FORMATS = ("text", "json", "csv", "torch-csv")
"""The formats a schedule file can be in: pipefold's text, JSON and CSV, and torch's CSV (:mod:`.interop`)."""

def read_schedule_text(path: str | os.PathLike[str]) -> str:
    """The text of a schedule file; one ConfigError if it is not UTF-8 text (a binary file, an image)."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not a schedule file: byte {data[exc.start]:#04x} at offset {exc.start} is "
                            "not UTF-8 text; schedule files are text, JSON or CSV (pipefold generate -o FILE "
                            "writes one)") from None


def format_of(path: str | os.PathLike[str]) -> str:
    """The schedule format a file's suffix names: json (.json), csv (.csv) or text, in any case."""
    lower = os.fspath(path).lower()
    if lower.endswith(".json"):
        return "json"
    if lower.endswith(".csv"):
        return "csv"
    return "text"


_TORCH_ONLY = re.compile(r"(?:^|[,(;])\s*\d+I\d+\b|OVERLAP_F_B|SEND_[FB]|RECV_[FB]|UNSHARD|RESHARD|REDUCE_GRAD",
                         re.MULTILINE)


def torch_dialect(text: str) -> bool:
    """Whether a CSV schedule is torch's: it has a cell only torch writes (``2I0``, an ``OVERLAP_F_B`` pair, a
    send or receive, FSDP's and the gradient reduction's), or full backwards (``B``) with no ``W`` nor ``BW``
    anywhere (pipefold's ``B`` is the input gradient, which needs its ``W``)."""
    if _TORCH_ONLY.search(text):
        return True
    cells = re.findall(r"\d+(BW|B|W)\d+", text)
    return "B" in cells and "W" not in cells and "BW" not in cells


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"unknown schedule format {fmt!r}: use {', '.join(FORMATS)}")


def load(path: str | os.PathLike[str], fmt: str | None = None, *, renumber: bool = False) -> Schedule:
    """Read a schedule file in ``fmt`` (one of :data:`FORMATS`), or, if None, as its suffix says (.json, .csv,
    else text, in any case); a ``.csv`` in torch's dialect is told from pipefold's by its content
    (:func:`torch_dialect`). ``renumber``: see :func:`pipefold.ir.interop.from_torch_order` (torch's CSV only).
    A file written by hand is read the same way. The result is not validated: call :func:`pipefold.ir.validate`."""
    if fmt is not None:
        _check_format(fmt)
    text = read_schedule_text(path)
    if fmt is None:
        fmt = format_of(path)
        if fmt == "csv" and torch_dialect(text):
            fmt = "torch-csv"
    try:
        if fmt == "torch-csv":
            from pipefold.ir.interop import from_torch_csv

            return from_torch_csv(text, renumber=renumber)
        if fmt == "json":
            return Schedule.from_json(text)
        if fmt == "csv":
            return Schedule.from_csv(text)
        return Schedule.from_text(text)
    except ScheduleError as exc:
        raise ScheduleError(f"{path}: {exc.message}", exc.report) from None


def dumps(schedule: Schedule, fmt: str = "text") -> str:
    """``schedule`` in one of :data:`FORMATS`."""
    _check_format(fmt)
    if fmt == "torch-csv":
        from pipefold.ir.interop import to_torch_csv

        return to_torch_csv(schedule)
    if fmt == "json":
        from pipefold.jsonout import dumps as json_dumps

        return json_dumps(schedule.to_json(), indent=1) + "\n"
    if fmt == "csv":
        return schedule.to_csv()
    return schedule.to_text()


def save(schedule: Schedule, path: str | os.PathLike[str], fmt: str | None = None) -> None:
    """Write ``schedule`` to ``path`` atomically, in ``fmt`` or the format its suffix names (.json, .csv, else
    text; any case)."""
    from pipefold.files import write_text

    write_text(path, dumps(schedule, format_of(path) if fmt is None else fmt))
