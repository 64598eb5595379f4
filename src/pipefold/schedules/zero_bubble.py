"""Zero Bubble handcrafted schedules ZB-H1 and ZB-H2 (Qi et al., 2023).

The backward is split into B (gradient of the stage input, on the critical
path) and W (gradient of the weights, needed only by the optimizer). B goes
upstream as fast as it can; W waits and fills what would otherwise be bubbles.

Both schedules share one generator. Device i of p:

    warm-up  : `warmup` forwards
    steady   : B, then W once more than `defer` Ws are pending, then F
    cool-down: the remaining B, each followed by a W while more than `defer` are pending,
               then the deferred Ws

A W frees the activation its F took, so a device's peak is warmup + defer
microbatches.

- ZB-H1: warmup p-i, defer i, peak p (1F1B's memory); the tail of deferred Ws
  shrinks the bubble to (p-1)(F+B-W).
- ZB-H2: warmup 2(p-i)-1, fills the start-up bubble with extra forwards;
  defer 2i, peak 2p-1, bubble (p-1)(F+B-2W) under the paper's accounting.
  With few microbatches (m < p+i) so long a tail of Ws would start after the
  last B had arrived, lengthening the step instead of filling gaps; there
  the deferral falls back to ZB-H1's i.
- ZB-H (``extra`` = 0..p-1) steps from the one to the other, one extra
  microbatch of memory at a time: the planner's knob for how far Ws are deferred.
"""

from __future__ import annotations

import numpy as np

from pipefold.ir import SEQ_CHUNKS, Schedule, linear_placement
from pipefold.schedules._phases import B, F, Ints, W, counted_rows


def _device_kinds(m: int, warmup: int, defer: int) -> Ints:
    """One device's passes (their kinds; microbatches in order, :func:`~pipefold.schedules._phases.counted_rows`):
    ``warmup`` forwards, then round k for each gradient k: its B, the W of gradient k - ``defer`` once that many
    are pending, and the next forward while forwards remain (steady, then cool-down); then the deferred tail of
    Ws."""
    w = min(warmup, m)
    k = np.arange(m)
    there = np.stack((np.ones(m, dtype=bool), k >= defer, k + w < m), axis=1)
    rounds = np.broadcast_to(np.array([B, W, F]), there.shape)[there]
    return np.concatenate((np.full(w, F), rounds, np.full(min(defer, m), W)))


def zb_h(devices: int, microbatches: int, extra: int = 0, *, seq_chunks: int = 1, name: str = "zb-h") -> Schedule:
    """Zero Bubble between H1 and H2: ``extra`` more warm-up forwards and deferred Ws per device.

    Device i spends ``extra`` microbatches of memory beyond ZB-H1's p: first on
    warm-up forwards (up to p-1-i of them: more could not start before the
    first gradient returns), the rest on deferring more Ws (up to i), so its
    peak is p + extra until both run out. extra = 0 is ZB-H1, p-1 is ZB-H2.

    With c ``seq_chunks`` the passes are of sequence chunks: m·c units, and every device warms up with c-1 more,
    as a microbatch's last chunk must have gone forward before its gradient can start back.
    """
    p, c = devices, seq_chunks
    m = microbatches * c
    rows = []
    for i in range(p):
        more_warmup = min(extra, p - 1 - i)
        warmup = p - i + more_warmup + c - 1
        defer = i + min(extra - more_warmup, i)
        kind = _device_kinds(m, warmup=warmup, defer=min(defer, max(i, m - (p - i))))
        rows.append((kind, np.full(len(kind), i)))
    options: dict[str, int] = {"extra": extra} if name == "zb-h" else {}
    if c > 1:
        options[SEQ_CHUNKS] = c
    return Schedule(name, p, p, m, (linear_placement(p),), counted_rows(rows, m, chunks=c), options)


def zb_h1(devices: int, microbatches: int, seq_chunks: int = 1) -> Schedule:
    """ZB-H1: 1F1B with B/W split and deferred W, at 1F1B's memory."""
    return zb_h(devices, microbatches, 0, seq_chunks=seq_chunks, name="zb-h1")


def zb_h2(devices: int, microbatches: int, seq_chunks: int = 1) -> Schedule:
    """ZB-H2: extra warm-up forwards fill the start-up bubble, at about twice 1F1B's memory."""
    return zb_h(devices, microbatches, devices - 1, seq_chunks=seq_chunks, name="zb-h2")
