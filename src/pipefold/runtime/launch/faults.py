"""Faults injected into a real run, for the tests of what pipefold does when things go wrong: a rank that dies at
a step or while it saves a checkpoint, a NaN in a step's input, a slow commit of a checkpoint.

A :class:`Faults` value rides on the job (``Job.faults``). Nothing in pipefold makes one and no environment
variable is read for it: a test puts it on a job it builds, or, for a run made by the command line, adds a hook to
:data:`pipefold.train.prepare.JOB_HOOKS` (``tests/faulty.py`` runs the command so, also under torchrun).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Faults"]


@dataclass(frozen=True)
class Faults:
    """Steps are counted as users see them (:func:`~pipefold.runtime.history.step_number`: from 1)."""

    die: tuple[int, str] | None = None
    """(N, "step"): the last rank exits (code 13) as step N starts; (N, "save"): it is killed (SIGKILL) while it
    saves the checkpoint of step N (its files written, the checkpoint not yet committed)."""
    nan: frozenset[int] = frozenset()
    """Steps whose microbatch 0 gets a NaN in its first input (a model with float inputs)."""
    slow_commit: float = 0.0
    """Seconds rank 0 waits before it commits each checkpoint (a slow disk), every rank's files written."""
