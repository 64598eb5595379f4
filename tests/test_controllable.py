"""V-Min, V-Half and V-ZB against the targets of the controllable-memory paper, and the planner over them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import build_or_refused
from pipefold import CostModel, build, names, simulate, validate
from pipefold.plan.budget import choose, evaluate

CAPS = {"v-min": lambda p: (p + 4) // 3, "v-half": lambda p: (p + 2) // 2, "v-zb": lambda p: p, "zb-v": lambda p: p}


def lower_bound(p: int, m: int, peak_m: float) -> float:
    """The paper's run-time bound for peak k chunk activations, 6m + 6p - 3k - 1 chunk slots, in time units."""
    k = 2 * peak_m  # a chunk holds half of a device's share
    return (6 * m + 6 * p - 3 * k - 1) / 2


@pytest.mark.parametrize("name", list(CAPS))
@given(p=st.integers(1, 16), m=st.integers(1, 64))
def test_v_schedules_validate_within_their_memory(name: str, p: int, m: int) -> None:
    s = build(name, p, m)
    validate(s)
    assert s.placement_name == ("v" if p > 1 else "looped") and s.stages == 2 * p
    r = simulate(s)
    assert max(r.peak_memory) <= CAPS[name](p)


def test_reference_targets_p4_m8() -> None:
    r = simulate(build("v-half", 4, 8))
    assert r.makespan <= 26.5 and max(r.peak_memory) == 3
    r = simulate(build("v-min", 4, 8))
    assert r.makespan <= 29.5 and max(r.peak_memory) == 2
    r = simulate(build("v-zb", 4, 8))
    assert r.makespan <= 25.5 and max(r.peak_memory) <= 4


@pytest.mark.parametrize("name", ["v-half", "v-min"])
@pytest.mark.parametrize("p", [4, 8, 16])
@pytest.mark.parametrize("groups", [2, 4])
def test_run_time_meets_the_papers_lower_bound(name: str, p: int, groups: int) -> None:
    m = groups * p
    r = simulate(build(name, p, m))
    bound = lower_bound(p, m, max(r.peak_memory))
    assert bound <= r.makespan <= 1.02 * bound


@pytest.mark.parametrize("p", [4, 8, 16])
def test_more_memory_buys_time(p: int) -> None:
    m = 4 * p
    t = {n: simulate(build(n, p, m)).makespan for n in ("v-min", "v-half", "v-zb", "1f1b")}
    assert t["v-zb"] < t["v-half"] < t["v-min"]
    assert t["v-zb"] < t["1f1b"]


COSTS = [CostModel(f=1, b=2, w=1), CostModel(latency=0.3), CostModel(f=1, b=1.5, w=0.5, latency=0.1)]


@pytest.mark.parametrize("name", [n for n in names()])
@pytest.mark.parametrize("cost", COSTS, ids=["F1B2W1", "latency", "mixed"])
@pytest.mark.parametrize(("p", "m"), [(4, 8), (5, 7), (8, 16)])
def test_unequal_costs_and_latency_still_run(name: str, cost: CostModel, p: int, m: int) -> None:
    s = build_or_refused(name, p, m)
    if s is None:
        return
    r = simulate(s, cost)
    busy = sum(r.busy)
    # Every pass ran, each for its cost, and the step is no shorter than the busiest device's work
    # (an all-reduce runs beside the compute: not busy).
    assert busy == pytest.approx(sum(iv.end - iv.start for row in r.timeline for iv in row if iv.action.kind != "R"))
    assert r.makespan >= max(r.busy) - 1e-9 and 0 <= r.bubble_ratio < 1


def test_v_min_repeating_bubble_under_unequal_costs() -> None:
    # With B twice as long as F, V-Min's block no longer tiles: every period leaves a gap that
    # repeats with each microbatch, so its bubble does not shrink as m grows. (Shown in the docs.)
    cost = CostModel(f=1, b=2, w=1)
    ratios = [simulate(build("v-min", 4, m), cost).bubble_ratio for m in (8, 16, 32)]
    assert min(ratios) > 0.15
    assert simulate(build("v-zb", 4, 32), cost).bubble_ratio < min(ratios)


@pytest.mark.parametrize("p", [4, 8])
def test_planner_covers_every_budget_from_v_min_to_1f1b(p: int) -> None:
    m = 2 * p
    points = evaluate(p, m)
    previous = float("inf")
    for budget in range((p + 4) // 3, p + 1):
        best = choose(points, budget)
        assert best.memory <= budget
        r = simulate(build(best.name, p, m, **best.options))
        assert r.makespan == pytest.approx(best.makespan) and max(r.peak_memory) <= budget
        assert best.makespan <= previous
        previous = best.makespan
    assert choose(points, (p + 4) // 3).makespan > choose(points, p).makespan
