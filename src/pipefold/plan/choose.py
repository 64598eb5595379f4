"""Which schedule a pipeline runs, from what a user gives: a name with options, a file, a :class:`Schedule`, or
``auto`` (every registered schedule with a given placement, to be predicted from a measured step).

The runtime's public object (:class:`pipefold.runtime.pipeline.Pipeline`) reads schedules through here and the IR,
never the registry itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pipefold.errors import ConfigError, PipefoldError
from pipefold.ir import Kind, Schedule, validate
from pipefold.schedules.dataparallel import with_data_parallel

__all__ = ["candidates_for", "probe", "resolve_schedule", "with_data_parallel"]


def resolve_schedule(schedule: str | Schedule | os.PathLike[str], devices: int, microbatches: int | None) -> Schedule:
    """A schedule from what a user may give: a name with options (``kfkb:k=2``), a :class:`Schedule`, or a file
    (any format :func:`pipefold.ir.load` reads); checked against the pipeline's devices and microbatches."""
    from pipefold.ir import load
    from pipefold.ir.ref import ScheduleRef
    from pipefold.schedules import build, looks_like_file, names

    if isinstance(schedule, Schedule):
        built, where = schedule, f"the schedule {schedule.name}"
    else:
        text = os.fspath(schedule)
        ref = ScheduleRef.parse(text) if ":" in text and not os.path.exists(text) else ScheduleRef(text)
        if ref.name in names():
            if microbatches is None:
                raise ConfigError(f"{text} needs the number of microbatches: Pipeline(..., microbatches=N)")
            return validate(build(ref.name, devices, microbatches, **ref.kwargs))
        if not (os.path.exists(text) or looks_like_file(text)):
            raise ConfigError(f"unknown schedule {text!r}: use one of {', '.join(names())}, a Schedule or a file")
        if not os.path.isfile(text):
            raise ConfigError(f"schedule file {text} does not exist")
        built, where = load(text), f"the schedule file {text}"
    if built.devices != devices:
        raise ConfigError(f"{where} is for {built.devices} devices, but the pipeline's process group has {devices} "
                          f"ranks: give a schedule for {devices} devices, or run {built.devices} ranks")
    if microbatches is not None and built.data_microbatches != microbatches:
        raise ConfigError(f"{where} runs {built.data_microbatches} microbatches, not {microbatches}: leave out "
                          "microbatches= or give a matching schedule")
    return validate(built)


def candidates_for(placement: Sequence[int], devices: int, microbatches: int) -> list[Schedule]:
    """Every registered schedule (and option in its search space) that runs ``microbatches`` on ``devices`` with
    ``placement`` (one replica), made of passes only (no OPT, no K-FAC's work); refused in one line, before any is
    built, where building them all would be over the search limit (:func:`pipefold.plan.budget.check_evaluate`)."""
    from pipefold.plan.budget import candidates, check_evaluate
    from pipefold.schedules import build

    check_evaluate(devices, microbatches)
    out = []
    passes = {Kind.F, Kind.B, Kind.W, Kind.BW}
    for name, options in candidates(devices, microbatches):
        try:
            built = build(name, devices, microbatches, **options)
        except PipefoldError:
            continue
        if (built.replicas == 1 and built.placement[0] == tuple(placement)
                and all(a.kind in passes for row in built.actions for act in row for a in act.passes)):
            out.append(validate(built))
    if not out:
        stages = len(placement) // devices
        raise ConfigError(f"no registered schedule runs {microbatches} microbatches on {devices} devices with "
                          f"{stages} stage{'s' * (stages > 1)} a device: try more microbatches")
    return out


def probe(candidates: Sequence[Schedule]) -> Schedule:
    """The schedule ``auto``'s first step runs: one that splits B and W (both get measured), fastest in theory."""
    split = [c for c in candidates if any(a.kind == Kind.W for row in c.actions for act in row for a in act.passes)]
    preferred = ("zb-h1", "zb-v", "interleaved-zb")
    return min(split or candidates, key=lambda c: (c.name not in preferred, c.num_actions, c.name))
