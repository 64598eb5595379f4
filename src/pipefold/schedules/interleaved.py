"""Looped schedules with v stages (chunks) per device: interleaved 1F1B, its zero-bubble form, and breadth-first.

Stage s lives on device s mod p, so each microbatch loops through the devices v
times. Device i holds stages i, i+p, ..., i+(v-1)p (its chunks 0..v-1).
"""

from __future__ import annotations

from collections import deque

from pipefold.errors import ConfigError
from pipefold.ir import BW, Action, B, F, Schedule, W, looped_placement
from pipefold.schedules._phases import warmup_steady_cooldown


def group_size(p: int, m: int) -> int:
    """Microbatches per round of the interleaved order: p when it divides m.

    Rounds must be equal: with a short last round a device would wait on a
    chunk its neighbour has not reached, a deadlock. So take the smallest
    divisor of m that is at least p (m itself when m < p or m is prime).
    """
    return next(g for g in range(min(p, m), m + 1) if m % g == 0)


def _interleaved_order(device: int, p: int, m: int, v: int, backward: bool) -> list[Action]:
    """Megatron's order of one device's passes: microbatches in rounds, all chunks within a round.

    Forward order, for p=2, v=2, m=4 on device 0 (stages 0 and 2)::

        0F0 0F1 2F0 2F1 | 0F2 0F3 2F2 2F3

    Backwards run the chunks in reverse (the last chunk sees its gradient first).
    """
    chunks = list(range(v))[::-1] if backward else list(range(v))
    g = group_size(p, m)
    order = []
    for first in range(0, m, g):
        group = range(first, first + g)
        for c in chunks:
            stage = c * p + device
            order += [BW(stage, j) if backward else F(stage, j) for j in group]
    return order


def interleaved_1f1b(devices: int, microbatches: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): 1F1B over v chunks per device, bubble divided by v."""
    p, m = devices, microbatches
    rows = []
    for i in range(p):
        forwards = [[a] for a in _interleaved_order(i, p, m, v, backward=False)]
        backwards = [[a] for a in _interleaved_order(i, p, m, v, backward=True)]
        # Warm-up: every chunk but the last must run a whole round of microbatches before the
        # first gradient returns, plus 2 per device below i (forward there and backward back).
        warmup = (v - 1) * group_size(p, m) + 2 * (p - 1 - i)
        rows.append(warmup_steady_cooldown(forwards, backwards, warmup=warmup))
    return Schedule("interleaved-1f1b", p, p * v, m, (looped_placement(p, v),), tuple(map(tuple, rows)), {"v": v})


def looped_bfs(devices: int, microbatches: int, v: int = 2) -> Schedule:
    """Breadth-first (Lamy-Poirier 2022): each device runs all microbatches of a chunk, then the next.

    Forwards go chunk by chunk, backwards chunk by chunk in reverse; like GPipe,
    every microbatch's activations are held until its backward.
    """
    p, m = devices, microbatches
    rows = []
    for i in range(p):
        chunks = [c * p + i for c in range(v)]
        forwards = [F(s, j) for s in chunks for j in range(m)]
        backwards = [BW(s, j) for s in reversed(chunks) for j in range(m)]
        rows.append(forwards + backwards)
    return Schedule("looped-bfs", p, p * v, m, (looped_placement(p, v),), tuple(map(tuple, rows)), {"v": v})


def _interleaved_zb_order(i: int, p: int, m: int, v: int) -> list[Action]:
    """Device i's passes in interleaved zero bubble (ZB1P, as torch's ScheduleInterleavedZeroBubble).

    Passes are counted in rounds of g = :func:`group_size` microbatches: the k-th forward of
    the device is for chunk (k // g) mod v, the k-th backward for chunk v-1 - (k // g) mod v,
    each chunk's microbatches in order. Phases:

        warm-up    (v-1)g + p-1-i  x  F          every chunk but the last takes a round, plus one
                                                 slot per device below (a B is one slot, not BW's two)
        steady     mv - warm-up    x  F B (W)    one forward, one input gradient
        cool-down  warm-up         x  B (W)      the gradients still to come
        tail                          W          the deferred ones

    From the device's (i+1)-th B on, each B is followed by the oldest pending W, so i Ws
    stay deferred to the tail (ZB-H1's deferral), filling the gaps while gradients drain.
    Device i then peaks at (v-1)g + p chunk activations, p M when g = p (1F1B's memory).
    """
    g = group_size(p, m)
    total = m * v
    warmup = min((v - 1) * g + p - 1 - i, total)
    next_f: dict[int, int] = {}
    next_b: dict[int, int] = {}
    deferred: deque[Action] = deque()
    order: list[Action] = []

    def forward(k: int) -> None:
        stage = (k // g) % v * p + i
        j = next_f.get(stage, 0)
        next_f[stage] = j + 1
        order.append(F(stage, j))

    def backward(k: int) -> None:
        stage = (v - 1 - (k // g) % v) * p + i
        j = next_b.get(stage, 0)
        next_b[stage] = j + 1
        order.append(B(stage, j))
        deferred.append(W(stage, j))

    for k in range(warmup):
        forward(k)
    for k in range(total):  # steady while forwards remain, then cool-down
        if warmup + k < total:
            forward(warmup + k)
        backward(k)
        if k >= i:
            order.append(deferred.popleft())
    order += deferred
    return order


def interleaved_zb(devices: int, microbatches: int, v: int = 2) -> Schedule:
    """Interleaved zero bubble (ZB1P on the looped placement): v chunks per device, B/W split.

    torch's ScheduleInterleavedZeroBubble for every shape it builds (m a multiple of its
    rounds); for other m the rounds are :func:`group_size` microbatches, as in interleaved 1F1B.
    """
    p, m = devices, microbatches
    if p < 1 or m < 1 or v < 1:
        raise ConfigError(f"interleaved-zb needs at least 1 device, microbatch and chunk per device "
                          f"(got devices={p}, microbatches={m}, v={v})")
    rows = tuple(tuple(_interleaved_zb_order(i, p, m, v)) for i in range(p))
    return Schedule("interleaved-zb", p, p * v, m, (looped_placement(p, v),), rows, {"v": v})
