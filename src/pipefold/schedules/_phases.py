"""Phase helpers shared by the schedule families: warm-up, steady alternation, cool-down."""

from __future__ import annotations

from collections.abc import Sequence

from pipefold.ir import Action


def groups(items: Sequence[Action], size: int) -> list[list[Action]]:
    """Split ``items`` into consecutive groups of ``size`` (the last one may be shorter)."""
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def warmup_steady_cooldown(forwards: Sequence[Sequence[Action]], backwards: Sequence[Sequence[Action]],
                           warmup: int) -> list[Action]:
    """Order one device's passes the 1F1B way, in groups.

    - warm-up: the first ``warmup`` forward groups, filling the pipeline;
    - steady: one forward group, then one backward group, while forwards remain;
    - cool-down: the remaining backward groups, draining it.

    With groups of one this is 1F1B; with one group of all microbatches, GPipe.
    """
    warmup = min(warmup, len(forwards))
    order = [a for group in forwards[:warmup] for a in group]
    pending = list(backwards)
    for group in forwards[warmup:]:
        order += group  # 1 forward (group) ...
        order += pending.pop(0)  # ... 1 backward (group)
    for group in pending:
        order += group
    return order
