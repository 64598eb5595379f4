"""Phase helpers shared by the schedule families: warm-up, steady alternation, cool-down."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from pipefold.ir import NO_MICROBATCH, ActionRows, Kind

Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]

CODES = (Kind.F, Kind.B, Kind.W, Kind.BW, Kind.R)
"""The kinds the builders write, by number (:data:`F`, :data:`B`, :data:`W`, :data:`BW`, :data:`R`): what their
``kind`` columns hold for :func:`counted_rows`."""
F, B, W, BW, R = range(len(CODES))


def v_stage(p: int, d: int, chunk: Ints) -> Ints:
    """The stage of each chunk on device d of p in the V placement: chunk 0 is stage d, chunk 1 stage 2p-1-d."""
    return (2 * p - 1 - 2 * d) * chunk + d


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
    used = [(pattern, times) for pattern, times in parts if times > 0 and pattern]
    tokens = [t for pattern, _ in used for t in pattern]  # every pattern's passes, one after the other
    kind = np.array([t[0] for t in tokens], dtype=np.int64)
    chunk = np.array([t[1] for t in tokens], dtype=np.int64)
    paired = np.array([len(t) > 2 and bool(t[2]) for t in tokens], dtype=bool)
    # Pass i of the device is pass (i - start) mod L of its phase's pattern, which begins at ``first`` in tokens.
    lengths = np.array([len(pattern) for pattern, _ in used], dtype=np.int64)
    spans = lengths * np.array([times for _, times in used], dtype=np.int64)
    phase = np.repeat(np.arange(len(used)), spans)
    start, first = np.cumsum(spans) - spans, np.cumsum(lengths) - lengths
    at = first[phase] + (np.arange(int(spans.sum())) - start[phase]) % lengths[phase]
    return kind[at], chunk[at], paired[at]


def oldest_first(kind: Ints, chunk: Ints) -> Ints:
    """``chunk`` with each W's set to that of the oldest B before it whose W has not run: the chunks of the Bs, in
    order, for an order whose deferred Ws wait in one queue, whatever their chunk."""
    out = chunk.copy()
    weights = kind == W
    out[weights] = chunk[kind == B][:int(weights.sum())]
    return out


def counted_rows(rows: Sequence[tuple[Ints, Ints] | tuple[Ints, Ints, Bools]], microbatches: int, *,
                 takes: Callable[[int, int], Sequence[int]] | None = None, chunks: int = 1) -> ActionRows:
    """The :class:`ActionRows` of devices whose passes are given as (kind, stage) columns in order, ``kind``
    indexing :data:`CODES`, with a third column where some run in pairs: True where a pass runs together with the
    next one, as one overlapped action (DualPipe's F&B).

    The microbatches follow from the order, as every family takes them: a stage takes its microbatches in order,
    so the k-th forward of a stage on a device is for the k-th microbatch its replica there takes, and so is the
    k-th backward (B or BW); a W is for the oldest B of its stage whose W has not run. ``takes(device, stage)``
    lists the microbatches the stage's replica on that device takes, in order (by default all of them). Passes
    counted past the last of them (an order counted for more microbatches than there are) are left out: removing
    every pass of a microbatch keeps a schedule valid and can only lower what a device holds. Kinds without a
    microbatch (an all-reduce ``R``) have none.

    With ``chunks`` sequence chunks per microbatch the microbatches counted are units (chunk u mod c of microbatch
    u // c): forwards take them in order, and backwards each microbatch's chunks last first, as the gradients of a
    chunk's keys and values come from the chunks after it (:attr:`pipefold.ir.Schedule.seq_chunks`).
    """
    codes: tuple[str, ...] = CODES
    if any(len(row) > 2 and np.any(row[2]) for row in rows):
        codes = (*codes, Kind.FB)
    sizes = [len(row[0]) for row in rows]
    device = np.repeat(np.arange(len(rows)), sizes)
    kind = np.concatenate([row[0] for row in rows]) if rows else np.zeros(0, dtype=np.int64)
    stage = np.concatenate([row[1] for row in rows]) if rows else np.zeros(0, dtype=np.int64)
    paired = np.concatenate([row[2] if len(row) > 2 else np.zeros(len(row[0]), dtype=bool)
                             for row in rows]).astype(bool) if rows else np.zeros(0, dtype=bool)
    # All devices at once: a pass's key is its device and stage.
    key = device * (int(stage.max(initial=0)) + 1) + stage
    count = np.full(len(kind), NO_MICROBATCH, dtype=np.int64)
    for which in (kind == F, (kind == B) | (kind == BW)):
        count[which] = _ranks(key[which])
    if chunks > 1:  # the k-th backward of a stage: chunk c-1-k mod c of its microbatch
        backward = (kind == B) | (kind == BW)
        count[backward] += chunks - 1 - 2 * (count[backward] % chunks)
    weights = np.flatnonzero(kind == W)
    if len(weights):  # the k-th W of a device's stage takes the count of the k-th split B of that stage there
        split = np.flatnonzero(kind == B)
        by_key = split[np.argsort(key[split], kind="stable")]
        at = np.searchsorted(key[by_key], key[weights]) + _ranks(key[weights])
        its_b = by_key[np.minimum(at, len(by_key) - 1)] if len(by_key) else at
        bad = (at >= len(by_key)) | (key[its_b] != key[weights]) | (its_b > weights) if len(by_key) else at >= 0
        if bad.any():
            raise ValueError(f"device {int(device[weights[np.argmax(bad)]])} runs a W before the B of its stage and "
                             "microbatch")
        count[weights] = count[its_b]
    microbatch, keep = count.copy(), count < microbatches
    if takes is not None:
        counted = np.flatnonzero(count >= 0)
        for k in np.unique(key[counted]).tolist():
            here = counted[key[counted] == k]
            taken = np.asarray(takes(int(device[here[0]]), int(stage[here[0]])), dtype=np.int64)
            keep[here] = count[here] < len(taken)
            microbatch[here[keep[here]]] = taken[count[here[keep[here]]]]
    if not keep.all():
        if paired.any():
            _check_pairs_kept(paired, keep, device, sizes)
        kind, stage, microbatch, paired, device = kind[keep], stage[keep], microbatch[keep], paired[keep], device[keep]
        sizes = np.bincount(device, minlength=len(rows)).tolist()
    if not paired.any():  # one pass an action
        return ActionRows(sizes, codes, kind, stage, microbatch)
    second = _check_pairs_kept(paired, np.ones(len(paired), dtype=bool), device, sizes)
    first = ~second  # the first pass of each action
    action = np.cumsum(first) - 1
    alone = first & ~paired
    together = ~alone[np.flatnonzero(first)][action]  # the passes of an action with parts
    parts = (action[together], kind[together], stage[together], microbatch[together])
    return ActionRows(np.bincount(device[first], minlength=len(rows)).tolist(), codes,
                      np.where(alone, kind, len(CODES))[first], np.where(alone, stage, -1)[first],
                      np.where(alone, microbatch, NO_MICROBATCH)[first], parts=parts)


def _check_pairs_kept(paired: Bools, keep: Bools, device: Ints, sizes: Sequence[int]) -> Bools:
    """The passes that run together with the one before them on their device; raises where a pass is paired with
    one past its device's last, or where either pass of a pair is left out."""
    last = np.cumsum(sizes, dtype=np.int64)[np.asarray(sizes, dtype=np.int64) > 0] - 1  # each device's last pass
    second = np.zeros_like(paired)
    second[1:] = paired[:-1]
    second[last[:-1] + 1] = False
    wrong = np.flatnonzero(~keep & (paired | second))
    if paired[last].any() or len(wrong):
        there = int(wrong[0]) if len(wrong) else int(last[np.argmax(paired[last])])
        raise ValueError(f"device {int(device[there])}: a pass runs together with a next one that is not there")
    return second


def _ranks(keys: Ints) -> Ints:
    """Each entry's place among the entries before it with an equal key: 0 for the first of its key, then 1, ..."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    first = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    ranks = np.empty(n, dtype=np.int64)
    ranks[order] = np.arange(n) - np.repeat(first, np.diff(np.append(first, n)))
    return ranks
