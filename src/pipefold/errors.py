"""Exceptions raised by pipefold for problems the user can fix."""

from __future__ import annotations


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
