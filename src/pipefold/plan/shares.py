"""How ZeRO-1 divides a device's parameters among its data-parallel copies: the one rule that the runtime steps
by (:class:`pipefold.runtime.zero.ShardedOptimizer`) and that the planner predicts each copy's optimizer state
from (:func:`pipefold.plan.budget.device_static`).

Whole tensors, largest first, each to the copy holding the fewest bytes so far: an optimizer of any kind can step
its share, but a stage of few large tensors (an embedding alone, a head) is shared unevenly, its largest tensor's
copy holding up to all of its state."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["heaviest_share", "shares"]


def shares(sizes: Sequence[int], copies: int) -> list[list[int]]:
    """The indices of ``sizes`` each of ``copies`` steps: largest first, each to the copy with the fewest bytes
    so far (the lowest-numbered of equals), every index once."""
    load = [0] * copies
    out: list[list[int]] = [[] for _ in range(copies)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        to = min(range(copies), key=lambda c: (load[c], c))
        out[to].append(i)
        load[to] += sizes[i]
    return [sorted(share) for share in out]


def heaviest_share(sizes: Sequence[int], copies: int) -> int:
    """The most that one copy steps of ``sizes`` under :func:`shares`."""
    return max(sum(sizes[i] for i in share) for share in shares(sizes, copies))
