"""Bidirectional pipelines: Chimera (Li and Hoefler, SC'21) and DualPipe (DeepSeek-V3 report, 2024).

Both keep two replicas of a p-stage model on p devices (p even). Replica 0,
the *down* pipeline, puts stage s on device s; replica 1, the *up* pipeline,
puts it on device p-1-s. Device d holds stage d of the one and stage p-1-d of
the other, so it runs at both a near and a far position of the pipeline, and
every device holds two stages' parameters (twice 1F1B's). Each microbatch goes
through one replica (``Schedule.routes``); each stage's two replicas all-reduce
their gradients once their backwards are done, an ``R`` action on each holder
right after its last backward of that stage::

    dev 0   stage 0 (down)  stage 3 (up)        down: 0 -> 1 -> 2 -> 3   (p = 4)
    dev 1   stage 1 (down)  stage 2 (up)        up:   3 <- 2 <- 1 <- 0
    dev 2   stage 2 (down)  stage 1 (up)
    dev 3   stage 3 (down)  stage 0 (up)

**Chimera** merges two 1F1B pipelines that run on the same devices in
opposite directions. The paper draws a forward and a backward as one slot
each; microbatches go in units of p, the first p/2 of a unit down and the next
p/2 up. In unit u (o = 2pu) device d runs, for k = 0 .. p/2-1::

    down F  of stage d      (microbatch pu + k)        at slot o + d + 2k
    up   F  of stage p-1-d  (microbatch pu + p/2 + k)  at slot o + p-1-d + 2k
    up   BW of stage p-1-d                             at slot o + p + d + 2k
    down BW of stage d                                 at slot o + 2p-1-d + 2k

Each pipeline on its own is 1F1B with its forwards two slots apart; on device
d the down forwards and up backwards take the slots of d's parity, the up
forwards and down backwards the others, in disjoint ranges, so the two never
want one slot (the paper's conflict-free merge), and unit u+1, 2p slots
later, fits into unit u's trailing gaps in the same way (the paper's direct
concatenation). A device's list is its passes in slot order. Device d < p/2
(device p-1-d is its mirror image, down and up swapped) runs per unit:

    fill       p/2-d  x  Fd           own-direction forwards, one every other slot
    cross      d      x  Fu Fd        the first up forwards have arrived
    steady     p/2-d  x  Fu Bu        1F1B on the up pipeline, whose far end this is
    cross back d      x  Bd Bu        the first down gradients have arrived
    drain      p/2-d  x  Bd           one every other slot; unit u+1's fill runs between

With forward and backward one slot each the step takes 2m + p - 2 slots, p-2
of them idle on every device: the paper's bubble ratio (p-2)/(2m+p-2). With
the backward twice the forward (unit costs, fused BW) the gradients travel at
half the speed the grid allowed for. The critical path is then the first up
microbatch's forwards across all p devices and its gradient back to stage 1,
followed there by the last down microbatch's gradient from stage p-2 to stage
0: p + 4(p-1). Each further unit adds two forwards on device 0 and the same
2(p-1) backward hops, 4p-2 for the 3p it computes, so the step takes
3m + (p-2)(m/p + 1): p-2 more idle per seam between units (the paper's
intermediate bubbles of direct concatenation; its forward doubling and
backward halving, not built here, remove them). Device d holds at most p/2
microbatches of each direction and peaks at p/2 + 1 + min(d, p-1-d) of them:
all p/2 of its own direction and d+1 of the other, just before its first
backward; p/2+1 at the ends, p in the middle (the paper's [(p/2+1) M, p M]).

**DualPipe** runs the same two pipelines with m/2 microbatches each way
(microbatches 0..m/2-1 down, the rest up) and overlaps, in the steady state,
the forward of one direction with the full backward of the other, as one
overlapped pair (``2F6+1BW0``), so that one's communication hides behind the
other's computation. At the ends it splits the backward into B and W and
defers W into gaps (zero bubble). On device d, the *near* direction is the one
whose first half holds it (down for d < p/2, up otherwise), the *far* one the
other; h = min(d, p-1-d). Device d runs, as DeepSeek's reference
implementation does (``dualpipe/dualpipe.py``, its steps 1 to 8):

    fill       2(p/2-1-h)    x  Fn                   near forwards until the far ones arrive
    both       h+1           x  Fn Ff                both directions in flight
    first      p/2-1-h       x  Bf Wf Ff             the first far gradients: B/W split, W at once
    overlap    m/2-p+1+h     x  Fn+BWf  Ff+BWn       every forward paired with a backward
    tail       p/2-1-h       x  BWf  Ff+BWn          the far direction's last forwards
    cool-down  h+1           x  Bf Bn                the first h+1 fused (BW), the last h+1 split
               p/2-1-h       x  W  Bn                a deferred W in each gap between near gradients
               h+1           x  W                    the Ws still deferred

Deferred Ws run oldest first. On the two middle devices the first pair of the
overlap phase runs as Fn, then BWf, one after the other (DeepSeek: a smaller
bubble that way): the forward runs while the backward's gradient is still on
its way. Every device peaks at p+1 microbatches of one stage: an overlapped
pair takes its forward's activation before its backward frees another's
(DeepSeek's "PP+1"). Under unit costs the step takes 2m + 3p/2 when a pair
costs max(F, BW) and 3m + p - 2 when it costs F + BW; the most any device
idles is then (p/2-1)(F&B + B - 3W) with B the full backward, DeepSeek's
bubble. DeepSeek's code needs p even, m even and m >= 2p.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pipefold.errors import ConfigError
from pipefold.ir import Schedule, linear_placement, reversed_placement
from pipefold.schedules._phases import BW, B, Bools, F, Ints, R, W, counted_rows, oldest_first, phases

__all__ = ["chimera", "dualpipe"]

_DOWN, _UP = 0, 1


def _nearest(values: Iterable[int]) -> str:
    return " or ".join(str(v) for v in values)


def _check_devices(name: str, p: int) -> None:
    if p % 2:
        valid = [v for v in (p - 1, p + 1) if v >= 2]
        raise ConfigError(f"{name} needs an even number of devices (each holds one stage of each of two "
                          f"opposite pipelines), got {p}; nearest valid: {_nearest(valid)}")


def _placement(p: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return linear_placement(p), reversed_placement(p)


def _with_allreduce(p: int, d: int, kind: Ints, stage: Ints, paired: Bools) -> tuple[Ints, Ints, Bools]:
    """Device d's passes with an all-reduce of each of its stages (d down, p-1-d up) right after its last
    backward of that stage."""
    for s in (d, p - 1 - d):
        last = int(np.flatnonzero(((kind == W) | (kind == BW)) & (stage == s))[-1])
        kind, stage = np.insert(kind, last + 1, R), np.insert(stage, last + 1, s)
        paired = np.insert(paired, last + 1, False)
    return kind, stage, paired


# --------------------------------------------------------------------------- Chimera


def chimera(devices: int, microbatches: int) -> Schedule:
    """Chimera: a down and an up 1F1B pipeline merged on the same devices, microbatches in units of p.

    Microbatch j goes down when (j mod p) < p/2, else up. Each device's list is its
    passes in the order of the paper's slot grid (see the module docstring).
    """
    p, m = devices, microbatches
    _check_devices("chimera", p)
    if m % p:
        below = (m // p) * p
        valid = [v for v in (below, below + p) if v >= p]
        raise ConfigError(f"chimera on {p} devices needs a multiple of {p} microbatches (p/2 each way per unit), "
                          f"got {m}; nearest valid: {_nearest(valid)}")
    half = p // 2
    routes = tuple(_DOWN if j % p < half else _UP for j in range(m))
    taken = ([j for j in range(m) if routes[j] == _DOWN], [j for j in range(m) if routes[j] == _UP])
    rows = []
    for d in range(p):
        up = p - 1 - d  # the stage of the up pipeline on device d
        # Per unit u (o = 2pu) and k < p/2: down F, up F, up BW and down BW at their slots of the grid.
        at = (2 * p * np.arange(m // p)[:, None] + 2 * np.arange(half)).ravel()
        slot = np.concatenate((at + d, at + p - 1 - d, at + p + d, at + 2 * p - 1 - d))
        kind = np.repeat([F, F, BW, BW], len(at))
        stage = np.repeat([d, up, up, d], len(at))
        order = np.argsort(slot, kind="stable")
        rows.append(_with_allreduce(p, d, kind[order], stage[order], np.zeros(len(slot), dtype=bool)))
    rows_ = counted_rows(rows, m, takes=lambda d, s: taken[_DOWN if s == d else _UP])
    return Schedule("chimera", p, p, m, _placement(p), rows_, {}, routes)


# --------------------------------------------------------------------------- DualPipe


def _dualpipe_passes(p: int, m: int, d: int) -> tuple[Ints, Ints, Bools]:
    """Device d's passes, in the phases of the module docstring: (kind, stage, paired) of each, paired where a
    pass runs together with the next (a forward with a backward of the other direction)."""
    half, each = p // 2, m // 2
    h = min(d, p - 1 - d)
    near = _DOWN if d < half else _UP
    far = 1 - near
    fn, ff, bf, bwn, bwf, w = (F, near), (F, far), (B, far), (BW, near), (BW, far), (W, -1)
    fn_with, ff_with = (F, near, 1), (F, far, 1)  # each run together with the backward after it
    # Of the cool-down's 2(h+1) backwards, far and near in turn, the second half are split, so their gradients
    # move on sooner.
    cool = [(B if k >= h + 1 else BW, c) for k, c in enumerate(c for _ in range(h + 1) for c in (far, near))]
    steady = each - p + 1 + h
    turn = h == half - 1  # middle device: its first backward waits for the other middle one
    kind, direction, paired = phases(
        # Fill: the near direction's microbatch 0 reaches here after h slots, the far one's after p-1-h;
        # the slots between take more near forwards.
        ([fn], 2 * (half - 1 - h)),
        # Both: the far forwards have arrived; the two directions alternate until the first far gradient
        # (the far direction's loss is h devices away) is back.
        ([fn, ff], h + 1),
        # First: far gradients come before any near one. Split, so the gradient moves on after B alone; W
        # runs at once and frees the activation that the next far forward takes.
        ([bf, w, ff], half - 1 - h),
        # Overlap: the steady state, every forward paired with a full backward of the other direction,
        # until the near direction has had all its forwards.
        ([fn, bwf, ff_with, bwn], int(turn)),
        ([fn_with, bwf, ff_with, bwn], steady - int(turn)),
        # Tail: the far direction's last forwards, each paired with a near backward.
        ([bwf, ff_with, bwn], half - 1 - h),
        # Cool-down: nothing is left to overlap; then one deferred W fills each gap between the last near
        # gradients, and the Ws still deferred close the step.
        (cool, 1),
        ([w, (B, near)], half - 1 - h),
        ([w], h + 1),
    )
    direction = oldest_first(kind, direction)  # deferred Ws run oldest first
    return kind, np.where(direction == _DOWN, d, p - 1 - d), paired


def dualpipe(devices: int, microbatches: int) -> Schedule:
    """DualPipe: two opposite pipelines, forward of one overlapped with backward of the other.

    Microbatches 0..m/2-1 go down, m/2..m-1 up. Needs p even, m even, m >= 2p (as DeepSeek's code).
    """
    p, m = devices, microbatches
    _check_devices("dualpipe", p)
    if m < 2 * p:
        raise ConfigError(f"dualpipe on {p} devices needs at least {2 * p} microbatches (p each way: the end devices "
                          f"run p-1 forwards before their first overlapped pair), got {m}; nearest valid: {2 * p}")
    if m % 2:
        raise ConfigError(f"dualpipe needs an even number of microbatches (half go each way), got {m}; "
                          f"nearest valid: {_nearest((m - 1, m + 1))}")
    rows = [_with_allreduce(p, d, *_dualpipe_passes(p, m, d)) for d in range(p)]
    routes = tuple(_DOWN if j < m // 2 else _UP for j in range(m))
    taken = (range(m // 2), range(m // 2, m))
    rows_ = counted_rows(rows, m, takes=lambda d, s: taken[_DOWN if s == d else _UP])
    return Schedule("dualpipe", p, p, m, _placement(p), rows_, {}, routes)
