"""DualPipeV: DeepSeek's DualPipe cut in half (DeepSeek-V3 report, 2024; torch's ScheduleDualPipeV).

DualPipe runs two pipelines in opposite directions over the same p devices,
each device holding a stage of both, so it keeps two copies of the
parameters. DualPipeV folds the model instead: on the V placement device d
of p holds stage d (its chunk 0) and stage 2p-1-d (its chunk 1) of one copy,
so a microbatch goes down the devices and back up, its gradient the other
way, and both ends of the model sit on device 0::

    dev 0   0 --------------- 7        F: 0 1 2 3 4 5 6 7   (p = 4)
    dev 1     1 ----------- 6          B: 7 6 5 4 3 2 1 0
    dev 2       2 ------- 5
    dev 3         3 --- 4

What DualPipe adds over ZB-V is the F&B overlap: in the steady state a device
runs the forward of one chunk together with the full backward of the other,
as one overlapped pair (``0F7+7BW3``), so the communication of one hides
behind the computation of the other. The backward is split into B and W
(zero bubble) only at the ends, where W fills gaps. A slot below is one
chunk pass. Device d:

    warm-up 1  2(p-1-d)   x  F0                 fill the V down to the bottom and back to here
    warm-up 2  d+1        x  F0 F1              both chunks in flight
    warm-up 3  p-1-d      x  B1 W1 F1           the first chunk-1 gradients: B/W split, W at once
    overlap    m-2p+1+d   x  F0+BW1  F1+BW0     the steady state, every forward paired with a backward
    tail       p-1-d      x  BW1  F1+BW0        chunk 1 runs its last forwards
    cool-down  d+1        x  B1 B0              the first d+1 of these fused (BW), the last d+1 split
               p-1-d      x  W  B0              one deferred W in each gap between chunk-0 gradients
               d+1        x  W                  the Ws still deferred: nobody waits for them

Deferred Ws run oldest first. On the last device (d = p-1), where the V turns,
the first overlapped pair runs as F0 then BW1, one after the other, as in
DeepSeek's code ("to further reduce bubble size"). pipefold's simulator has no
communication for the pair to hide, and there pairing them too would be half a
chunk pass shorter (21.5 against 22 for p = 4, m = 8 with ``overlap``); the
order is kept as DeepSeek and torch run it.

Memory: after warm-up 2 each device holds 2(p-1-d) + 2(d+1) = 2p chunk
activations; from then on every round that takes one in gives one back, but
an overlapped pair takes its forward's activation before its backward frees
the other's, so every device peaks at 2p+1 chunk activations, p + 1/2 M:
DeepSeek's "PP+1" for PP = 2p stages. DeepSeek's code (and torch's) needs
m >= 2p microbatches: device 0's warm-up alone is 2p-1 forwards of chunk 0.
"""

from __future__ import annotations

from pipefold.errors import ConfigError
from pipefold.ir import Schedule, v_placement
from pipefold.schedules._phases import BW, B, Bools, F, Ints, W, counted_rows, oldest_first, phases, v_stage


def _device_passes(p: int, m: int, d: int) -> tuple[Ints, Ints, Bools]:
    """Device d's passes, in the phases of the module docstring: (kind, chunk, paired) of each, paired where a
    pass runs together with the next (a forward with a backward of the other chunk)."""
    f0, f1, b1, bw0, bw1, w = (F, 0), (F, 1), (B, 1), (BW, 0), (BW, 1), (W, -1)
    with_next = (F, 0, 1), (F, 1, 1)  # F0 and F1, each run together with the backward after it
    # The cool-down's 2(d+1) backwards, chunk 1 then chunk 0 in turn: the first half stay fused, the second
    # half are split so each gradient moves on sooner, their Ws deferred into the gaps that follow.
    cool = [(B if k >= d + 1 else BW, c) for k, c in enumerate(c for _ in range(d + 1) for c in (1, 0))]
    steady = m - 2 * p + 1 + d
    turn = d == p - 1 and steady > 0  # the turn of the V: F0, then BW1, not overlapped (DeepSeek's choice)
    kind, chunk, paired = phases(
        # Warm-up 1: microbatch 0 reaches chunk 0 here after d slots and chunk 1 after 2p-1-d; the slots
        # between are filled with the next chunk-0 forwards (the last of them opens warm-up 2).
        ([f0], 2 * (p - 1 - d)),
        # Warm-up 2: both chunks forward in turn while the first chunk-1 gradient starts at device 0 (the
        # loss) and comes down the chunk-1 stages: 2p chunk activations are now held.
        ([f0, f1], d + 1),
        # Warm-up 3: chunk-1 gradients arrive before any chunk-0 one (that has to go down to the bottom of
        # the V and climb back up). Split, so the gradient moves on after B alone; W runs at once, freeing
        # the activation that the next F1 takes.
        ([b1, w, f1], p - 1 - d),
        # Overlap: the steady state. Each round takes one microbatch into each chunk and retires one from
        # each, every forward running together with a full backward of the other chunk. It runs until
        # chunk 0 has had all m forwards (2p-1-d of them ran in the warm-up).
        ([f0, bw1, with_next[1], bw0], int(turn)),
        ([with_next[0], bw1, with_next[1], bw0], steady - int(turn)),
        # Tail: chunk 1 is p-1-d forwards behind chunk 0 (warm-up 3 ran p-1-d of its forwards, warm-up 2
        # d+1); the same rounds without F0 run them.
        ([bw1, with_next[1], bw0], p - 1 - d),
        (cool, 1),
        # The last p-1-d chunk-0 gradients come one every other slot (the device below runs its own B
        # between): a deferred W fills each gap.
        ([w, (B, 0)], p - 1 - d),
        # The d+1 Ws still deferred close the step.
        ([w], d + 1),
    )
    return kind, oldest_first(kind, chunk), paired  # deferred Ws run oldest first


def dualpipev(devices: int, microbatches: int) -> Schedule:
    """DualPipeV: V placement, one copy of the parameters, F&B overlap in the steady state, B/W split at the ends.

    Needs at least 2p microbatches, as DeepSeek's DualPipeV and torch's ScheduleDualPipeV do.
    """
    p, m = devices, microbatches
    if p < 1:
        raise ConfigError(f"dualpipev needs at least 1 device (got {p})")
    if m < 2 * p:
        raise ConfigError(f"dualpipev needs at least 2p = {2 * p} microbatches on {p} devices (got {m}); "
                          f"use --microbatches {2 * p} or more")
    rows = []
    for d in range(p):
        kind, chunk, paired = _device_passes(p, m, d)
        rows.append((kind, v_stage(p, d, chunk), paired))  # chunk 0 is stage d, chunk 1 stage 2p-1-d
    return Schedule("dualpipev", p, 2 * p, m, (v_placement(p),), counted_rows(rows, m))
