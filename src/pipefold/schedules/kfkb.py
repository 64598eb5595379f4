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

from pipefold.errors import ConfigError
from pipefold.ir import SEQ_CHUNKS, Schedule, linear_placement
from pipefold.schedules._phases import BW, F, counted_rows, warmup_steady_cooldown


def kfkb(devices: int, microbatches: int, k: int = 2, *, seq_chunks: int = 1, name: str = "kfkb",
         warmup_extra: int = 0) -> Schedule:
    """Groups of k forwards then k backwards, 1F1B-style, on a linear placement.

    With c ``seq_chunks`` the passes are of sequence chunks (Seq1F1B): m·c units in groups of k units, and every
    device warms up with more groups (:func:`_chunk_warmup`), as a microbatch's last chunk must have gone forward
    before its gradient can start back; for 1F1B device i then holds p-i+c-1 chunks, (p-i+c-1)/c microbatches.
    ``warmup_extra``: groups every device adds to its warm-up (each holds that many more in flight).
    """
    p, c = devices, seq_chunks
    n = microbatches * c
    rows = []
    for i in range(p):
        stage = np.full(n, i)
        # Device i needs p-1-i groups in flight before the first gradient can come back.
        rows.append(warmup_steady_cooldown((np.full(n, F), stage), (np.full(n, BW), stage),
                                           warmup=p - 1 - i + _chunk_warmup(c, k) + warmup_extra, size=k))
    options = {"k": k} if name == "kfkb" else {}
    if c > 1:
        options[SEQ_CHUNKS] = c
    return Schedule(name, p, p, n, (linear_placement(p),), counted_rows(rows, n, chunks=c), options)


def one_f_one_b(devices: int, microbatches: int, seq_chunks: int = 1, warmup_extra: int = 0,
                combined: int = 0) -> Schedule:
    """1F1B: after a warm-up of p-1-i forwards (``warmup_extra`` more), device i alternates one forward and one
    backward.

    ``combined`` (combined 1F1B, as Megatron-core's for expert parallelism): each forward of the steady state runs
    together with the backward after it, as one overlapped pair, so that one microbatch's expert all-to-alls run
    under the other's compute. A pair starts once both its inputs are there and hands its outputs on at its end,
    so device i warms up with p-i forwards more: with 1F1B's warm-up each device's pair would wait for the next
    device's pair, which waits for the device's previous one, and no two devices would compute at once. Device i
    then holds 2(p-i) microbatches, twice 1F1B's."""
    if not combined:
        return kfkb(devices, microbatches, k=1, seq_chunks=seq_chunks, name="1f1b", warmup_extra=warmup_extra)
    if seq_chunks > 1 or warmup_extra:
        raise ConfigError("1f1b:combined=1 pairs the passes of whole microbatches on the last stage: drop "
                          "seq_chunks and vocab, or combined")
    p, rows = devices, []
    if microbatches < 2 * p - 1:
        raise ConfigError(f"1f1b:combined=1 on {p} devices needs at least {2 * p - 1} microbatches (the first device "
                          f"warms up with {2 * p - 1} forwards before its first pair), got {microbatches}: use "
                          f"--microbatches {2 * p - 1} or more")
    for i in range(p):
        stage = np.full(microbatches, i)
        warmup = 2 * (p - i) - 1
        kind, stage = warmup_steady_cooldown((np.full(microbatches, F), stage), (np.full(microbatches, BW), stage),
                                             warmup=warmup)
        steady = (kind == F) & (np.cumsum(kind == F) > warmup)  # the forwards after the warm-up's
        rows.append((kind, stage, steady))
    return Schedule("1f1b", p, p, microbatches, (linear_placement(p),), counted_rows(rows, microbatches),
                    {"combined": 1})


def gpipe(devices: int, microbatches: int, seq_chunks: int = 1) -> Schedule:
    """GPipe: every forward, then every backward."""
    return kfkb(devices, microbatches, k=microbatches * seq_chunks, seq_chunks=seq_chunks, name="gpipe")


def _chunk_warmup(c: int, k: int) -> int:
    """The forward groups of k units beyond 1F1B's warm-up that c sequence chunks need: backward group j takes the
    gradients of units jk..(j+1)k-1, each microbatch's chunks last first, so the forwards before it (warm-up plus
    j+1 groups) must reach the end of the last microbatch it touches, ceil((j+1)k/c)·c units. The pattern repeats
    every c groups."""
    return max(0, *(-(-(-(-(j + 1) * k // c) * c) // k) - 1 - j for j in range(c)))
