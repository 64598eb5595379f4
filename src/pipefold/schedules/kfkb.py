"""GPipe, 1F1B and kFkB: one generator, k microbatches per group.

Device i of p, groups of k microbatches, forward F and fused backward BW::

    warm-up  : (p-1-i) forward groups      fill the pipeline below device i
    steady   : 1 forward group, 1 backward group
    cool-down: the remaining backward groups

k = 1 is 1F1B (PipeDream-Flush): device i holds at most p-i microbatches.
k = m is GPipe: all forwards, then all backwards; every device holds m.
In between, device i holds min(m, k(p-i)) microbatches; larger groups hide
communication delay on a slow or shared network (Ada-Grouper tunes k).
"""

from __future__ import annotations

import numpy as np

from pipefold.ir import Schedule, linear_placement
from pipefold.schedules._phases import BW, F, counted_rows, warmup_steady_cooldown


def kfkb(devices: int, microbatches: int, k: int = 2, *, name: str = "kfkb") -> Schedule:
    """Groups of k forwards then k backwards, 1F1B-style, on a linear placement."""
    p, m = devices, microbatches
    rows = []
    for i in range(p):
        stage = np.full(m, i)
        # Device i needs p-1-i groups in flight before the first gradient can come back.
        rows.append(warmup_steady_cooldown((np.full(m, F), stage), (np.full(m, BW), stage),
                                           warmup=p - 1 - i, size=k))
    options = {"k": k} if name == "kfkb" else {}
    return Schedule(name, p, p, m, (linear_placement(p),), counted_rows(rows, m), options)


def one_f_one_b(devices: int, microbatches: int) -> Schedule:
    """1F1B: after a warm-up of p-1-i forwards, device i alternates one forward and one backward."""
    return kfkb(devices, microbatches, k=1, name="1f1b")


def gpipe(devices: int, microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward."""
    return kfkb(devices, microbatches, k=microbatches, name="gpipe")
