"""V-shape schedules: ZB-V (Qi et al., 2023) and 1F1B on the V placement, from one generator.

Device d of p holds two stages of a 2p-stage chain: stage d (its chunk 0) and
stage 2p-1-d (its chunk 1). A microbatch goes down the devices and back up,
its gradient the other way; device 0 runs both the first and the last stage::

    dev 0   0 --------------- 7        F: 0 1 2 3 4 5 6 7   (p = 4)
    dev 1     1 ----------- 6          B: 7 6 5 4 3 2 1 0
    dev 2       2 ------- 5
    dev 3         3 --- 4

Every device sits at both ends of the V, so every device warms up with the
same 2p-1 forwards and peaks at the same 2p chunk activations (in 1F1B device 0
holds p microbatches and device p-1 one). A chunk pass is half a device's
share, so "a slot" below is one chunk pass (0.5 under unit costs). Device d:

    warm-up 1  2(p-d)-1 x  F0              fill the V down to the bottom and back to here
    warm-up 2  d        x  F1 F0           until the first chunk-1 gradient is back
    warm-up 3  p-d      x  F1 B1 W1        until the first chunk-0 gradient is back
    steady     m-2p+1+d x  F0 B0 W0 F1 B1 W1
    tail       p-1-d    x  B0 W0 F1 B1 W1  chunk 1 catches up with chunk 0
    cool-down  d        x  B0 B1           W deferred: gradients first
               p-d      x  B0 W0           one deferred W in each gap between gradients
               then the deferred Ws        2d of them: nobody waits for them

After warm-up 2 the device holds 2p-1 activations; from warm-up 3 on, each
forward is followed by a pass that frees one, so the peak is 2p chunk
activations: p M, 1F1B's memory. With W split off (ZB-V) every device runs
without a gap from its first pass to its last, and the makespan is 3m + (p-1)/2
for m >= 2p-1. With a fused backward BW (1F1B-V) the W passes vanish and the
same phases give 3m + 2(p-1): BW is two slots long, so a gradient crosses the V
at half the speed of a forward, and nothing fills the wait.
"""

from __future__ import annotations

from pipefold.ir import SEQ_CHUNKS, Schedule, v_placement
from pipefold.schedules._phases import BW, B, F, Ints, W, counted_rows, phases, v_stage


def _device_passes(p: int, m: int, d: int, *, split: bool, early: int = 0) -> tuple[Ints, Ints]:
    """Device d's passes for m >= 2p-1 microbatches, as in the module docstring: (kind, chunk) of each.

    The k-th pass of a kind on a chunk is for microbatch k (:func:`~pipefold.schedules._phases.counted_rows`):
    forwards and gradients take the microbatches in order, and a W follows the oldest B whose W is still to run.
    """
    f0, f1, b0, b1, w0, w1 = (F, 0), (F, 1), (B, 0), (B, 1), (W, 0), (W, 1)
    parts = [
        # Warm-up 1: microbatch 0 reaches chunk 0 here after d slots and chunk 1 after 2p-1-d (stages
        # 0..2p-2-d run first); the 2p-1-2d slots between are filled with the next chunk-0 forwards.
        ([f0], 2 * (p - d) - 1 + early),
        # Warm-up 2: a chunk-1 forward goes d stages on (to the top of the V on device 0) and its gradient d
        # stages back, so its B is ready 2d+1 slots after it started: d pairs plus warm-up 3's first F1 fill them.
        # Now 2p-1 activations are held (2p-1-d in chunk 0, d in chunk 1); the next F makes 2p, p M, the cap:
        # from here on every forward is followed in the same round by a backward (and W) that frees one.
        ([f1, f0], d),
        ([f1], early),
        # Warm-up 3: the first chunk-0 gradient leaves with B1 of microbatch 0, runs down the chunk-1 stages of
        # devices d+1..p-1 (one slot each), turns at the bottom (three) and climbs their chunk-0 stages (two
        # each: every device runs its F0 first): 3(p-d) slots, p-d rounds of three passes.
        ([f1, b1, w1], p - d),
        # Steady: one round per chunk-0 forward left (2p-1-d are done); a round takes in one microbatch on each
        # chunk and retires one, so the device stays at its cap.
        ([f0, b0, w0, f1, b1, w1], m - (2 * p - 1 - d)),
        # Tail: chunk 1 is p-1-d forwards behind chunk 0 (it entered warm-up 3 with d, chunk 0 with 2p-1-d,
        # and warm-up 3 ran p-d); the same rounds without the F0 let it catch up.
        ([b0, w0, f1, b1, w1], p - 1 - d),
        # Cool-down: d chunk-1 and p chunk-0 gradients are still to come. Bs first, Ws deferred: each B sends a
        # gradient on to a device that waits for it; a W only frees memory, which nobody needs any more.
        ([b0, b1], d),
        # The last p-d chunk-0 gradients come one every other slot (the device below runs its own B between),
        # so one deferred W fills each gap.
        ([b0, w0], p - d),
        # The 2d deferred Ws close the step; the older chunk-1 ones first.
        ([w1], d),
        ([w0], d),
    ]
    if not split:  # a fused backward: BW does the weights, and there are no Ws to run
        parts = [([(BW, c) if k == B else (k, c) for k, c in pattern if k != W], times) for pattern, times in parts]
    kind, chunk, _ = phases(*parts)
    return kind, chunk


def _v_schedule(devices: int, microbatches: int, *, split: bool, name: str, seq_chunks: int = 1) -> Schedule:
    """The V-shape phases for every device, with a split (ZB-V) or fused (1F1B-V) backward.

    With c ``seq_chunks`` the passes are of sequence chunks: m·c units, each device running c-1 forwards of each
    of its stages earlier than it would, as a microbatch's last chunk must have gone forward before its gradient
    can start back; the device then holds 2p+2(c-1) chunk activations, (p+c-1)/c microbatches."""
    p, c = devices, seq_chunks
    m = microbatches * c
    # The phases assume device 0's warm-up of 2p-1 chunk-0 forwards exists. With fewer microbatches they
    # are counted for 2p-1 and the passes of the microbatches that do not exist are left out.
    padded = max(m, 2 * p - 1) + c - 1
    rows = []
    for d in range(p):
        kind, chunk = _device_passes(p, padded, d, split=split, early=c - 1)
        rows.append((kind, v_stage(p, d, chunk)))  # chunk 0 is stage d, chunk 1 stage 2p-1-d
    options = {SEQ_CHUNKS: c} if c > 1 else {}
    return Schedule(name, p, 2 * p, m, (v_placement(p),), counted_rows(rows, m, chunks=c), options)


def zb_v(devices: int, microbatches: int, seq_chunks: int = 1) -> Schedule:
    """ZB-V: V placement, B/W split and W filling the gaps; almost no bubble at 1F1B's memory."""
    return _v_schedule(devices, microbatches, split=True, name="zb-v", seq_chunks=seq_chunks)


def one_f_one_b_v(devices: int, microbatches: int, seq_chunks: int = 1) -> Schedule:
    """1F1B on the V placement: fused backward, a warm-up of 2p-1 forwards, then one forward one backward."""
    return _v_schedule(devices, microbatches, split=False, name="1f1b-v", seq_chunks=seq_chunks)
