"""A schedule named as people write it: a family and its integer options, ``kfkb:k=3``, ``v-block:f0=2,b0=3``.

The one way a name with options is read and written: on the command line (``--schedule``), in plan files and
per-step reports, in figures' titles and in the planner's frontier. Options keep the order they are given in
(a family's own order, when it made them), so a name reads as the family declares it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipefold.errors import ConfigError
from pipefold.ir.kinds import MAX_STAGE_MICROBATCHES

if TYPE_CHECKING:
    from pipefold.ir import Schedule

__all__ = ["ScheduleRef"]


@dataclass(frozen=True)
class ScheduleRef:
    """A schedule family's name and its options, in order."""

    name: str
    """The family, as registered (``kfkb``), or a file's name."""
    options: tuple[tuple[str, Any], ...] = ()
    """(option, value) pairs, in order; values are integers where the text was read."""

    @classmethod
    def named(cls, name: str, options: Mapping[str, Any] | None = None) -> ScheduleRef:
        """``ScheduleRef.named('kfkb', {'k': 3})``."""
        return cls(name, tuple((options or {}).items()))

    @classmethod
    def of(cls, schedule: Schedule) -> ScheduleRef:
        """The name and options a built (or loaded) schedule carries."""
        return cls.named(schedule.name, schedule.options)

    @classmethod
    def parse(cls, text: str) -> ScheduleRef:
        """``'kfkb:k=3'`` -> ScheduleRef('kfkb', (('k', 3),)); a bare name has no options. Every value is an
        integer; a malformed option is one ConfigError naming it."""
        name, _, rest = text.partition(":")
        options: dict[str, int] = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise ConfigError(f"cannot read option {item!r} in {text!r}: use name:key=value,... e.g. kfkb:k=3")
            try:
                options[key.strip()] = int(value)
            except ValueError:
                raise ConfigError(f"option {key.strip()} in {text!r} must be an integer (got {value!r})") from None
            if not 0 <= options[key.strip()] <= MAX_STAGE_MICROBATCHES:
                raise ConfigError(f"option {key.strip()} in {text!r} is out of range: give a whole number from 0 to "
                                  f"{MAX_STAGE_MICROBATCHES:,}")
        return cls.named(name, options)

    @property
    def kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of the family's builder."""
        return dict(self.options)

    def option(self, key: str, default: Any) -> Any:
        """One option's value, or ``default`` where it is not given."""
        return self.kwargs.get(key, default)

    def __str__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name}:{opts}" if opts else self.name
