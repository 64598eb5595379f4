"""Exceptions raised by pipefold for problems the user can fix, and the one way a line reaches stderr."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn


def say(line: str) -> None:
    """Write ``line`` and its newline to stderr in one write. A job's ranks and its launcher share the stream, and
    ``print`` writes the text and the newline apart: where the stream is unbuffered (``PYTHONUNBUFFERED``), another
    process's line can land between the two (a rank's warning was once glued to the end of a progress line)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class PipefoldError(ValueError):
    """Base class: a problem with the user's input, reported as one clear line."""


class ConfigError(PipefoldError):
    """A parameter that a schedule, cost model or command cannot take."""


class ScheduleError(PipefoldError):
    """A schedule that is malformed or cannot run.

    ``message`` is the one-line summary; ``report`` adds context such as a
    device-by-step grid marking the offending action.
    """

    def __init__(self, message: str, report: str = "", *, device: int | None = None,
                 position: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.report = report
        self.device = device
        self.position = position

    def __str__(self) -> str:
        return f"{self.message}\n{self.report}" if self.report else self.message


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM ended a command; a launcher stopped its ranks first (``stopped``, when it had any).
    ``str()`` says so in one line."""

    def __init__(self, signum: int, stopped: int | None = None) -> None:
        self.signum, self.stopped = int(signum), stopped
        ranks = "" if stopped is None else f"; stopped {stopped} rank{'s' if stopped != 1 else ''}"
        super().__init__(f"interrupted ({signal.Signals(signum).name}){ranks}")

    @property
    def exit_code(self) -> int:
        """What a shell expects of a process ended by the signal: 128 + its number (130, 143)."""
        return 128 + self.signum


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """Run a script's ``main`` (a benchmark's) and exit with its code. A problem with the user's input that the
    library finds (:class:`PipefoldError`: a size the model cannot take, a schedule that cannot be built) ends it
    as argparse ends it for a bad option: one line, ``<script>: error: <what>``, and exit code 2."""
    try:
        code = main()
    except PipefoldError as exc:
        say(f"{os.path.basename(sys.argv[0])}: error: {getattr(exc, 'message', str(exc))}")
        sys.exit(2)
    sys.exit(code or 0)
