"""Activation offloading (PipeOffload) as a schedule transform: any schedule with some of its microbatches'
activations moved to host memory after their forward and back before their backward.

For each chosen (stage, microbatch), ``OF`` goes right after the action that runs its forward, and ``RL`` goes
``ahead`` computing actions before the one that runs its backward (B or BW), on the same device: the reload's copy
runs beside those actions, so that the backward finds its activations back. Both are copies on the host link
(:data:`pipefold.ir.KINDS`): they leave the device free to compute, and each direction copies one thing at a time.
Nothing else moves; the dependencies (a backward waits for its reload, a reload for its offload) keep every
device's order runnable wherever the original was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pipefold.errors import ConfigError
from pipefold.ir import Action, Kind, Schedule
from pipefold.ir.kinds import OF, RL

__all__ = ["offloadable_pairs", "offloaded_pairs", "with_offload"]

_BACKWARDS = (Kind.B, Kind.BW)


def offloadable_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """Every (stage, microbatch) whose activations an offload could move: those with a backward, not offloaded yet,
    in the order their forwards appear on their devices."""
    done = set(offloaded_pairs(schedule))
    backward = {(a.stage, a.microbatch) for row in schedule.actions for act in row for a in act.passes
                if a.kind in _BACKWARDS}
    out = []
    for row in schedule.actions:
        for act in row:
            for a in act.passes:
                pair = (a.stage, a.microbatch)
                if a.kind == Kind.F and pair in backward and pair not in done:
                    out.append(pair)
    return out


def offloaded_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """The (stage, microbatch)s the schedule offloads, in device order."""
    return [(a.stage, a.microbatch) for row in schedule.actions for a in row if a.kind == Kind.OF]


def with_offload(schedule: Schedule, pairs: Iterable[tuple[int, int]] | None = None, *,
                 ahead: int | Mapping[tuple[int, int], int] = 1) -> Schedule:
    """``schedule`` with the activations of ``pairs`` (every offloadable one when None) offloaded after their forward
    and reloaded ``ahead`` computing actions before their backward (0: just before it; a mapping: per pair, 1 for
    those it leaves out)."""
    for value in ahead.values() if isinstance(ahead, Mapping) else (ahead,):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"ahead is how many actions before its backward a reload starts: 0 or more "
                              f"(got {value!r})")
    candidates = offloadable_pairs(schedule)
    chosen = set(candidates) if pairs is None else set(pairs)
    unknown = sorted(chosen - set(candidates))
    if unknown:
        s, m = unknown[0]
        raise ConfigError(f"{schedule.name} cannot offload stage {s} microbatch {m}: it has no such forward with a "
                          f"backward, or offloads it already (offloadable: {len(candidates)} (stage, microbatch) "
                          "pairs)")
    rows: list[list[Action]] = []
    for row in schedule.actions:
        after: dict[int, list[Action]] = {}
        before: dict[int, list[Action]] = {}
        forward_at: dict[tuple[int, int], int] = {}
        computing: list[int] = []  # positions of the actions that occupy the device
        for i, act in enumerate(row):
            if act.parts or act.spec.computes:
                computing.append(i)
            for a in act.passes:
                pair = (a.stage, a.microbatch)
                if pair not in chosen:
                    continue
                if a.kind == Kind.F:
                    forward_at[pair] = i
                    after.setdefault(i, []).append(OF(*pair))
                elif a.kind in _BACKWARDS:
                    k = computing.index(i) if i in computing else len(computing)
                    early = ahead.get(pair, 1) if isinstance(ahead, Mapping) else ahead
                    at = computing[max(0, k - early)] if computing and early else i
                    at = max(at, forward_at[pair] + 1)
                    before.setdefault(at, []).append(RL(*pair))
        out: list[Action] = []
        for i, act in enumerate(row):
            out += before.get(i, [])
            out.append(act)
            out += after.get(i, [])
        rows.append(out)
    return schedule.with_actions(rows)
