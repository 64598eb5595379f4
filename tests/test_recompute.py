"""Stage-aware recomputation: the plan against brute force over the simulator, and real runs on CPU."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipefold.errors import ConfigError
from pipefold.ir import Schedule
from pipefold.plan.recompute import StageProfile, plan_recompute, smallest_budget
from pipefold.runtime.measure.profiling import measure_stages
from pipefold.runtime.stage import Chain
from pipefold.schedules import build
from pipefold.sim.simulate import CostModel, StageOverride, simulate
from pipefold.train.prepare import make_job
from pipefold.train.reference import compare
from pipefold.train.run import train
from pipefold.train.spec import RunSpec
from pipefold.units import format_bytes, parse_bytes


def _profile(layers: int, per_layer: int, boundary: int, static: int, seconds: float) -> StageProfile:
    """A stage of equal layers: recomputing r of them keeps the input instead of their saves, rebuilt in backward."""
    kept = tuple(per_layer * (layers - r) + (boundary if r else 0) for r in range(layers + 1))
    total = tuple(per_layer * layers + (boundary if r else 0) for r in range(layers + 1))
    rerun = tuple(seconds * r for r in range(layers + 1))
    return StageProfile(layers, kept, total, total, rerun, (seconds * layers, 2 * seconds * layers, seconds * layers),
                        static)


def _brute_force(schedule: Schedule, profiles: list[StageProfile], budget: float) -> float | None:
    """Least total rerun time over every combination of counts of every stage, peaks from the full simulator."""
    best = None
    for counts in itertools.product(*(range(p.layers + 1) for p in profiles)):
        over = {s: StageOverride(f=1, b=1, w=1, memory=float(p.total[r]), kept=float(p.kept[r]),
                               memory_w=float(p.held_w[r]))
                for s, (p, r) in enumerate(zip(profiles, counts, strict=True))}
        peaks = simulate(schedule, CostModel(stage_overrides=over)).peak_memory
        static = [sum(p.static for s, p in enumerate(profiles) if schedule.placement[0][s] == d)
                  for d in range(schedule.devices)]
        if all(st + pk <= budget for st, pk in zip(static, peaks, strict=True)):
            cost = sum(p.rerun[r] for p, r in zip(profiles, counts, strict=True))
            best = cost if best is None else min(best, cost)
    return best


CASES = [("1f1b", 3, 6, {}), ("zb-h1", 3, 6, {}), ("v-half", 2, 4, {}), ("interleaved-1f1b", 2, 4, {"v": 2}),
         ("gpipe", 2, 3, {})]


@pytest.mark.parametrize(("name", "p", "m", "options"), CASES)
@settings(max_examples=15, deadline=None)
@given(layers=st.lists(st.integers(1, 3), min_size=4, max_size=4), fraction=st.floats(0.0, 1.0),
       seconds=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=4, max_size=4))
def test_auto_is_the_cheapest_plan_that_fits(name: str, p: int, m: int, options: dict[str, int],
                                             layers: list[int], fraction: float, seconds: list[float]) -> None:
    schedule = build(name, p, m, **options)
    profiles = [_profile(layers[s % 4], 100, 30, 500, seconds[s % 4]) for s in range(schedule.stages)]
    smallest = max(plan_recompute(schedule, profiles, "full").peak)
    largest = max(plan_recompute(schedule, profiles, "none").peak)
    budget = smallest + fraction * (largest - smallest)
    reference = _brute_force(schedule, profiles, budget)
    if reference is None:
        with pytest.raises(ConfigError, match="smallest reachable budget"):
            plan_recompute(schedule, profiles, "auto", budget)
        return
    plan = plan_recompute(schedule, profiles, "auto", budget)
    assert all(x <= budget for x in plan.peak)
    got = sum(pr.rerun[r] for pr, r in zip(profiles, plan.layers, strict=True))
    assert got == pytest.approx(reference)


def test_later_stages_recompute_less_under_1f1b() -> None:
    schedule = build("1f1b", 4, 8)
    profiles = [_profile(4, 100, 30, 0, 1.0) for _ in range(4)]
    # Device i holds 4 - i microbatches: 1600, 1200, 800, 400 bytes without recomputation.
    plan = plan_recompute(schedule, profiles, "auto", 900)
    assert list(plan.layers) == sorted(plan.layers, reverse=True)
    assert plan.layers[0] > 0 and plan.layers[-1] == 0
    assert max(plan.peak) <= 900 and plan.step_time > plan.step_time_without


def test_unreachable_budget_names_the_smallest_reachable() -> None:
    schedule = build("1f1b", 2, 4)
    profiles = [_profile(2, 100, 30, 1000, 1.0), _profile(2, 100, 30, 200, 1.0)]
    smallest = smallest_budget(schedule, profiles)
    assert smallest == min(max(plan_recompute(schedule, profiles, mode).peak) for mode in ("none", "full"))
    with pytest.raises(ConfigError, match=rf"device 0 needs at least .* smallest reachable budget is {smallest:.0f} "):
        plan_recompute(schedule, profiles, "auto", smallest - 1)
    assert max(plan_recompute(schedule, profiles, "auto", smallest).peak) <= smallest


def test_mode_and_budget_errors() -> None:
    schedule = build("1f1b", 2, 4)
    profiles = [_profile(2, 100, 30, 0, 1.0)] * 2
    with pytest.raises(ConfigError, match="--recompute auto needs --memory-budget"):
        plan_recompute(schedule, profiles, "auto")
    with pytest.raises(ConfigError, match="with --recompute full drop it"):
        plan_recompute(schedule, profiles, "full", 1e6)
    with pytest.raises(ConfigError, match="unknown recomputation 'some'"):
        plan_recompute(schedule, profiles, "some")


@pytest.mark.parametrize(("text", "value"), [("2000000", 2e6), ("2e6", 2e6), ("1.5MB", 1.5e6), ("64MiB", 64 * 2**20),
                                             ("3 GB", 3e9), ("512kib", 512 * 1024)])
def test_parse_bytes(text: str, value: float) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-5", "5 parsecs", "0"])
def test_parse_bytes_rejects_with_examples(text: str) -> None:
    with pytest.raises(ConfigError, match="give bytes such as 2000000, 2e6, 1.5MB or 64MiB"):
        parse_bytes(text)


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (299520, "292.5 KiB"),
                                         (2.7 * 2**20, "2.7 MiB"), (3 * 2**30, "3.0 GiB"), (2**50, "1048576.0 GiB")])
def test_format_bytes(n: float, text: str) -> None:
    assert format_bytes(n) == text


def test_measured_profiles_shrink_with_each_recomputed_layer() -> None:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
              for _ in range(6)]
    stages = [Chain(*blocks[:3]), Chain(*blocks[3:])]
    target = torch.randn(8, 16)
    profiles = measure_stages(stages, torch.randn(8, 16), target, torch.nn.functional.mse_loss, microbatches=2)
    for prof in profiles:
        # B's peak holds what F kept plus the gradient it got and what it captures for W.
        assert prof.layers == 3 and prof.total[0] > prof.kept[0] and prof.held_w[0] > 0
        assert all(a > b for a, b in itertools.pairwise(prof.kept))  # each layer recomputed keeps less
        assert all(t >= k for t, k in zip(prof.total, prof.kept, strict=True))
        assert prof.rerun[0] == 0 and list(prof.rerun) == sorted(prof.rerun)
        assert all(t > 0 for t in prof.times)
        params = sum(p.numel() * 4 for p in stages[0].parameters())
        assert prof.static == params * 4  # weights, gradients and AdamW's two moments


# --------------------------------------------------------------------------- real runs on CPU

# An even split: the default split by measured time could differ between the two jobs each test builds.
MLP = dict(model="mlp", layers=8, hidden=256, batch=1024, steps=2, optimizer="sgd", microbatches=8, partition="even")


@pytest.mark.parametrize(("schedule", "stages"), [("1f1b", 4), ("interleaved-1f1b", 2), ("zb-v", 2)])
def test_auto_fits_the_budget_on_real_runs_and_keeps_gradients(schedule: str, stages: int) -> None:
    base = dict(schedule=schedule, devices=stages, **MLP)
    # The range a budget can take: from recomputing every layer to recomputing none (measured, not run).
    full = make_job(RunSpec.flat(**base, recompute="full")).extra["recompute"]  # type: ignore[arg-type]
    sched = build(schedule, stages, 8)
    none = plan_recompute(sched, full.profiles, "none")
    smallest = smallest_budget(sched, full.profiles)
    assert smallest < max(none.peak)  # recomputation has something to give here
    budget = (smallest + max(none.peak)) / 2
    job, reports = train(RunSpec.flat(**base, recompute="auto", memory_budget=budget,  # type: ignore[arg-type]
                                      check=True))
    plan = job.extra["recompute"]
    measured = [max(s.peak_activation_bytes for s in r.steps) for r in reports]
    # What the plan predicted is what the runtime held (the runtime also holds the receive buffer it posts an
    # action ahead, which the prediction leaves out), and it fits.
    assert all(abs(m - p) <= 0.05 * p for m, p in zip(measured, plan.activation_peak, strict=True)), \
        (measured, plan.activation_peak)
    assert all(st + m <= budget for st, m in zip(plan.static, measured, strict=True))
    assert 0 < sum(plan.layers) < sum(plan.stage_layers)  # some layers recomputed, not all
    diff = compare(job, reports)
    assert diff["max_grad_rel_diff"] < 1e-6 and diff["loss_rel_diff"] < 1e-6


@pytest.mark.parametrize(("name", "p", "m", "options"), CASES)
def test_greedy_plan_for_many_combinations_still_fits(name: str, p: int, m: int, options: dict[str, int],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import pipefold.plan.recompute as recompute

    schedule = build(name, p, m, **options)
    profiles = [_profile(3, 100, 30, 500, 1.0 + s % 2) for s in range(schedule.stages)]
    smallest = smallest_budget(schedule, profiles)
    budget = (smallest + max(plan_recompute(schedule, profiles, "none").peak)) / 2
    best = _brute_force(schedule, profiles, budget)
    monkeypatch.setattr(recompute, "_EXHAUSTIVE", 1)  # every device now takes the greedy path
    plan = plan_recompute(schedule, profiles, "auto", budget)
    assert all(x <= budget for x in plan.peak)
    assert best is not None
    assert sum(pr.rerun[r] for pr, r in zip(profiles, plan.layers, strict=True)) >= best - 1e-9
