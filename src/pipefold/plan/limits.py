"""How large a planner's search may grow: one limit, :data:`MAX_SEARCH_WORK`, on the work a search takes on,
counted before any of it is done.

A search (:func:`pipefold.plan.budget.plan`, :func:`~pipefold.plan.budget.plan_model` over one pipeline or every
layout of a world, :func:`pipefold.plan.cluster_plan.plan_cluster`, ``train --schedule auto``'s candidates)
builds and simulates candidates, and what it is given grows it in several directions at once: more devices bring
more stages, more options (zb-h's ``extra`` runs to p - 1) and larger tables; more microbatches more passes and
more options (kFkB's ``k`` runs to m); a world more layouts (a mesh per device makes every order of the measured
degrees one); a cluster more (dp, tp, pp). One schedule is bounded by the IR's limits
(:data:`pipefold.ir.MAX_DEVICES`, :data:`pipefold.ir.MAX_STAGE_MICROBATCHES`); a search of many is bounded here,
by the sum of their work (:func:`work`), so that whichever way it grows it is refused in one line before it
starts (:func:`check_search`), naming what it would take and what fits, rather than seeming to hang.

The unit is a stage-microbatch pair to simulate. A candidate of s stages, m microbatches and p devices is
s x (m + p / 8) of them (its passes, and the tables of its dependency graph, a row of p entries per stage: on 512
devices these, not the passes, take most of the time) and :data:`CANDIDATE_WORK` more. Measured on this
repository's 2-core machine, searches run 1 to 4 us a unit: ``plan -p 64 -m 64``, 4.2 million, 7.7 s; ``plan -p
512 -m 8``, 45 million, 46 s; a world of 16 ranks of a 6-layer profile at tp 1 and 2, 7.3 million, 12 s; 128
H100s for Llama 3 70B, 10.4 million, 25 to 37 s. So the limit stops a search at about a minute; within it, the
commands show a bar of the candidates done of all. Not counted: the exact split of many layers over interleaved
stages (:func:`pipefold.plan.partition.partition_memory_on_devices`' tree search), which on a mesh per device of
32 layers takes seconds a candidate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipefold import schedules
from pipefold.errors import ConfigError
from pipefold.ir import MAX_DEVICES, MAX_STAGE_MICROBATCHES
from pipefold.models.size import largest

__all__ = ["CANDIDATE_WORK", "MAX_SEARCH_WORK", "TABLE_SHARE", "check_search", "largest", "schedule_work",
           "stages_of", "work"]

MAX_SEARCH_WORK = 50_000_000
"""The most work one search may take on, in stage-microbatch pairs to simulate (:func:`work`), summed over its
candidates: about a minute here (see the module)."""

TABLE_SHARE = 8
"""A schedule's dependency tables cost one pair's work per stage for every ``TABLE_SHARE`` devices (measured: see
the module)."""

CANDIDATE_WORK = 1_000
"""What every candidate costs besides its pairs and tables, in pairs: building, splitting and costing a schedule
of a few stages takes a millisecond or two here, as long as a thousand pairs."""


def work(stages: int, microbatches: int, devices: int) -> int:
    """The work of one candidate, a schedule of ``stages`` stages on ``devices`` devices with ``microbatches``
    microbatches, in stage-microbatch pairs: its pairs, its tables (:data:`TABLE_SHARE`) and
    :data:`CANDIDATE_WORK`."""
    return stages * (microbatches + devices // TABLE_SHARE) + CANDIDATE_WORK


def stages_of(name: str, devices: int, options: Mapping[str, Any]) -> int:
    """How many stages registered schedule ``name`` has on ``devices`` devices with ``options`` (the family's
    defaults for the others), without building it."""
    spec = schedules.get(name)
    return devices * spec.stages_per_device({o.name: o.default for o in spec.options} | dict(options))


def schedule_work(name: str, devices: int, microbatches: int, options: Mapping[str, Any]) -> int:
    """The work (:func:`work`) of building and simulating registered schedule ``name``; 0 for one that
    :func:`pipefold.schedules.build` refuses before generating anything (over the IR's limits)."""
    stages = stages_of(name, devices, options)
    if devices > MAX_DEVICES or stages * microbatches > MAX_STAGE_MICROBATCHES:
        return 0
    return work(stages, microbatches, devices)


def check_search(total: int, candidates: int, what: str, fix: str) -> None:
    """Refuse a search of ``candidates`` candidates whose work adds up to ``total`` (:func:`work`) over
    :data:`MAX_SEARCH_WORK`, in one line: ``what`` the search is ("planning 512 devices with 8 microbatches") and
    ``fix``, what would fit ("use at most 360 devices")."""
    if total > MAX_SEARCH_WORK:
        raise ConfigError(f"{what} is a search of {candidates:,} candidates, {total:,} stage-microbatch pairs to "
                          f"simulate, over the planner's limit of {MAX_SEARCH_WORK:,} (about a minute): {fix}")
