"""Automatic partitioning: measure what each layer costs, then split the layers into balanced contiguous stages.

The split is optimal, not a heuristic: it minimises the largest part cost (or, given a placement of
stages on devices, the largest device load, the sum of that device's chunks)::

    costs  3 1 1 2 2 1 4            parts [0..1] [2..4] [5..6]
    split  [3 1] [1 2 2] [1 4]      cost  4      5      5       bottleneck 5
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from pipefold.errors import ConfigError
from pipefold.ir import KINDS, Action, Schedule, looped_placement, v_placement
from pipefold.sim.simulate import StageCost, memory_deltas, peak_by_order

if TYPE_CHECKING:  # measuring needs torch; splitting measured figures does not (the planner loads without it)
    import torch

    Values = tuple[torch.Tensor, ...]
    """What flows between layers: one tensor, or several (a layer may return a tuple, spread into the next)."""

__all__ = ["COST_KINDS", "LayerFigures", "MemoryPartition", "Partition", "memory_of_split", "partition",
           "memory_of_split_on_devices", "partition_memory", "partition_memory_on_devices", "partition_on_devices",
           "split_by"]

COST_KINDS = ("params", "time", "memory")
"""What a layer's cost can measure."""

_EPS = 1e-12


@dataclass(frozen=True)
class Partition:
    """A contiguous split of layers into parts (stages or chunks) and what each part and device costs."""

    boundaries: list[int]
    """First layer index of each part; starts at 0."""
    parts: list[list[int]]
    """Layer indices of each part: contiguous, covering every layer once."""
    cost: list[float]
    """Summed layer cost of each part."""
    device_cost: list[float]
    """Summed cost of each device's parts under the placement; equal to ``cost`` without one."""
    bottleneck: float
    """The largest device cost: what the split minimises."""
    placement: tuple[int, ...] | None = None
    """Device of each part, when one was given."""


# --------------------------------------------------------------------------- splitting


def partition(costs: Sequence[float], parts: int, *, placement: Sequence[int] | None = None) -> Partition:
    """The contiguous split of ``costs`` into ``parts`` that minimises the largest part (or device) cost.

    With ``placement`` (the device of each part, ``len(placement) == parts``) the objective is the
    largest device load: e.g. under ``v_placement(p)`` device d holds parts d and 2p-1-d.
    """
    values = [float(c) for c in costs]
    n = len(values)
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ConfigError(f"number of stages must be a positive integer (got {parts!r})")
    if parts > n:
        raise ConfigError(f"cannot split {n} layers into {parts} stages: at most {n}")
    if any(c < 0 or c != c for c in values):
        raise ConfigError("layer costs must be non-negative numbers")
    mapping = _check_placement(placement, parts)
    prefix = [0.0]
    for c in values:
        prefix.append(prefix[-1] + c)
    if mapping is None or len(set(mapping)) == len(mapping):
        bounds = _minmax_dp([prefix] * parts, parts)  # one part per device: device loads are the part costs
    elif mapping == v_placement(parts // 2):
        bounds = _v_dp([prefix] * (parts // 2), parts // 2)
    elif mapping == looped_placement(parts // 2, 2):
        bounds = _looped_dp(prefix, parts // 2)
    else:
        bounds = _branch_and_bound([prefix] * (max(mapping) + 1), mapping)
    return _result(values, prefix, bounds, mapping)


def partition_on_devices(costs: Sequence[Sequence[float]], placement: Sequence[int] | None = None) -> Partition:
    """The contiguous split of the layers into parts that minimises the largest device cost, where a layer costs
    what its device makes of it: ``costs[d][i]`` is layer i's cost on device d (devices that split their layers
    over different numbers of ranks run the same layer in different times).

    ``placement`` gives each part's device (default: part d on device d): one part per device in any order, the V
    placement (device d holds parts d and 2p-1-d, :func:`pipefold.ir.v_placement`) or any other (an interleaved
    one); exact for all, polynomial for the first two."""
    rows = [[float(c) for c in row] for row in costs]
    if not rows or any(len(row) != len(rows[0]) for row in rows):
        raise ConfigError("give each device the cost of every layer on it: one row per device, all of one length")
    n, p = len(rows[0]), len(rows)
    mapping = _check_placement(placement, len(placement) if placement is not None else p) or tuple(range(p))
    if any(d >= p for d in mapping):
        raise ConfigError(f"the placement names device {max(mapping)}, but costs are given for {p} devices")
    if len(mapping) > n:
        raise ConfigError(f"cannot split {n} layers into {len(mapping)} stages: at most {n}")
    if any(c < 0 or c != c for row in rows for c in row):
        raise ConfigError("layer costs must be non-negative numbers")
    prefixes = [[0.0, *itertools.accumulate(row)] for row in rows]
    if len(set(mapping)) == len(mapping):
        bounds = _minmax_dp([prefixes[d] for d in mapping], len(mapping))
    elif len(mapping) == 2 * p and mapping == v_placement(p):
        bounds = _v_dp(prefixes, p)
    else:  # any other placement (interleaved): exact, by branch and bound
        bounds = _branch_and_bound(prefixes, mapping)
    ends = bounds[1:] + [n]
    cost = [prefixes[d][hi] - prefixes[d][lo] for d, lo, hi in zip(mapping, bounds, ends, strict=True)]
    device_cost = [0.0] * p
    for d, c in zip(mapping, cost, strict=True):
        device_cost[d] += c
    return Partition(boundaries=bounds, parts=[list(range(lo, hi)) for lo, hi in zip(bounds, ends, strict=True)],
                     cost=cost, device_cost=device_cost, bottleneck=max(device_cost),
                     placement=None if placement is None else mapping)


def _check_placement(placement: Sequence[int] | None, parts: int) -> tuple[int, ...] | None:
    if placement is None:
        return None
    mapping = tuple(placement)
    if len(mapping) != parts:
        raise ConfigError(f"the placement lists {len(mapping)} devices but there are {parts} stages: "
                          "give one device per stage")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in mapping):
        raise ConfigError(f"placement devices must be non-negative integers (got {list(mapping)})")
    return mapping


def _result(values: list[float], prefix: list[float], bounds: list[int], mapping: tuple[int, ...] | None) -> Partition:
    ends = bounds[1:] + [len(values)]
    cost = [prefix[hi] - prefix[lo] for lo, hi in zip(bounds, ends, strict=True)]
    if mapping is None:
        device_cost = list(cost)
    else:
        device_cost = [0.0] * (max(mapping) + 1)
        for part, device in enumerate(mapping):
            device_cost[device] += cost[part]
    return Partition(boundaries=bounds, parts=[list(range(lo, hi)) for lo, hi in zip(bounds, ends, strict=True)],
                     cost=cost, device_cost=device_cost, bottleneck=max(device_cost), placement=mapping)


_CELLS = 1 << 22
"""The most (j, i) pairs :func:`_minmax_dp` weighs at once (32 MiB of floats)."""


def _minmax_dp(each: list[list[float]], parts: int) -> list[int]:
    """Boundaries minimising the largest part: best[k][j] = min over i of max(best[k-1][i], sum(i..j)), part k's
    sum taken from its own prefix sums ``each[k]``; of the i that do, the first, where an i within :data:`_EPS`
    of the best does not count as better (as a scan of i upwards keeps the best so far unless beaten by more than
    that). Each row of i is weighed at once, many rows together; the scan itself runs only on a row where two
    values lie within :data:`_EPS` of each other without being equal, where the two rules could differ."""
    n = len(each[0]) - 1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        pre, before = each[k - 1], best[k - 1]
        pre_np, before_np = np.asarray(pre, dtype=float), np.asarray(before, dtype=float)
        first, last = k, n - (parts - k)  # the j of this row
        ii = np.arange(k - 1, last)  # every i any of them weighs
        rows = max(1, _CELLS // max(1, len(ii)))
        for lo in range(first, last + 1, rows):
            jj = np.arange(lo, min(lo + rows, last + 1))
            value = np.maximum(before_np[ii][None, :], pre_np[jj][:, None] - pre_np[ii][None, :])
            value[ii[None, :] >= jj[:, None]] = inf  # i < j only
            least = value.min(axis=1)
            at = value.argmin(axis=1)
            close = ((value > least[:, None]) & ~(least[:, None] < value - _EPS)).any(axis=1)
            for row, j in enumerate(jj.tolist()):
                if close[row]:  # near ties: the scan's own rule
                    for i in range(k - 1, j):
                        v = max(before[i], pre[j] - pre[i])
                        if v < best[k][j] - _EPS:
                            best[k][j], back[k][j] = v, i
                elif least[row] < inf:
                    best[k][j], back[k][j] = float(least[row]), int(ii[at[row]])
    bounds, j = [], n
    for k in range(parts, 0, -1):
        j = back[k][j]
        bounds.append(j)
    return bounds[::-1]


def _v_dp(prefixes: list[list[float]], p: int) -> list[int]:
    """Exact split for the V placement: the least largest device load (see :func:`_pair_dp`), device d's chunks
    costed from its own prefix sums ``prefixes[d]``."""
    pres = [np.asarray(x) for x in prefixes]

    def load(d: int, lo: int, hi: int, _ok: np.ndarray) -> np.ndarray:
        pre = pres[d]
        return (pre[:, None] - pre[lo]) + (pre[hi] - pre[None, :])  # [l2, r2]: chunks lo..l2-1 and r2..hi-1

    n = len(pres[0]) - 1
    value, trace = _pair_dp(n, p, (0, n), _v_moves(n, p), load)
    return _v_bounds(trace(*_v_end(value)))


def _looped_dp(prefix: list[float], p: int) -> list[int]:
    """Exact split for the looped placement with two chunks per device (see :func:`_pair_dp`).

    Every first layer x of chunk p is tried. Loads above a cap are cut off, which keeps the states
    few; the cap starts just above the even share and grows until a split fits under it, up to the
    load of the balanced split that ignores the placement, which always fits.
    """
    pre = np.asarray(prefix)
    n = len(prefix) - 1
    upper = max(_loads([prefix] * p, _minmax_dp([prefix] * (2 * p), 2 * p), looped_placement(p, 2), p))
    share = max(pre[n] / p, float(np.max(np.diff(pre), initial=0.0)))  # no split does better
    caps = [c for c in (share * 1.01, share * 1.04, share * 1.16, share * 1.64) if c < upper] + [upper]
    for cap in (c * (1 + _REL) + _EPS for c in caps):

        def load(d: int, a: int, b: int, _ok: np.ndarray, x: int, cap: float = cap) -> np.ndarray:
            # [a2, b2]: chunks a..a2-1 and b..b2-1, and what is left must fit on the later devices
            loads = (pre[:, None] - pre[a]) + (pre[None, :] - pre[b])
            left = (pre[x] - pre[:, None]) + (pre[n] - pre[None, :])
            return np.where((loads <= cap) & (left <= (p - 1 - d) * cap), loads, np.inf)

        best, bounds = np.inf, list(range(2 * p))
        for x in range(p, n - p + 1):
            value, trace = _pair_dp(n, p, (0, x), _looped_moves(n, p, x), functools.partial(load, x=x))
            if value[x, n] < best - _EPS:
                best, bounds = value[x, n], _looped_bounds(trace(x, n), x)
        if np.isfinite(best):
            return bounds
    raise AssertionError("the balanced split's load always fits")


# Two chunks per device (the V placement; looped with v=2) make a polynomial DP: device by device,
# each device's chunks advance two positions (l, r) over the layers, and a device's cost depends on its
# own two chunks only, so the state after device d is (l, r):
#
#   V (d holds chunks d, 2p-1-d), from both ends inwards:
#       |-chunk 0-|-chunk 1-| ... |-chunk 2p-2-|-chunk 2p-1-|        (l, r): the window still to place
#       0         l                            r            n
#   looped (d holds chunks d, p+d), side by side from 0 and from x, the first layer of chunk p:
#       |-chunk 0-|-chunk 1-| ... |-chunk p-|-chunk p+1-| ...        (l, r): the next layer of each run
#       0         l               x         r                  n

DeviceCost = Callable[[int, int, int, np.ndarray], np.ndarray]
"""``cost(d, l, r, ok)``: device d's cost for every next state (l2, r2) from (l, r), an (n+1, n+1) array;
only entries where the mask ``ok`` holds are read, and inf marks a move not allowed."""

Moves = Callable[[int, int, int], np.ndarray]
"""``moves(d, l, r)``: the (n+1, n+1) mask of the states (l2, r2) device d may move (l, r) to."""


def _pair_dp(n: int, p: int, start: tuple[int, int], moves: Moves,
             cost: DeviceCost) -> tuple[np.ndarray, Callable[[int, int], list[tuple[int, int]]]]:
    """Least largest device cost for each final state, and a trace of the states that reach one.

    ``value[l, r]`` is the least largest cost of devices 0..p-1 that ends in (l, r); ``trace(l, r)``
    lists the states after devices 0..p-1 on the way there.
    """
    inf = np.inf
    value = np.full((n + 1, n + 1), inf)
    value[start] = 0.0
    backs: list[np.ndarray] = []
    for d in range(p):
        new = np.full((n + 1, n + 1), inf)
        back = np.zeros((n + 1, n + 1, 2), dtype=np.int64)
        for lo, hi in zip(*np.nonzero(np.isfinite(value)), strict=True):
            ok = moves(d, int(lo), int(hi))
            cand = np.where(ok, np.maximum(value[lo, hi], cost(d, int(lo), int(hi), ok)), inf)
            better = cand < new - _EPS
            new = np.where(better, cand, new)
            back[better] = (lo, hi)
        value = new
        backs.append(back)

    def trace(lo: int, hi: int) -> list[tuple[int, int]]:
        states = [(lo, hi)]
        for back in reversed(backs[1:]):
            lo, hi = int(back[lo, hi, 0]), int(back[lo, hi, 1])
            states.append((lo, hi))
        return states[::-1]

    return value, trace


def _v_moves(n: int, p: int) -> Moves:
    idx = np.arange(n + 1)

    def moves(d: int, lo: int, hi: int) -> np.ndarray:
        # lo < l2, r2 < hi, r2 - l2 >= the chunks left inside; the last device's two chunks meet (l2 == r2)
        rest = 2 * p - 2 - 2 * d
        ok = (idx[:, None] > lo) & (idx[None, :] < hi)
        return ok & ((idx[None, :] - idx[:, None] >= rest) if rest else (idx[None, :] == idx[:, None]))

    return moves


def _v_end(value: np.ndarray) -> tuple[int, int]:
    mid = int(np.argmin(np.diagonal(value)))
    return mid, mid


def _v_bounds(states: list[tuple[int, int]]) -> list[int]:
    # states[d] = (first layer of chunk d+1, first layer of chunk 2p-1-d)
    return [0] + [lo for lo, _ in states] + [hi for _, hi in states[-2::-1]]


def _looped_moves(n: int, p: int, x: int) -> Moves:
    idx = np.arange(n + 1)

    def moves(d: int, a: int, b: int) -> np.ndarray:
        rest = p - 1 - d  # chunks left on each run afterwards, one layer at least each
        if rest == 0:
            return (idx[:, None] == x) & (idx[None, :] == n)
        return (idx[:, None] > a) & (idx[:, None] <= x - rest) & (idx[None, :] > b) & (idx[None, :] <= n - rest)

    return moves


def _looped_bounds(states: list[tuple[int, int]], x: int) -> list[int]:
    # states[d] = (first layer of chunk d+1, first layer of chunk p+d+1)
    return [0] + [a for a, _ in states[:-1]] + [x] + [b for _, b in states[:-1]]


def _branch_and_bound(pres: list[list[float]], mapping: tuple[int, ...]) -> list[int]:
    """Exact split for any placement: depth-first over boundaries, pruned by the best load found so far; device d's
    chunks are costed from its own prefix sums ``pres[d]``.

    Exponential in the worst case; quick for near-uniform costs (it stops once a split reaches the even
    share) and for a few chunks per device. The V and two-chunk looped placements have polynomial searches.
    """
    devices = max(mapping) + 1
    n, parts = len(pres[0]) - 1, len(mapping)
    start = _minmax_dp([pres[d] for d in mapping], parts)  # a good first answer: the balanced split of the parts
    best_bounds = start
    best = max(_loads(pres, start, mapping, devices))
    @functools.cache
    def cheapest(among: frozenset[int]) -> list[float]:
        """Prefix sums of each layer's least cost on any of the devices ``among``: no split costs them less."""
        return [float(x) for x in _least_prefix([pres[d] for d in sorted(among)])]

    used = frozenset(mapping)
    floor = cheapest(used)[n] / len(used)  # no split beats the even share of the least work
    loads = [0.0] * devices
    bounds = [0]
    # Per part: the devices that can still take layers after it, and the least the layers left cost on them.
    later = [tuple(sorted(set(mapping[s + 1:]))) for s in range(parts)]
    least_later = [cheapest(frozenset(e)) if e else [] for e in later]

    def search(s: int, i: int) -> bool:
        nonlocal best, best_bounds
        if s == parts - 1:
            d = mapping[s]
            top = max(max(loads), loads[d] + pres[d][n] - pres[d][i])
            if top < best - _EPS:
                best, best_bounds = top, list(bounds)
            return best <= floor + _EPS
        d = mapping[s]
        pre = pres[d]
        takers, least = later[s], least_later[s]
        held = sum(loads[e] for e in takers)  # the loads stay so at each turn of the loop (put back after each try)
        own, count = d in takers, len(takers)
        for j in range(i + 1, n - (parts - s - 1) + 1):
            seg = pre[j] - pre[i]
            if loads[d] + seg >= best - _EPS:
                break
            room = count * best - held - (seg if own else 0.0)  # the room left under the best load
            if room < least[n] - least[j] - _EPS:
                continue  # what is left cannot fit under the best load
            loads[d] += seg
            bounds.append(j)
            done = search(s + 1, j)
            bounds.pop()
            loads[d] -= seg
            if done:
                return True
        return False

    search(0, 0)
    return best_bounds


def _loads(pres: list[list[float]], bounds: list[int], mapping: tuple[int, ...], devices: int) -> list[float]:
    ends = bounds[1:] + [len(pres[0]) - 1]
    loads = [0.0] * devices
    for part, (lo, hi) in enumerate(zip(bounds, ends, strict=True)):
        pre = pres[mapping[part]]
        loads[mapping[part]] += pre[hi] - pre[lo]
    return loads


# --------------------------------------------------------------------------- memory-aware splitting


@dataclass(frozen=True)
class MemoryPartition:
    """A split whose busiest device's predicted peak bytes are least, among the splits of nearly the best time."""

    boundaries: list[int]
    """First layer index of each stage; starts at 0."""
    parts: list[list[int]]
    """Layer indices of each stage: contiguous, covering every layer once."""
    placement: tuple[int, ...]
    """Device of each stage: the schedule's."""
    device_time: list[float]
    """Per device, the summed time of its layers (F+B+W of one microbatch through all its stages)."""
    device_static_bytes: list[float]
    """Per device, the parameter, gradient and optimizer-state bytes of its layers."""
    device_peak_bytes: list[float]
    """Per device, the predicted peak: its static bytes plus the activation peak of its action order."""
    bottleneck_time: float
    """The largest device time; at most (1 + slack) x ``time_optimal``."""
    time_optimal: float
    """The largest device time of the time-optimal split."""
    weights: list[int]
    """Per stage, how many microbatches' forward activations (``held``) it holds at its device's peak."""
    weights_w: list[int]
    """Per stage, how many microbatches between their B and W (``held_w``) it holds at its device's peak."""

    @property
    def peak_bytes(self) -> float:
        """The largest predicted device peak: what the split minimises."""
        return max(self.device_peak_bytes)

    @property
    def device_activation_bytes(self) -> list[float]:
        """Per device, the predicted activation peak (the peak less the static bytes)."""
        return [peak - static for peak, static in zip(self.device_peak_bytes, self.device_static_bytes, strict=True)]


class _Prefix(NamedTuple):
    """Prefix sums of the per-layer figures: layers lo..hi-1 sum to ``x[hi] - x[lo]``."""

    time: np.ndarray
    held: np.ndarray
    held_w: np.ndarray
    static: np.ndarray


Figures = tuple[Sequence[float], Sequence[float], Sequence[float], Sequence[float]]
"""Per layer: (times, held, held_w, static), as :func:`partition_memory` takes them."""


def partition_memory(times: Sequence[float], held: Sequence[float], held_w: Sequence[float],
                     static: Sequence[float], schedule: Schedule, *, slack: float = 0.02) -> MemoryPartition:
    """The contiguous split into ``schedule``'s stages with the least largest predicted device peak bytes.

    Per layer: ``times`` (F+B+W seconds of one microbatch), ``held`` (activation bytes it holds from
    its forward to its backward, per microbatch), ``held_w`` (bytes held from B to W) and ``static``
    (parameter, gradient and optimizer-state bytes). A device's predicted peak is its layers' static
    bytes plus the activation peak of its action order (:func:`pipefold.sim.simulate.peak_by_order`),
    which weighs each stage by how many microbatches it holds at once. Only splits whose busiest
    device time is within (1 + ``slack``) of the time-optimal split's are allowed; among equal
    peaks the faster split wins. Exact for every placement: polynomial for one stage per device and
    for two (V, looped), a pruned depth-first search otherwise (see docs/partition.md).
    """
    return partition_memory_on_devices([(times, held, held_w, static)] * schedule.devices, schedule, slack=slack)


def partition_memory_on_devices(figures: Sequence[Figures], schedule: Schedule, *, slack: float = 0.02,
                                fastest: Partition | None = None) -> MemoryPartition:
    """:func:`partition_memory` where a layer's figures depend on its device: ``figures[d]`` is (times, held,
    held_w, static) of every layer on device d (devices that split their layers over different numbers of
    tensor-parallel ranks run and hold the same layer differently). Exact for every placement, as there.
    ``fastest``: the time-optimal split of these times, where the caller has it already."""
    rows = [_check_figures(*f) for f in figures]
    if len(rows) != schedule.devices or len({len(r[0]) for r in rows}) > 1:
        raise ConfigError(f"give every device the figures of every layer: {schedule.devices} devices, one length")
    if schedule.replicas > 1:
        raise ConfigError(f"splitting by memory searches one placement of the stages, and {schedule.name} has "
                          f"{schedule.replicas} replicas: split {schedule.name} by time, params or even")
    n, stages = len(rows[0][0]), schedule.stages
    if n < stages:
        raise ConfigError(f"cannot split {n} layers into {stages} stages: at most {n}")
    if not (isinstance(slack, (int, float)) and math.isfinite(slack) and slack >= 0):
        raise ConfigError(f"slack is the time allowed above the time-optimal split: a number >= 0 (got {slack!r})")
    mapping = schedule.placement[0]
    uniform = all(r == rows[0] for r in rows)
    if fastest is None:
        fastest = (partition(rows[0][0], stages, placement=mapping) if uniform
                   else partition_on_devices([r[0] for r in rows], mapping))
    limit = fastest.bottleneck * (1 + slack) * (1 + _REL) + _EPS
    first = _Prefix(*(np.concatenate([[0.0], np.cumsum(f)]) for f in rows[0]))
    pres = [first if uniform else _Prefix(*(np.concatenate([[0.0], np.cumsum(f)]) for f in r)) for r in rows]
    moments = [_moments(schedule.actions[d], schedule.stages_of(d)) for d in range(schedule.devices)]
    if len(set(mapping)) == stages:
        bounds = _chain_search(pres, moments, mapping, limit)
    elif stages % 2 == 0 and mapping in (v_placement(stages // 2), looped_placement(stages // 2, 2)):
        bounds = _pair_search(pres, moments, stages // 2, limit, looped=mapping != v_placement(stages // 2))
    else:
        bounds = _tree_search(pres, moments, mapping, limit, fastest.boundaries)
    return _memory_of_split(bounds, rows, schedule, fastest.bottleneck, moments)


def memory_of_split(boundaries: Sequence[int], times: Sequence[float], held: Sequence[float],
                    held_w: Sequence[float], static: Sequence[float], schedule: Schedule, *,
                    time_optimal: float | None = None) -> MemoryPartition:
    """Per-device time, static bytes and predicted peak bytes of one split (e.g. the time-balanced one).

    The figures are as for :func:`partition_memory`; ``time_optimal`` is worked out when not given.
    """
    return memory_of_split_on_devices(boundaries, [(times, held, held_w, static)] * schedule.devices, schedule,
                                      time_optimal=time_optimal)


def memory_of_split_on_devices(boundaries: Sequence[int], figures: Sequence[Figures], schedule: Schedule, *,
                               time_optimal: float | None = None) -> MemoryPartition:
    """:func:`memory_of_split` with figures per device, as :func:`partition_memory_on_devices` takes them."""
    rows = [_check_figures(*f) for f in figures]
    if len(rows) != schedule.devices or len({len(r[0]) for r in rows}) > 1:
        raise ConfigError(f"give every device the figures of every layer: {schedule.devices} devices, one length")
    if time_optimal is None:
        time_optimal = partition_on_devices([r[0] for r in rows], schedule.placement[0]).bottleneck
    moments = [_moments(schedule.actions[d], schedule.stages_of(d)) for d in range(schedule.devices)]
    return _memory_of_split(boundaries, rows, schedule, time_optimal, moments)


def _memory_of_split(boundaries: Sequence[int], rows: list[tuple[list[float], list[float], list[float], list[float]]],
                     schedule: Schedule, time_optimal: float, moments: list[np.ndarray]) -> MemoryPartition:
    n, stages = len(rows[0][0]), schedule.stages
    bounds = [int(b) for b in boundaries]
    ends = bounds[1:] + [n]
    if len(bounds) != stages or bounds[0] != 0 or any(lo >= hi for lo, hi in zip(bounds, ends, strict=True)):
        raise ConfigError(f"boundaries {bounds} do not split {n} layers into {stages} non-empty stages")
    parts = [list(range(lo, hi)) for lo, hi in zip(bounds, ends, strict=True)]
    mapping = schedule.placement[0]
    stage = [StageCost(f=0.0, b=0.0, w=0.0, memory=sum(rows[d][1][i] for i in part),
                       memory_w=sum(rows[d][2][i] for i in part)) for d, part in zip(mapping, parts, strict=True)]
    device_time, device_static, device_peak = [], [], []
    weights, weights_w = [0] * stages, [0] * stages
    for d in range(schedule.devices):
        times, _, _, static = rows[d]
        mine = schedule.stages_of(d)
        device_time.append(sum(times[i] for s in mine for i in parts[s]))
        device_static.append(sum(static[i] for s in mine for i in parts[s]))
        device_peak.append(device_static[-1] + peak_by_order(schedule.actions[d], {s: stage[s] for s in mine}))
        at_peak = moments[d]
        row = at_peak[int(np.argmax(at_peak @ [x for s in mine for x in (stage[s].memory, stage[s].held_w)]))]
        for c, s in enumerate(mine):
            weights[s], weights_w[s] = round(row[2 * c]), round(row[2 * c + 1])
    return MemoryPartition(boundaries=bounds, parts=parts, placement=tuple(mapping), device_time=device_time,
                           device_static_bytes=device_static, device_peak_bytes=device_peak,
                           bottleneck_time=max(device_time), time_optimal=time_optimal, weights=weights,
                           weights_w=weights_w)


_REL = 1e-9
"""Relative tolerance of the time limit and of equal peaks: sums in another order differ in the last bits."""


def _check_figures(*figures: Sequence[float]) -> tuple[list[float], list[float], list[float], list[float]]:
    names = ("times", "held", "held_w", "static")
    values = [[float(x) for x in f] for f in figures]
    if len({len(v) for v in values}) > 1:
        counts = ", ".join(f"{name} {len(v)}" for name, v in zip(names, values, strict=True))
        raise ConfigError(f"give one figure per layer in each of times, held, held_w and static (got {counts})")
    for name, v in zip(names, values, strict=True):
        bad = next((i for i, x in enumerate(v) if not (math.isfinite(x) and x >= 0)), None)
        if bad is not None:
            raise ConfigError(f"{name}[{bad}] must be a finite number >= 0 (got {v[bad]!r})")
    return values[0], values[1], values[2], values[3]


def _moments(actions: Sequence[Action], stages: Sequence[int]) -> np.ndarray:
    """The in-flight counts of a device's stages at each moment its activation memory may peak.

    Row k, columns 2c and 2c+1: how many microbatches of the device's chunk c hold their forward
    activations (``held``) and how many are between their B and W (``held_w``) at moment k. The
    activation level then is the row times the chunks' (held, held_w), and the device's activation
    peak is the largest such product: linear in each stage's figures at every moment, which is what
    makes the split searchable exactly. The deltas are the simulator's (:func:`memory_deltas`, fed
    unit figures); rows no larger than another row in every column never give the peak and are dropped.
    """
    chunk = {s: c for c, s in enumerate(stages)}
    units = (StageCost(f=0.0, b=0.0, w=0.0, memory=1.0, memory_w=0.0),
             StageCost(f=0.0, b=0.0, w=0.0, memory=0.0, memory_w=1.0))
    deltas = {kind: [memory_deltas(kind, unit) for unit in units] for kind, spec in KINDS.items() if not spec.composite}
    level = [0.0] * (2 * len(stages))
    rows = {tuple(level)}
    for act in actions:
        parts = act.passes
        for a in parts:
            c = chunk[a.stage]
            (held_start, _), (w_start, _) = deltas[a.kind]
            level[2 * c] += held_start
            level[2 * c + 1] += w_start
        rows.add(tuple(level))  # peak_by_order reads the level once each pass has started
        for a in parts:
            c = chunk[a.stage]
            (_, held_end), (_, w_end) = deltas[a.kind]
            level[2 * c] += held_end
            level[2 * c + 1] += w_end
    rows.add(tuple(level))
    ordered = sorted(rows, key=sum, reverse=True)
    kept: list[tuple[float, ...]] = []
    for row in ordered:
        if not any(all(x <= y for x, y in zip(row, other, strict=True)) for other in kept):
            kept.append(row)
    return np.array(kept, dtype=float).reshape(len(kept), 2 * len(stages))


def _peaks(moments: np.ndarray, figures: np.ndarray) -> np.ndarray:
    """Activation peaks of a device for many candidate splits: ``figures`` is (2 x chunks, candidates)."""
    return (moments @ figures).max(axis=0)


def _least_prefix(prefixes: Sequence[Sequence[float] | np.ndarray]) -> np.ndarray:
    """Prefix sums of each layer's least cost among devices with these prefix sums (one device's own where all
    are the same): no assignment of the layers to those devices costs less."""
    if all(x is prefixes[0] for x in prefixes):
        return np.asarray(prefixes[0], dtype=float)
    return np.concatenate([[0.0], np.cumsum(np.min([np.diff(x) for x in prefixes], axis=0))])


def _chain_search(pres: list[_Prefix], moments: list[np.ndarray], mapping: tuple[int, ...],
                  limit: float) -> list[int]:
    """Exact split when every stage has a device of its own: a device's peak is then its stage's alone.

    Two passes of the min-max DP over boundaries: the least largest peak under the time limit, then
    the least largest time among the splits that reach that peak. ``pres[d]``: device d's figures.
    """
    n = len(pres[0].time) - 1
    lo, hi = np.triu_indices(n + 1, 1)  # every candidate stage: layers lo..hi-1
    peaks, times = [], []
    for d in mapping:
        pre = pres[d]
        time = np.full((n + 1, n + 1), np.inf)
        time[lo, hi] = pre.time[hi] - pre.time[lo]
        figures = np.stack([pre.held[hi] - pre.held[lo], pre.held_w[hi] - pre.held_w[lo]])
        peak = np.full((n + 1, n + 1), np.inf)
        peak[lo, hi] = pre.static[hi] - pre.static[lo] + _peaks(moments[d], figures)
        peaks.append(np.where(time <= limit, peak, np.inf))
        times.append(time)
    best, _ = _chain_dp(peaks)
    cap = best * (1 + _REL) + _EPS
    return _chain_dp([np.where(peak <= cap, time, np.inf) for peak, time in zip(peaks, times, strict=True)])[1]


def _chain_dp(costs: list[np.ndarray]) -> tuple[float, list[int]]:
    """Boundaries minimising the largest cost, stage s on layers i..j-1 costing ``costs[s][i, j]``."""
    n = costs[0].shape[0] - 1
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    backs = []
    for cost in costs:
        cand = np.maximum(best[:, None], cost)  # [i, j]: stages so far end at i, this one at j
        back = np.argmin(cand, axis=0)
        best = cand[back, np.arange(n + 1)]
        backs.append(back)
    bounds, j = [], n
    for back in reversed(backs):
        j = int(back[j])
        bounds.append(j)
    return float(best[n]), bounds[::-1]


def _pair_search(pres: list[_Prefix], moments: list[np.ndarray], p: int, limit: float, *,
                 looped: bool) -> list[int]:
    """Exact split for two chunks per device, V or looped: :func:`_pair_dp` twice.

    First on the devices' peaks, then on their times among the splits that reach the least peak.
    Looped tries every first layer x of chunk p.
    """
    n = len(pres[0].time) - 1
    idx = np.arange(n + 1)
    # What the layers left after device d take at least on the devices after it (none after the last).
    least_time = [_least_prefix([x.time for x in pres[d + 1:]] or [pres[0].time]) for d in range(p)]
    found: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
    fits: dict[tuple[int, int], np.ndarray] = {}

    def device(d: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Device d's peak and time for every next state (l2, r2) from (lo, hi); inf where over the time limit."""
        if (d, lo, hi) not in found:
            pre = pres[d]
            t = pre.time
            # its chunks: layers lo..l2-1 and, looped, hi..r2-1; V, r2..hi-1
            second = (lambda x, r2: x[r2] - x[hi]) if looped else (lambda x, r2: x[hi] - x[r2])
            time = (t[:, None] - t[lo]) + second(t, idx)[None, :]
            ok = (idx[:, None] > lo) & (time <= limit)
            ok &= (idx[None, :] > hi) if looped else (idx[None, :] < hi) & (idx[None, :] >= idx[:, None])
            l2, r2 = np.nonzero(ok)
            stacked = np.stack([pre.held[l2] - pre.held[lo], pre.held_w[l2] - pre.held_w[lo],
                                second(pre.held, r2), second(pre.held_w, r2)])
            peak = np.full((n + 1, n + 1), np.inf)
            peak[l2, r2] = pre.static[l2] - pre.static[lo] + second(pre.static, r2) + _peaks(moments[d], stacked)
            found[d, lo, hi] = peak, np.where(ok, time, np.inf)
        return found[d, lo, hi]

    def rest_fits(d: int, x: int) -> np.ndarray:
        """Whether the layers left after device d fit on the devices after it under the time limit."""
        if (d, x) not in fits:
            t = least_time[d]
            left = (t[x] - t[:, None]) + (t[n] - t[None, :]) if looped else t[None, :] - t[:, None]
            fits[d, x] = left <= (p - 1 - d) * limit
        return fits[d, x]

    def run(x: int, cost: Callable[[int, int, int], np.ndarray]) -> tuple[float, list[int]]:
        """The least largest cost with chunk p starting at x (looped), and its boundaries."""
        moves, start = (_looped_moves(n, p, x), (0, x)) if looped else (_v_moves(n, p), (0, n))
        value, trace = _pair_dp(n, p, start, moves,
                                lambda d, lo, hi, _ok: np.where(rest_fits(d, x), cost(d, lo, hi), np.inf))
        end = (x, n) if looped else _v_end(value)
        states = trace(*end)
        return float(value[end]), _looped_bounds(states, x) if looped else _v_bounds(states)

    xs = range(p, n - p + 1) if looped else range(n, n + 1)
    least = {x: run(x, lambda d, lo, hi: device(d, lo, hi)[0])[0] for x in xs}
    cap = min(least.values()) * (1 + _REL) + _EPS

    def time_under_cap(d: int, lo: int, hi: int) -> np.ndarray:
        peak, time = device(d, lo, hi)
        return np.where(peak <= cap, time, np.inf)

    return min((run(x, time_under_cap) for x in xs if least[x] <= cap), key=lambda result: result[0])[1]


def _tree_search(pres: list[_Prefix], moments: list[np.ndarray], mapping: tuple[int, ...], limit: float,
                 start: list[int]) -> list[int]:
    """Exact split for any placement: depth-first over boundaries, stage by stage, pruned by the best split so far.

    A split is judged by (largest device peak, largest device time), in that order. Placing a stage
    can only raise its device's time and peak (every figure is non-negative), so the partial values
    bound what any completion reaches, and a longer stage is never better than a shorter one that
    already loses. ``start`` (the time-optimal split) is the first best. Exponential in the worst case.
    """
    n, stages = len(pres[0].time) - 1, len(mapping)
    devices = len(moments)
    least = _least_prefix([x.time for x in pres])  # what the layers left take at least, on any device
    chunk = [mapping[:s].count(mapping[s]) for s in range(stages)]
    later = [set(mapping[s + 1:]) for s in range(stages)]
    loads = [0.0] * devices
    statics = [0.0] * devices
    levels = [np.zeros(len(m)) for m in moments]
    peaks = [0.0] * devices

    def judge(bounds: list[int]) -> tuple[float, float]:
        ends = bounds[1:] + [n]
        load, static, level = [0.0] * devices, [0.0] * devices, [np.zeros(len(m)) for m in moments]
        for s, (lo, hi) in enumerate(zip(bounds, ends, strict=True)):
            d, c = mapping[s], chunk[s]
            pre = pres[d]
            load[d] += pre.time[hi] - pre.time[lo]
            static[d] += pre.static[hi] - pre.static[lo]
            level[d] = level[d] + moments[d][:, 2 * c] * (pre.held[hi] - pre.held[lo])
            level[d] = level[d] + moments[d][:, 2 * c + 1] * (pre.held_w[hi] - pre.held_w[lo])
        return max(static[d] + level[d].max(initial=0.0) for d in range(devices)), max(load)

    best_peak, best_time = judge(start)
    best_bounds = list(start)
    bounds = [0]

    def loses(peak: float, time: float) -> bool:
        cap = best_peak * (1 + _REL) + _EPS
        return peak > cap or (peak >= best_peak * (1 - _REL) - _EPS and time >= best_time * (1 - _REL) - _EPS)

    def search(s: int, i: int) -> None:
        nonlocal best_peak, best_time, best_bounds
        d, c = mapping[s], chunk[s]
        pre = pres[d]
        load0, static0, level0, peak0 = loads[d], statics[d], levels[d], peaks[d]
        last = s == stages - 1
        for j in range(n if last else i + 1, n - (stages - s - 1) + 1):
            load = load0 + pre.time[j] - pre.time[i]
            if load > limit:
                break
            level = (level0 + moments[d][:, 2 * c] * (pre.held[j] - pre.held[i])
                     + moments[d][:, 2 * c + 1] * (pre.held_w[j] - pre.held_w[i]))
            peak = static0 + pre.static[j] - pre.static[i] + level.max(initial=0.0)
            loads[d], peaks[d] = load, peak
            top_peak, top_time = max(peaks), max(loads)
            if loses(top_peak, top_time):
                break  # a longer stage raises both
            room = sum(limit - loads[e] for e in later[s])
            if room < least[n] - least[j] - _EPS:
                continue  # what is left cannot fit under the time limit
            if last:
                best_peak, best_time, best_bounds = top_peak, top_time, list(bounds)
                continue
            statics[d], levels[d] = static0 + pre.static[j] - pre.static[i], level
            bounds.append(j)
            search(s + 1, j)
            bounds.pop()
        loads[d], statics[d], levels[d], peaks[d] = load0, static0, level0, peak0

    search(0, 0)
    return best_bounds


@dataclass(frozen=True)
class LayerFigures:
    """Per layer, what a split weighs (measured by :func:`pipefold.runtime.measure.profiling.split_figures`, one
    microbatch
    through the layers in order, the last computing the loss as the last stage does). A figure that the split asked
    for does not need is None."""

    params: list[float]
    """Parameter count."""
    times: list[float] | None = None
    """F + B + W seconds."""
    held: list[float] | None = None
    """Bytes held from the forward to the backward."""
    held_w: list[float] | None = None
    """Bytes held from B to W."""
    static: list[float] | None = None
    """Parameter, gradient and optimizer-state bytes."""

    @staticmethod
    def needs(by: str) -> tuple[bool, bool]:
        """(times, memory): what splitting ``by`` (or 'all') reads besides the parameter counts."""
        return by in ("time", "memory", "all"), by in ("memory", "all")


def split_by(figures: LayerFigures, schedule: Schedule, by: str, *, slack: float = 0.02) -> Partition | MemoryPartition:
    """The layers split into ``schedule``'s stages: balanced by ``time`` or ``params`` (the busiest device's load,
    a device holding two chunks counting both), or (``memory``) the least predicted device peak within ``slack`` of
    the time-balanced split's time. With the memory figures measured the answer is a :class:`MemoryPartition`,
    every device's predicted peak with it."""
    if by == "memory":
        assert figures.times and figures.held and figures.held_w and figures.static, "splitting by memory measures"
        return partition_memory(figures.times, figures.held, figures.held_w, figures.static, schedule, slack=slack)
    costs = figures.params if by == "params" else figures.times
    if costs is None or by not in ("params", "time"):
        raise ConfigError(f"split by params, time or memory (got {by!r})")
    balanced = partition(costs, schedule.stages, placement=schedule.placement[0])
    if figures.held is None or figures.held_w is None or figures.static is None or figures.times is None:
        return balanced
    return memory_of_split(balanced.boundaries, figures.times, figures.held, figures.held_w, figures.static, schedule)

