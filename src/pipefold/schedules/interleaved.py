"""Looped schedules with v stages (chunks) per device: interleaved 1F1B, its zero-bubble form, and breadth-first.

Stage s lives on device s mod p, so each microbatch loops through the devices v
times. Device i holds stages i, i+p, ..., i+(v-1)p (its chunks 0..v-1).
"""

from __future__ import annotations

import numpy as np

from pipefold.errors import ConfigError
from pipefold.ir import Schedule, looped_placement
from pipefold.schedules._phases import BW, B, F, Ints, W, counted_rows, warmup_steady_cooldown


def group_size(p: int, m: int) -> int:
    """Microbatches per round of the interleaved order: p when it divides m.

    Rounds must be equal: with a short last round a device would wait on a
    chunk its neighbour has not reached, a deadlock. So take the smallest
    divisor of m that is at least p (m itself when m < p or m is prime).
    """
    return next(g for g in range(min(p, m), m + 1) if m % g == 0)


def _interleaved_stages(device: int, p: int, m: int, v: int, backward: bool) -> Ints:
    """Megatron's order of one device's passes: microbatches in rounds, all chunks within a round; the stage of
    each (the microbatches of a stage in order).

    Forward order, for p=2, v=2, m=4 on device 0 (stages 0 and 2)::

        0F0 0F1 2F0 2F1 | 0F2 0F3 2F2 2F3

    Backwards run the chunks in reverse (the last chunk sees its gradient first).
    """
    chunks = np.arange(v)[::-1] if backward else np.arange(v)
    g = group_size(p, m)
    return np.tile(np.repeat(chunks * p + device, g), m // g)


def interleaved_1f1b(devices: int, microbatches: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): 1F1B over v chunks per device, bubble divided by v."""
    p, m = devices, microbatches
    rows = []
    for i in range(p):
        forwards = (np.full(m * v, F), _interleaved_stages(i, p, m, v, backward=False))
        backwards = (np.full(m * v, BW), _interleaved_stages(i, p, m, v, backward=True))
        # Warm-up: every chunk but the last must run a whole round of microbatches before the
        # first gradient returns, plus 2 per device below i (forward there and backward back).
        warmup = (v - 1) * group_size(p, m) + 2 * (p - 1 - i)
        rows.append(warmup_steady_cooldown(forwards, backwards, warmup=warmup))
    return Schedule("interleaved-1f1b", p, p * v, m, (looped_placement(p, v),), counted_rows(rows, m),
                    {"v": v})


def looped_bfs(devices: int, microbatches: int, v: int = 2) -> Schedule:
    """Breadth-first (Lamy-Poirier 2022): each device runs all microbatches of a chunk, then the next.

    Forwards go chunk by chunk, backwards chunk by chunk in reverse; like GPipe,
    every microbatch's activations are held until its backward.
    """
    p, m = devices, microbatches
    rows = []
    for i in range(p):
        chunks = np.arange(v) * p + i
        stage = np.concatenate((np.repeat(chunks, m), np.repeat(chunks[::-1], m)))
        rows.append((np.repeat([F, BW], v * m), stage))
    return Schedule("looped-bfs", p, p * v, m, (looped_placement(p, v),), counted_rows(rows, m), {"v": v})


def _interleaved_zb_passes(i: int, p: int, m: int, v: int) -> tuple[Ints, Ints]:
    """Device i's passes in interleaved zero bubble (ZB1P, as torch's ScheduleInterleavedZeroBubble), as (kind,
    stage) columns (kinds numbered as in :data:`~pipefold.schedules._phases.CODES`; microbatches counted by
    :func:`~pipefold.schedules._phases.counted_rows`).

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
    k = np.arange(total)
    forward = (k // g) % v * p + i  # the stage of the device's k-th forward ...
    backward = (v - 1 - (k // g) % v) * p + i  # ... and of its k-th input gradient; its k-th W follows that B
    # Round k of the steady state and cool-down: the next forward while forwards remain, the k-th B, and from
    # the device's (i+1)-th B on the oldest pending W, the (k-i)-th.
    stage = np.stack((np.roll(forward, -warmup), backward, np.roll(backward, i)), axis=1)
    kind = np.broadcast_to(np.array([F, B, W]), stage.shape)
    there = np.stack((k + warmup < total, np.ones(total, dtype=bool), k >= i), axis=1)
    tail = backward[max(total - i, 0):]  # the Ws still deferred
    return (np.concatenate((np.full(warmup, F), kind[there], np.full(len(tail), W))),
            np.concatenate((forward[:warmup], stage[there], tail)))


def interleaved_zb(devices: int, microbatches: int, v: int = 2) -> Schedule:
    """Interleaved zero bubble (ZB1P on the looped placement): v chunks per device, B/W split.

    torch's ScheduleInterleavedZeroBubble for every shape it builds (m a multiple of its
    rounds); for other m the rounds are :func:`group_size` microbatches, as in interleaved 1F1B.
    """
    p, m = devices, microbatches
    if p < 1 or m < 1 or v < 1:
        raise ConfigError(f"interleaved-zb needs at least 1 device, microbatch and chunk per device "
                          f"(got devices={p}, microbatches={m}, v={v})")
    rows = counted_rows([_interleaved_zb_passes(i, p, m, v) for i in range(p)], m)
    return Schedule("interleaved-zb", p, p * v, m, (looped_placement(p, v),), rows, {"v": v})
