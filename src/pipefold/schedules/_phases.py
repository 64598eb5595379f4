"""Phase helpers shared by the schedule families: warm-up, steady alternation, cool-down."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pipefold.ir import ActionRows

Ints = npt.NDArray[np.int64]


def warmup_steady_cooldown(forwards: tuple[Ints, Ints], backwards: tuple[Ints, Ints], warmup: int,
                           size: int = 1) -> tuple[Ints, Ints]:
    """Order one device's passes the 1F1B way, in groups of ``size`` (the last one may be shorter): the forwards
    and the backwards, as many of each, given as (kind, stage) columns in their own order.

    - warm-up: the first ``warmup`` forward groups, filling the pipeline;
    - steady: one forward group, then one backward group, while forwards remain;
    - cool-down: the remaining backward groups, draining it.

    With groups of one this is 1F1B; with one group of all microbatches, GPipe.
    """
    n = len(forwards[0])
    groups = -(-n // size)
    w = max(0, min(warmup, groups))
    group = np.arange(n) // size
    # Each group's place among the blocks of the order: warm-up forwards 0..w-1, then forward and backward groups
    # by turns, then the backward groups left.
    at_f = np.where(group < w, group, 2 * group - w)
    at_b = np.where(group < groups - w, 2 * group + w + 1, groups + group)
    order = np.argsort(np.concatenate((at_f, at_b)), kind="stable")
    return (np.concatenate((forwards[0], backwards[0]))[order], np.concatenate((forwards[1], backwards[1]))[order])


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
