"""Phase helpers shared by the schedule families: warm-up, steady alternation, cool-down."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pipefold.ir import Action, ActionRows

Ints = npt.NDArray[np.int64]


def groups(items: Sequence[Action], size: int) -> list[list[Action]]:
    """Split ``items`` into consecutive groups of ``size`` (the last one may be shorter)."""
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def warmup_steady_cooldown(forwards: Sequence[Sequence[Action]], backwards: Sequence[Sequence[Action]],
                           warmup: int) -> list[Action]:
    """Order one device's passes the 1F1B way, in groups.

    - warm-up: the first ``warmup`` forward groups, filling the pipeline;
    - steady: one forward group, then one backward group, while forwards remain;
    - cool-down: the remaining backward groups, draining it.

    With groups of one this is 1F1B; with one group of all microbatches, GPipe.
    """
    warmup = min(warmup, len(forwards))
    order = [a for group in forwards[:warmup] for a in group]
    pending = list(backwards)
    for group in forwards[warmup:]:
        order += group  # 1 forward (group) ...
        order += pending.pop(0)  # ... 1 backward (group)
    for group in pending:
        order += group
    return order


def phases(*parts: tuple[Sequence[tuple[int, int]], int]) -> tuple[Ints, Ints]:
    """One device's passes from its phases: each a pattern of (kind, chunk) pairs repeated so many times (0 or
    less: none), as the (kind, chunk) columns of the passes in order."""
    kinds, chunks = [], []
    for pattern, times in parts:
        if times > 0 and pattern:
            kind, chunk = zip(*pattern, strict=True)
            kinds.append(np.tile(np.array(kind, dtype=np.int64), times))
            chunks.append(np.tile(np.array(chunk, dtype=np.int64), times))
    if not kinds:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(kinds), np.concatenate(chunks)


def counted_rows(codes: Sequence[str], rows: Sequence[tuple[Ints, Ints]], microbatches: int) -> ActionRows:
    """The :class:`ActionRows` of devices whose passes are given as (kind, stage) columns, ``kind`` indexing
    ``codes``: the microbatch of a pass is how many passes of its kind and stage came before it on its device (a
    stage takes the microbatches in order, each kind of pass in the same order). Passes of microbatches from
    ``microbatches`` on, which an order counted for more than there are holds, are left out: removing every pass
    of a microbatch keeps a schedule valid and can only lower what a device holds."""
    kinds, stages, numbers, lengths = [], [], [], []
    for kind, stage in rows:
        n = len(kind)
        key = stage * len(codes) + kind
        order = np.argsort(key, kind="stable")
        ordered = key[order]
        first = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
        number = np.empty(n, dtype=np.int64)
        number[order] = np.arange(n) - np.repeat(first, np.diff(np.append(first, n)))
        keep = number < microbatches
        kinds.append(kind[keep])
        stages.append(stage[keep])
        numbers.append(number[keep])
        lengths.append(int(keep.sum()))
    join = np.concatenate if rows else (lambda _: np.zeros(0, dtype=np.int64))
    return ActionRows(lengths, codes, join(kinds), join(stages), join(numbers))
