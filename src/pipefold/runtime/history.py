"""What a rank keeps of its steps: a few numbers for every step, the full record only for the steps that need it.

A step's full record (:class:`~pipefold.runtime.executor.StepStats`: the timeline of its actions, its memory
curve, every message's timings) takes kilobytes, so a rank that kept every one grew by about 17 kB a step.
:class:`StepHistory` keeps

- for every step, in flat arrays of 8-byte numbers (about 70 bytes a step): the sum and count of its
  losses, its wall, busy and CPU seconds, its start, the seconds it waited on receives, the most bytes of
  activations it held, the schedule it ran and the policy's prediction;
- in full, the first ``keep_first`` steps (the first is the warm-up and what ``--check`` compares), any step
  asked for by number, and the latest step (the one tables and plots describe), replaced as the next comes.

Indexing gives a step's full record, and raises :class:`StepNotKept` (a LookupError, not an IndexError, so
that iteration cannot stop early in silence) for a step whose record was dropped; the columns hold every step.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar, overload

from pipefold.runtime.executor import StepStats

T = TypeVar("T")

KEEP_FIRST = 20
"""Steps kept in full from the start by default (a run of the CLI's default 20 steps keeps all of them)."""


def step_number(index: int) -> int:
    """The number a user sees for the step at 0-based ``index`` of a run, resumed steps counted: steps are numbered
    from 1 in every progress line, summary, error, warning and figure ('step 3/20', 'rank 1 hung in 1F0 of step 3'),
    and a checkpoint named ``step-N`` holds the weights after step N, so resuming from it runs step N + 1 next."""
    return index + 1


def unchecked(items: Sequence[T], checked: Sequence[bool]) -> list[T]:
    """Of steps (or what stands for them), those that ran plain, not checked as well (:attr:`StepStats.checked`:
    torch's MemTracker around every operation made such a step up to 1.7 times longer); where every one was
    checked, all of them. What every timing of steps reads: the run's measurement, K-FAC's placement again, the
    adaptive schedule's choice."""
    return [x for x, c in zip(items, checked, strict=True) if not c] or list(items)


class StepNotKept(LookupError):
    """The full record of this step was not kept; its numbers are in the history's columns."""


class StepHistory(Sequence[StepStats]):
    """One rank's steps: per-step numbers for all, full records for some (see the module's text)."""

    def __init__(self, keep_first: int = KEEP_FIRST, keep: Iterable[int] = ()) -> None:
        self.keep_first = keep_first
        self.keep = frozenset(keep)
        self._full: dict[int, StepStats] = {}
        self._count = 0
        self.loss_sum = array("d")
        """Per step: the sum of the losses this rank computed (0 where it computes none)."""
        self.loss_count = array("I")
        """Per step: how many losses (microbatches of the last stage) this rank computed."""
        self.wall = array("d")
        """Per step: seconds of the schedule, from this rank's start of the step to its last action's end."""
        self.update = array("d")
        """Per step: seconds after the schedule until the step was over (the check, the optimizer step)."""
        self.started_at = array("d")
        """Per step: wall-clock time this rank started it (:mod:`pipefold.runtime.clock`)."""
        self.busy = array("d")
        """Per step: seconds of computation (F, B, W and the like)."""
        self.cpu = array("d")
        """Per step: CPU seconds of the process, by the operating system's count."""
        self.wait = array("d")
        """Per step: seconds waiting on receives."""
        self.peak = array("q")
        """Per step: the most bytes of activations held at once (the meter's peak)."""
        self.predicted = array("d")
        """Per step: the step time the policy predicted (NaN: none)."""
        self.grad_norm = array("d")
        """Per step: the global gradient norm the step's check found (NaN: not checked, or not finite)."""
        self.clipped = array("b")
        """Per step: 1 where the gradients were clipped."""
        self.rolled_back = array("b")
        """Per step: 1 where an optimizer step taken before the check was rolled back (post-validation)."""
        self.checked = array("b")
        """Per step: 1 where the step ran checked as well (:attr:`StepStats.checked`), which times leave out."""
        self._schedule = array("H")
        self._schedules: list[str] = []

    def add(self, stats: StepStats) -> None:
        """Record the next step."""
        step = self._count
        self._count += 1
        self.loss_sum.append(math.fsum(stats.losses.values()))
        self.loss_count.append(len(stats.losses))
        self.wall.append(stats.wall)
        self.update.append(stats.update)
        self.started_at.append(stats.started_at)
        self.busy.append(stats.busy)
        self.cpu.append(stats.cpu)
        self.wait.append(math.fsum(e.end - e.start for e in stats.events if e.kind == "recv"))
        self.peak.append(stats.peak_activation_bytes)
        self.predicted.append(math.nan if stats.predicted is None else stats.predicted)
        self.grad_norm.append(math.nan if stats.grad_norm is None else stats.grad_norm)
        self.clipped.append(int(bool(stats.clipped)))
        self.rolled_back.append(int(bool(stats.rolled_back)))
        self.checked.append(int(bool(stats.checked)))
        if stats.schedule not in self._schedules:
            self._schedules.append(stats.schedule)
        self._schedule.append(self._schedules.index(stats.schedule))
        previous = step - 1
        if previous >= 0 and not self._wanted(previous):
            self._full.pop(previous, None)  # it was kept as the latest only
        self._full[step] = stats

    def _wanted(self, step: int) -> bool:
        return step < self.keep_first or step in self.keep

    def kept(self) -> list[int]:
        """The steps whose full record is kept, in order."""
        return sorted(self._full)

    def timed(self, warmup: int) -> list[int]:
        """The steps a timing reads: those after the first ``warmup`` (or else the last step) that ran plain
        (:func:`unchecked`)."""
        after = range(warmup, self._count) if self._count > warmup else range(self._count - 1, self._count)
        return unchecked(list(after), [bool(self.checked[i]) for i in after])

    def settled(self, warmup: int) -> list[int]:
        """The fully kept steps among those a timing reads (:meth:`timed`), or else the last kept one: what a
        measurement from the steps' timelines reads."""
        kept = set(self.kept())
        return [i for i in self.timed(warmup) if i in kept] or sorted(kept)[-1:]

    def schedule(self, step: int) -> str:
        """The schedule step ``step`` ran, as a spec (``kfkb:k=2``)."""
        return self._schedules[self._schedule[step]]

    def prediction(self, step: int) -> float | None:
        value = self.predicted[step]
        return None if math.isnan(value) else value

    @property
    def peak_activation_bytes(self) -> int:
        """The most bytes of activations held at once in any step."""
        return max(self.peak, default=0)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> StepStats: ...

    @overload
    def __getitem__(self, index: slice) -> list[StepStats]: ...

    def __getitem__(self, index: int | slice) -> StepStats | list[StepStats]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        step = index + self._count if index < 0 else index
        if not 0 <= step < self._count:
            raise IndexError(f"step {index} out of range: {self._count} steps ran")
        if step not in self._full:
            raise StepNotKept(f"the full record of step {step} was not kept (kept: the first {self.keep_first}, "
                              f"the last, and {sorted(self.keep) or 'no other'}); its figures are in the columns")
        return self._full[step]

    def __iter__(self) -> Iterator[StepStats]:
        for step in range(self._count):
            yield self[step]
