"""Phase helpers shared by the schedule families: warm-up, steady alternation, cool-down."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from pipefold.ir import NO_MICROBATCH, ActionRows, Kind

Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


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


def phases(*parts: tuple[Sequence[tuple[int, ...]], int]) -> tuple[Ints, Ints, Bools]:
    """One device's passes from its phases: each a pattern of (kind, chunk) pairs repeated so many times (0 or
    less: none), as the (kind, chunk, paired) columns of the passes in order. A pass given as (kind, chunk, 1)
    runs together with the next one, as one overlapped action (DualPipe's F&B)."""
    kinds, chunks, paired = [], [], []
    for pattern, times in parts:
        if times > 0 and pattern:
            kinds.append(np.tile(np.array([t[0] for t in pattern], dtype=np.int64), times))
            chunks.append(np.tile(np.array([t[1] for t in pattern], dtype=np.int64), times))
            paired.append(np.tile(np.array([len(t) > 2 and bool(t[2]) for t in pattern]), times))
    if not kinds:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    return np.concatenate(kinds), np.concatenate(chunks), np.concatenate(paired)


def oldest_first(kind: Ints, chunk: Ints, b: int, w: int) -> Ints:
    """``chunk`` with each W's (kind ``w``) set to that of the oldest B (kind ``b``) before it whose W has not run:
    the chunks of the Bs, in order, for an order whose deferred Ws wait in one queue, whatever their chunk."""
    out = chunk.copy()
    weights = kind == w
    out[weights] = chunk[kind == b][:int(weights.sum())]
    return out


def counted_rows(codes: Sequence[str], rows: Sequence[tuple[Ints, Ints] | tuple[Ints, Ints, Bools]],
                 microbatches: int, *, takes: Callable[[int, int], Sequence[int]] | None = None) -> ActionRows:
    """The :class:`ActionRows` of devices whose passes are given as (kind, stage) columns in order, ``kind``
    indexing ``codes``, with a third column where some run in pairs: True where a pass runs together with the
    next one, as one overlapped action (DualPipe's F&B).

    The microbatches follow from the order, as every family takes them: a stage takes its microbatches in order,
    so the k-th forward of a stage on a device is for the k-th microbatch its replica there takes, and so is the
    k-th backward (B or BW); a W is for the oldest B of its stage whose W has not run. ``takes(device, stage)``
    lists the microbatches the stage's replica on that device takes, in order (by default all of them). Passes
    counted past the last of them (an order counted for more microbatches than there are) are left out: removing
    every pass of a microbatch keeps a schedule valid and can only lower what a device holds. Kinds without a
    microbatch (an all-reduce ``R``) have none.
    """
    codes = tuple(codes)
    if any(len(row) > 2 and np.any(row[2]) for row in rows) and Kind.FB not in codes:
        codes = (*codes, Kind.FB)
    number = {code: k for k, code in enumerate(codes)}
    f, b, bw, w = (number.get(code, -1) for code in (Kind.F, Kind.B, Kind.BW, Kind.W))
    columns: list[list[Ints]] = [[] for _ in range(7)]  # kind, stage, microbatch; the parts' owner and columns
    lengths, offset = [], 0
    for device, (kind, stage, *more) in enumerate(rows):
        count = np.full(len(kind), NO_MICROBATCH, dtype=np.int64)
        for which in (kind == f, (kind == b) | (kind == bw)):
            count[which] = _ranks(stage[which])
        weights = kind == w
        if weights.any():  # the k-th W of a stage takes the count of the k-th split B of that stage
            split = np.flatnonzero(kind == b)
            by_stage = split[np.argsort(stage[split], kind="stable")]
            at = np.searchsorted(stage[by_stage], stage[weights]) + _ranks(stage[weights])
            its_b = by_stage[np.minimum(at, len(by_stage) - 1)] if len(by_stage) else at
            if np.any(at >= len(by_stage)) or np.any(stage[its_b] != stage[weights]) or np.any(
                    its_b > np.flatnonzero(weights)):
                raise ValueError(f"device {device} runs a W before the B of its stage and microbatch")
            count[weights] = count[its_b]
        microbatch, keep = count.copy(), count < microbatches
        if takes is not None:
            for s in np.unique(stage[count >= 0]).tolist():
                taken = np.asarray(takes(device, s), dtype=np.int64)
                here = (stage == s) & (count >= 0)
                keep[here] = count[here] < len(taken)
                microbatch[here & keep] = taken[count[here & keep]]
        paired = more[0].astype(bool) if more else np.zeros(len(kind), dtype=bool)
        second = np.zeros_like(paired)  # the passes that run together with the one before
        second[1:] = paired[:-1]
        if paired[-1:].any() or np.any(~keep & (paired | second)):
            raise ValueError(f"device {device}: a pass runs together with a next one that is not there")
        kind, stage, microbatch, paired = kind[keep], stage[keep], microbatch[keep], paired[keep]
        first = ~second[keep]  # the first pass of each action
        action = np.cumsum(first) - 1
        alone = first & ~paired
        n = int(first.sum())
        columns[0].append(np.where(alone, kind, number.get(Kind.FB, -1))[first])
        columns[1].append(np.where(alone, stage, -1)[first])
        columns[2].append(np.where(alone, microbatch, NO_MICROBATCH)[first])
        together = ~alone[np.flatnonzero(first)][action]  # the passes of an action with parts
        for column, values in zip(columns[3:], (action + offset, kind, stage, microbatch), strict=True):
            column.append(values[together])
        lengths.append(n)
        offset += n
    joined = [np.concatenate(c) if c else np.zeros(0, dtype=np.int64) for c in columns]
    kind, stage, microbatch, *parts = joined
    return ActionRows(lengths, codes, kind, stage, microbatch, parts=(parts[0], parts[1], parts[2], parts[3]))


def _ranks(keys: Ints) -> Ints:
    """Each entry's place among the entries before it with an equal key: 0 for the first of its key, then 1, ..."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    first = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    ranks = np.empty(n, dtype=np.int64)
    ranks[order] = np.arange(n) - np.repeat(first, np.diff(np.append(first, n)))
    return ranks
